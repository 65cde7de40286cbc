"""`pdserve sim --calibrate`: time our engine's steps on this machine and fit a profile.

Three sources of steps, one fit:

- the engine alone (`calibrate`, the default): exact control of every batch;
- a served engine (`calibrate_served`, `--served`): the same kinds of batches
  sent as streamed HTTP requests to `pdserve serve` started with
  `--step-trace`, each step timed inside the server, so what serving adds
  to a step (the event loop, detokenised deltas, SSE) is in the profile;
- a step trace of any served run (`fit_trace`, `--from-trace FILE`), e.g. of
  each worker of a disaggregated deployment, which gives one profile per role.

The engine (pdserve/engine/llm_engine.py, the embedded SmolLM2 unless told
otherwise) runs a grid of batches: prompts alone (32 to 1,024 tokens),
decode batches (1 to 8 sequences at 64 and 512 tokens of context), prompts
joining a running decode batch, and a 2,048-token prompt in chunks beside
decodes. Every step is timed by the engine itself (a step observer: the
record a served engine writes to its step trace), so sampling and
bookkeeping are in it, and its `StepShape` is read from the step's rows,
as a trace's is. `ProfileLatency.fit` then finds t = a + b*prefill_tokens +
c*decode_seqs + d*decode_context + e*prefill_attention (+ f when the step has
prompt tokens: another code path; + g per pass of the tiled kernels over the
quantized weights in a step of few rows, or h once when a step of more rows
multiplies the dense weights), weighted to minimise
relative error (a 12 ms decode step matters as much as a 4 s prefill). About a
minute on an idle machine.
"""

from __future__ import annotations

import asyncio
import bisect
import os
import tempfile
import time

import httpx
import numpy as np

from pdserve.bench.client import RequestOutput, make_client, request_body, send
from pdserve.bench.datasets import Request
from pdserve.bench.tokens import TokenSource
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.loader import load_model_info
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.step_trace import read
from pdserve.sim.latency import SLOW_OUTLIER, ProfileLatency, StepShape
from pdserve.testing.serve import Serve

# Batches of the size a CPU engine serves (up to 8 sequences, prompts up to 2,048 tokens): the
# engine's kernels change regime with the batch, so a fit is only good where it was measured.
# (2,048-token prompts are measured joining a batch and in chunks; alone they only cost time)
PREFILL_LENGTHS = (32, 128, 512, 1024)
DECODE_GRID = ((1, 64), (2, 64), (4, 64), (6, 64), (8, 64), (1, 512), (4, 512))
MIXED_GRID = ((2, 256), (4, 1024), (6, 2048), (6, 512))  # (decode batch, joining prompt tokens)
CHUNKED_GRID = ((6, 256),)  # (decode batch, chunk tokens): a 2,048-token prompt in chunks
DECODE_STEPS = 6
# Our engine's small-batch GGUF kernels stream the weights once per 4 activation rows
# (csrc/gguf_matmul.cpp, by_row_tiles) for steps of up to 16 rows in float32 (engine/model.py,
# gguf_rows_limit; 2 in bfloat16): the staircase the profile's g term prices. A calibration
# on the engine reads its own limit; one from traces, which do not say the engine's dtype,
# fits each of the engine's limits and keeps the one that fits the steps better.
ENGINE_ROW_TILE = 4
ENGINE_TILE_LIMITS = (16, 2)  # gguf_rows_limit: float32 (and int8 activations), bfloat16


def _shape(rows) -> StepShape:
    """The shape of a step from its rows ([tokens computed before, tokens computed, 1 if a
    decode] per sequence: `StepRecord.rows`, a trace record's "seqs")."""
    shape = StepShape()
    for done, n, decode in rows:
        shape.add(int(done), int(n), bool(decode))
    return shape


class _Driver:
    def __init__(self, engine):
        self.engine = engine
        self.samples: list[tuple[StepShape, float]] = []
        self._n = 0
        self._vocab = engine.model_config.vocab_size
        self._recording = False
        engine.add_step_observer(self._on_step)

    def _on_step(self, step) -> None:
        if self._recording:
            shape = _shape(step.rows)
            if shape.tokens:
                self.samples.append((shape, step.seconds))

    def add(self, prompt_tokens: int, max_tokens: int):
        self._n += 1
        # distinct ids per request: no prefix-cache hits in a calibration
        ids = [(self._n * 7919 + i * 31) % (self._vocab - 200) + 100 for i in range(prompt_tokens)]
        return self.engine.add_request(
            f"cal-{self._n}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        )

    def step(self, record: bool = True) -> None:
        self._recording = record
        self.engine.step()

    def drain(self, record: bool = True) -> None:
        while self.engine.has_unfinished_requests():
            self.step(record)


def calibrate(threads: int = 1, model: str | None = None, log=print) -> ProfileLatency:
    t0 = time.perf_counter()
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=model, threads=threads, max_num_batched_tokens=8192, max_num_seqs=64, enable_chunked_prefill=True
        )
    )
    d = _Driver(engine)
    for _ in range(4):  # warm-up: the first calls load kernels and allocate (decode and prefill paths)
        d.add(256, 8)
    d.drain(record=False)
    for n in PREFILL_LENGTHS:
        d.add(n, 1)
        d.drain()
    for batch, ctx in DECODE_GRID:
        for _ in range(batch):
            d.add(ctx, DECODE_STEPS + 1)
        d.drain()
    for batch, prompt in MIXED_GRID:
        for _ in range(batch):
            d.add(64, 4)
        d.step(record=False)  # their prefill
        d.add(prompt, 1)
        d.drain()
    # chunked prefill: later chunks attend to the earlier ones (the budget is read at every step)
    sc = engine.scheduler.config
    budget = sc.max_num_batched_tokens
    for batch, chunk in CHUNKED_GRID:
        for _ in range(batch):
            d.add(64, 64)
        d.step(record=False)
        sc.max_num_batched_tokens = chunk + batch
        d.add(2048, 1)
        d.drain()
        sc.max_num_batched_tokens = budget
    mc = engine.model_config
    dtype_bytes = 2 if engine.config.device.dtype in ("bfloat16", "float16") else 4
    prof = ProfileLatency.fit(
        d.samples,
        model_layers=mc.num_hidden_layers,
        row_tile=ENGINE_ROW_TILE,
        tile_max_rows=engine.runner.model.gguf_max_rows,
        kv_bytes_per_token_=float(mc.kv_bytes_per_token(dtype_bytes)),
        threads=threads,
        source=f"pdserve engine, {mc.name}, {engine.config.device.dtype}, "
        f"{threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}",
    )
    prof.num_blocks = engine.block_manager.num_blocks
    prof.block_size = engine.block_manager.block_size
    log(
        f"calibrated on {len(d.samples)} steps in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{k}={v:.3g}" for k, v in zip("abcdefgh", prof.coef))
    )
    fit_warnings(prof, d.samples, log)
    return prof


# A fit whose steps scatter more than this around it (relative RMS, the left-out slow steps
# aside) describes a busy machine, not the engine.
NOISY_FIT = 0.25


def fit_warnings(prof: ProfileLatency, samples: list[tuple[StepShape, float]], log=print) -> None:
    """Say what the fit left out, and when its steps scatter too much to trust it."""
    if prof.num_slow_dropped:
        log(
            f"left out {prof.num_slow_dropped} of {len(samples)} steps that ran more than "
            f"{SLOW_OUTLIER:g}x their fit (something else had the CPU)"
        )
    kept = [(s, t) for s, t in samples if t <= SLOW_OUTLIER * prof.step_s(s)]
    rms = relative_rms(prof, kept)
    if rms > NOISY_FIT:
        log(
            f"warning: the steps scatter {rms:.0%} (RMS) around this fit: the machine was probably busy; "
            "calibrate again on an idle machine before trusting the profile"
        )


# ---- profiles from served steps


def trace_samples(records: list[dict]) -> list[tuple[StepShape, float]]:
    """(shape, seconds) per traced step. A step's time is from its start to the next step's
    start when the engine went straight on (what the streams see between two tokens,
    including the server's work between steps), else its own duration."""
    return [x for x in _samples_by_record(records) if x is not None]


def _samples_by_record(records: list[dict]) -> list[tuple[StepShape, float] | None]:
    out = []
    for i, rec in enumerate(records):
        shape = _shape(rec["seqs"])
        if not shape.tokens:
            out.append(None)
            continue
        nxt = records[i + 1] if i + 1 < len(records) else None
        dt = (nxt["t0"] if nxt is not None and not nxt.get("idle") else rec["t1"]) - rec["t0"]
        out.append((shape, dt))
    return out


BESIDE_MIN_BUSY = 0.5


def _busy_share(records: list[dict], others: list[dict]) -> list[float]:
    """For each step of `records`, the share of its duration during which another engine (its
    steps `others`, in order, one at a time) was running one."""
    starts = [o["t0"] for o in others]
    out = []
    for r in records:
        a, b = r["t0"], r["t1"]
        busy = 0.0
        i = max(bisect.bisect_right(starts, a) - 1, 0)
        while i < len(others) and others[i]["t0"] < b:
            busy += max(0.0, min(others[i]["t1"], b) - max(others[i]["t0"], a))
            i += 1
        out.append(busy / (b - a) if b > a else 0.0)
    return out


def fit_trace(
    paths: list[str],
    *,
    since: float | None = None,
    until: float | None = None,
    threads: int = 0,
    model: str | None = None,
    source: str = "",
    probes: list[list[float]] | None = None,
    windows: list[list[float]] | None = None,
    beside: list[str] | None = None,
    tile_max_rows: int | None = None,
    log=print,
) -> ProfileLatency:
    """A profile from step traces (engine/step_trace.py), steps started in [since, until] (or in
    any of `windows`); with `drive_grid`'s probes, the request round trip too (`request_rtt_s`).

    `beside`: traces of the engines that serve alongside (a prefill worker's decode pool on the
    same host). Only steps during which the busiest of them ran at least BESIDE_MIN_BUSY of the
    time are kept, and steps of few rows (the only samples of the tiled kernels' regime): in
    service a busy prefill worker has a busy decode pool beside it, and on a shared host a
    prefill step beside an idle decode worker ran 6-7% faster; the grid's decode batches leave
    it idle for a while."""
    samples = []
    for path in paths:
        for lo, hi in windows or [(since, until)]:
            records = read(path, lo, hi)
            if beside:
                shares = [_busy_share(records, read(p, lo, hi)) for p in beside]
                busiest = [max(s) for s in zip(*shares)]
                keep = [
                    share >= BESIDE_MIN_BUSY
                    or sum(n for _, n, _ in r["seqs"]) <= (tile_max_rows or max(ENGINE_TILE_LIMITS))
                    for r, share in zip(records, busiest)
                ]
                samples += [x for x, k in zip(_samples_by_record(records), keep) if k and x is not None]
            else:
                samples += trace_samples(records)
    if len(samples) < 8:
        raise ValueError(f"{', '.join(paths)}: {len(samples)} traced steps in the window; a fit needs at least 8")
    layers, kv_bytes = _model_shape(model)
    fits = [
        ProfileLatency.fit(
            samples,
            model_layers=layers,
            kv_bytes_per_token_=kv_bytes,
            threads=threads,
            row_tile=ENGINE_ROW_TILE,
            tile_max_rows=limit,
            source=source
            or f"served steps of {', '.join(os.path.basename(p) for p in paths)}, {time.strftime('%Y-%m-%d %H:%M')}",
        )
        for limit in ([tile_max_rows] if tile_max_rows is not None else ENGINE_TILE_LIMITS)
    ]
    prof = min(fits, key=lambda f: relative_rms(f, samples))
    if len(fits) > 1:
        log(
            "GGUF row limit: "
            + ", ".join(f"{f.tile_max_rows} rows fits within {relative_rms(f, samples):.1%}" for f in fits)
            + f"; kept {prof.tile_max_rows}"
        )
    if probes:  # the front engine's trace (the first path) holds the probes' steps
        prof.request_rtt_s = request_rtt(read(paths[0]), probes)
    # the pool `pdserve serve` allocates by default (--kv-cache-memory-bytes 1 GiB, blocks of 16)
    prof.block_size = 16
    prof.num_blocks = int(DEFAULT_KV_CACHE_BYTES // (kv_bytes * prof.block_size)) if kv_bytes else 0
    log(
        f"fitted on {len(samples)} served steps: "
        + ", ".join(f"{k}={v:.3g}" for k, v in zip("abcdefgh", prof.coef))
        + f"; request round trip {1000 * prof.request_rtt_s:.1f} ms"
    )
    fit_warnings(prof, samples, log)
    return prof


def _model_shape(model: str | None) -> tuple[int, float]:
    """Layers and fp32 KV bytes per token of the served model (read from its config, no weights)."""
    mc = load_model_info(model).config
    return mc.num_hidden_layers, float(mc.kv_bytes_per_token(4))


# The served grid: the same kinds of batches as the engine-alone grid, sent as requests.
DEFAULT_KV_CACHE_BYTES = 1 << 30  # pdserve serve's --kv-cache-memory-bytes
SERVED_DECODE_TOKENS = 16  # per request of a decode batch: joining takes a few steps, the rest is steady
SERVED_BACKGROUND_TOKENS = 24  # the decodes a joining prompt meets


def served_model(url: str) -> tuple[str, int | None]:
    """The id a server (or router) serves and its context length, from /v1/models."""
    card = httpx.get(url.rstrip("/") + "/v1/models", timeout=30, trust_env=False).json()["data"][0]
    return card["id"], card.get("max_model_len")


class _Client:
    def __init__(self, url: str, model: str, tokens, max_model_len: int | None = None, seed: int = 0):
        self.url, self.model, self.tokens = url.rstrip("/") + "/v1/completions", model, tokens
        # a small model's context caps the grid's prompts (decodes still fit after them)
        self.max_prompt = (max_model_len - SERVED_BACKGROUND_TOKENS - 1) if max_model_len else None
        self.rng = np.random.default_rng(seed)

    async def _send(self, client, prompt_tokens: int, max_tokens: int, out) -> None:
        req = Request(self.tokens.random_ids(self.rng, prompt_tokens), prompt_tokens, max_tokens)
        # t0 = 0: start_s is then the send time on the clock the step traces use (CLOCK_MONOTONIC)
        await send(
            client,
            self.url,
            request_body(req, self.model, "/v1/completions", ignore_eos=True, temperature=0.0),
            out,
            0.0,
            chat=False,
        )

    async def request(self, client, prompt_tokens: int, max_tokens: int):
        prompt_tokens = min(prompt_tokens, self.max_prompt or prompt_tokens)
        out = RequestOutput(prompt_len=prompt_tokens)
        await self._send(client, prompt_tokens, max_tokens, out)
        _raise_if_failed([out])
        return out

    async def batch(self, client, prompt_tokens: int, max_tokens: int, n: int):
        return await asyncio.gather(*(self.request(client, prompt_tokens, max_tokens) for _ in range(n)))

    async def join(self, client, batch: int, prompt_tokens: int, background_prompt: int = 64) -> None:
        """`batch` streams decoding, then a prompt of `prompt_tokens` arrives among them."""
        outs = [RequestOutput(prompt_len=background_prompt) for _ in range(batch)]
        tasks = [asyncio.create_task(self._send(client, background_prompt, SERVED_BACKGROUND_TOKENS, o)) for o in outs]
        while not all(o.itl_s or o.error for o in outs) and not all(t.done() for t in tasks):
            await asyncio.sleep(0.005)  # every stream has its second token: the batch is decoding
        await self.request(client, prompt_tokens, 1)
        await asyncio.gather(*tasks)
        _raise_if_failed(outs)


def _raise_if_failed(outs) -> None:
    bad = [o for o in outs if o.error]
    if bad:
        raise RuntimeError(f"calibration request ({bad[0].prompt_len} tokens) failed: {bad[0].error}")


RTT_PROBES = 8  # lone 8-token prompts sent one by one to the idle server, before the grid


async def drive_grid(url: str, tokens, log=print, background_streams: int = 0) -> list[list[float]]:
    """Send the served grid to a running server (or router) at `url`. Returns the round-trip
    probes: [send, end] of each lone one-token request sent first (see `request_rtt`).

    `background_streams`: that many more streams decode (64 tokens in, 48 out, the next
    sent when one ends) while the grid's prompts are served, so prefill steps are timed
    under a serving load: where the router and the client share a core with a worker,
    relaying tokens slows that worker's steps (8-13% on a prefill worker here). The decode
    batches go alone, at the sizes the grid names."""
    model, max_model_len = served_model(url)
    c = _Client(url, model, tokens, max_model_len)
    async with make_client(None, 900.0) as client:
        await c.batch(client, 256, 8, 4)  # warm-up, not in the window the caller fits
        probes = []
        for _ in range(RTT_PROBES):
            out = await c.request(client, 8, 1)
            probes.append([out.start_s, out.start_s + out.latency_s])
        t0 = time.perf_counter()

        async def beside_background(part) -> None:
            stop = asyncio.Event()

            async def stream():
                while not stop.is_set():
                    await c.request(client, 64, 48)

            background = [asyncio.create_task(stream()) for _ in range(background_streams)]
            try:
                await part
            finally:
                stop.set()
                await asyncio.gather(*background)

        async def prefills():
            for n in PREFILL_LENGTHS:
                await c.request(client, n, 1)
                await c.request(client, n, 1)

        async def joins():
            for batch, prompt in MIXED_GRID + tuple((b, 2048) for b, _ in CHUNKED_GRID):
                await c.join(client, batch, prompt)

        await beside_background(prefills())
        # decode batches go alone: beside the background streams every batch would be that much
        # bigger, and a decode pool serving a few users steps 1-3 sequences at a time (the
        # kernels' weight passes make 1-4 and 5-8 two regimes, so the fit must see both)
        for batch, ctx in DECODE_GRID:
            await c.batch(client, ctx, SERVED_DECODE_TOKENS, batch)
        await beside_background(joins())
        log(
            f"served grid sent in {time.perf_counter() - t0:.1f} s"
            + (f", prompts beside {background_streams} streams" if background_streams else "")
        )
    return probes


def relative_rms(prof: ProfileLatency, samples: list[tuple[StepShape, float]]) -> float:
    """Root mean square of (predicted - measured) / measured over the samples."""
    errs = [(prof.step_s(s) - t) / t for s, t in samples if t > 0]
    return (sum(e * e for e in errs) / len(errs)) ** 0.5 if errs else 0.0


def request_rtt(records: list[dict], probes: list[list[float]]) -> float:
    """The client <-> engine round trip: for each probe (a lone request to an idle server), its
    time at the client less the engine steps that ran meanwhile; the median."""
    out = []
    for s, f in probes:
        engine = sum(r["t1"] - r["t0"] for r in records if r["t0"] >= s and r["t1"] <= f)
        if engine > 0:
            out.append(f - s - engine)
    return float(sorted(out)[len(out) // 2]) if out else 0.0


def calibrate_served(
    url: str, trace_paths: list[str], *, threads: int = 0, model: str | None = None, log=print
) -> ProfileLatency:
    """Drive the grid through the server at `url`, whose engine(s) write `trace_paths`, and fit
    on the steps they traced meanwhile (the warm-up excluded)."""
    tokens = TokenSource.from_path(model) if model else TokenSource()
    since = time.monotonic()
    probes = asyncio.run(drive_grid(url, tokens, log))
    until = time.monotonic()
    time.sleep(1.5)  # the trace is flushed once a second
    return fit_trace(trace_paths, since=since, until=until, threads=threads, model=model, probes=probes, log=log)


def serve_and_calibrate(
    threads: int, model: str | None = None, log=print, startup_timeout_s: float = 300.0
) -> ProfileLatency:
    """`pdserve sim --calibrate --served`: start `pdserve serve --mode collocated` on a free
    loopback port with a step trace, calibrate through it, stop it."""
    with tempfile.TemporaryDirectory(prefix="pdserve-cal-") as tmp:
        trace = os.path.join(tmp, "steps.jsonl")
        args = ["--mode", "collocated", "--threads", str(threads), "--step-trace", trace]
        server = Serve(args + (["--model", model] if model else []), startup_timeout_s=startup_timeout_s)
        log("$ " + " ".join(server.cmd))
        with server:
            prof = calibrate_served(server.url, [trace], threads=threads, model=model, log=log)
        prof.source = (
            f"pdserve serve (served steps), {os.path.basename(model) if model else 'embedded SmolLM2'}, "
            f"{threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}"
        )
        return prof
