"""What the HTTP layer costs: output tokens/s through `pdserve serve` vs the offline engine.

Same workload, same engine flags, same process tree: N requests of random
prompts (input_len tokens, output_len tokens each, EOS ignored). The offline
side calls `LLM.generate` on all of them at once; the server side starts
`pdserve serve` as a subprocess and sends them as concurrent streaming
completions (SSE, include_usage) over loopback. Prints both throughputs and
their ratio (target >= 0.9). Load and warm-up are outside the timed parts.

    python benchmarks/server_overhead.py --threads 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import httpx
import numpy as np

from pdserve import flags
from pdserve.config import ENGINE_SECTIONS
from pdserve.engine.cli import add_engine_arguments, engine_kwargs
from pdserve.testing.serve import Serve


class CpuWatch:
    """How much CPU other processes took while a timed phase ran.

    The benchmark shares its cores with whatever else runs on the machine; a
    run in which others took a noticeable share is not a measurement of us,
    so each phase reports that share and the summary says which runs were clean.
    """

    def __init__(self, server_pid: int | None = None):
        self.server_pid = server_pid

    def _sample(self) -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]  # guest time is inside user already
        busy_s = (sum(fields) - fields[3] - fields[4]) / _TICK  # all but idle and iowait
        own_s = time.process_time()
        if self.server_pid is not None:
            with open(f"/proc/{self.server_pid}/stat") as f:
                st = f.read().rsplit(")", 1)[1].split()
            own_s += (int(st[11]) + int(st[12])) / _TICK
        return time.perf_counter(), busy_s, own_s

    def __enter__(self):
        self._t0 = self._sample()
        return self

    def __exit__(self, *exc):
        t1 = self._sample()
        wall_s = t1[0] - self._t0[0]
        self.own_cpu_s = t1[2] - self._t0[2]
        foreign_s = max(0.0, (t1[1] - self._t0[1]) - self.own_cpu_s)
        self.foreign_share = foreign_s / (wall_s * (os.cpu_count() or 1))


_TICK = os.sysconf("SC_CLK_TCK")
CLEAN_FOREIGN_SHARE = 0.05  # others used under 5% of the machine


def make_prompts(n: int, input_len: int, vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    """Random token ids without special tokens, so no prompt shares a cached prefix with another."""
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(vocab) if i not in special])
    return [rng.choice(allowed, input_len).tolist() for _ in range(n)]


def run_offline(args, prompts, llm) -> dict:
    from pdserve import SamplingParams

    llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    with CpuWatch() as watch:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {
        "elapsed_s": elapsed_s,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed_s,
        "preemptions": stats["num_preemptions"],
        "cpu_s": watch.own_cpu_s,
        "foreign_share": watch.foreign_share,
    }


async def _stream_one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> dict:
    """One streamed completion. The client shares the 2 cores with the server, so it
    parses as little as it can: it times network reads and decodes only the last
    event (the usage chunk), instead of one JSON document per token."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    stamps, tail = [], b""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for data in r.aiter_bytes():
            stamps.append(time.perf_counter())
            tail = (tail + data)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    usage = json.loads(events[-1][6:])["usage"]
    return {
        "ttft_s": stamps[0] - t0 if stamps else None,
        "completion_tokens": usage["completion_tokens"],
        "read_gaps_s": [b - a for a, b in zip(stamps, stamps[1:])],
    }


async def _drive(url: str, prompts, output_len: int, watch: CpuWatch | None = None) -> tuple[float, list[dict]]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        await _stream_one(client, prompts[0][:16], 4)  # warm-up, and opens a connection
        with watch or CpuWatch():
            t0 = time.perf_counter()
            results = await asyncio.gather(*(_stream_one(client, p, output_len) for p in prompts))
            return time.perf_counter() - t0, results


def run_server(args, prompts, llm=None) -> dict:
    port = args.port
    # the server gets this run's engine settings as its config file, each flag as parsed here
    config_dir = tempfile.mkdtemp(prefix="server-overhead-")
    try:
        config = flags.write_private_json(
            os.path.join(config_dir, "engine.json"), flags.document(ENGINE_SECTIONS, vars(args))
        )
        serve = ["--config", config, "--mode", "collocated", "--max-waiting-requests", str(len(prompts) * 2)]
        with Serve(serve, startup_timeout_s=600, port=port) as server:
            watch = CpuWatch(server.proc.pid)
            elapsed_s, results = asyncio.run(_drive(server.url, prompts, args.output_len, watch))
            health = server.health()
            metrics = server.http.get(server.url + "/metrics").text
    finally:
        shutil.rmtree(config_dir, ignore_errors=True)
    tokens = sum(r["completion_tokens"] for r in results)
    itl = [x for r in results for x in r["read_gaps_s"]]
    preempt = [line for line in metrics.splitlines() if line.startswith("pdserve:num_preemptions_total")]
    return {
        "elapsed_s": elapsed_s,
        "output_tokens": tokens,
        "output_tok_per_s": tokens / elapsed_s,
        "median_ttft_s": statistics.median(r["ttft_s"] for r in results),
        "median_itl_s": statistics.median(itl) if itl else None,
        "preemptions": float(preempt[0].rsplit(" ", 1)[1]) if preempt else None,
        "idle_free_blocks": health.get("num_free_blocks"),
        "cpu_s": watch.own_cpu_s,
        "foreign_share": watch.foreign_share,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--order", choices=["offline-first", "server-first"], default="offline-first")
    p.add_argument("--repeats", type=int, default=1, help="alternate offline and server runs this many times")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    from pdserve import LLM

    # loaded once, first: its tokenizer picks the prompts, and it sits idle while the server runs
    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.tokenizer
    runs = [("offline", run_offline), ("server", run_server)]
    if args.order == "server-first":
        runs.reverse()
    result = {
        "workload": {"num_requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len},
        "engine": engine_kwargs(args),
        "runs": [],
    }
    # alternate the two sides so that load from anything else on the machine hits both alike
    for rep in range(args.repeats):
        # fresh prompts each repeat: the offline engine lives on, and its prefix cache
        # would otherwise skip the prefill of prompts it has already seen
        prompts = make_prompts(args.num_requests, args.input_len, tok.vocab_size, set(tok.special_ids), seed=rep)
        run = {}
        for name, fn in runs:
            run[name] = fn(args, prompts, llm)
            r = run[name]
            print(
                f"[{rep + 1}/{args.repeats}] {name:8s} {r['output_tok_per_s']:8.1f} output tok/s "
                f"({r['output_tokens']} tokens in {r['elapsed_s']:.1f}s; {r['cpu_s']:.1f} CPU-s; "
                f"others took {r['foreign_share']:.0%} of the machine)",
                flush=True,
            )
        run["ratio"] = run["server"]["output_tok_per_s"] / run["offline"]["output_tok_per_s"]
        run["clean"] = max(run["offline"]["foreign_share"], run["server"]["foreign_share"]) < CLEAN_FOREIGN_SHARE
        s = run["server"]
        print(
            f"[{rep + 1}/{args.repeats}] ratio {run['ratio']:.3f}; server median TTFT {s['median_ttft_s']:.2f}s, "
            f"median gap between reads {s['median_itl_s'] * 1e3:.0f} ms",
            flush=True,
        )
        result["runs"].append(run)
    clean = [r for r in result["runs"] if r["clean"]]
    pool = clean or result["runs"]
    best = {side: max(r[side]["output_tok_per_s"] for r in pool) for side in ("offline", "server")}
    result["ratio_of_best"] = best["server"] / best["offline"]
    result["median_ratio"] = statistics.median(r["ratio"] for r in pool)
    result["num_clean_runs"] = len(clean)
    which = f"{len(clean)} clean run(s)" if clean else "NO clean run: other processes loaded the machine"
    print(
        f"offline {best['offline']:.1f} tok/s, server {best['server']:.1f} tok/s (best of {which}); "
        f"ratio server/offline = {result['ratio_of_best']:.3f} (median {result['median_ratio']:.3f}; "
        f"target >= 0.9)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
