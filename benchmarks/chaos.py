"""Chaos: one fault at a time into a live `pdserve serve` under steady load, and what its clients saw.

The deployment is the real one: `pdserve serve` (a launcher that runs a router,
one prefill and one decode worker) on 127.0.0.1 and a free port, with a fresh
cluster token, fault injection on, `--worker-timeout-s 2` (a silent worker is
noticed fast; `--worker-timeout-s` here) and a small KV pool (`--num-gpu-blocks`, so the long-prompt
burst really fills the decode worker's). A steady load runs through each fault
(the bench library: `--streams` concurrent short chats, ~64-token prompts,
32-64 output tokens, Poisson arrivals at `--rate`), and the fault is injected
once the load has run `--warmup-s`:

  kill_prefill  kill -9 of the prefill worker (the launcher restarts it)
  kill_decode   kill -9 of the decode worker
  kill_router   kill -9 of the router (the launcher restarts it; workers re-register)
  stop_decode   SIGSTOP of the decode worker for `--stop-s` (20 s), then SIGCONT
  kv_cut        the KV connection cut at layer 5 (the prefill worker's /internal/fault)
  kv_corrupt    a corrupt KV frame header before layer 5
  kv_fill       a burst of `--burst` concurrent 1,500-token prompts fills the decode worker's KV pool
  fanout        `prompt: ["hi"] * 2000, n: 128` on /v1/completions: must get a 400
  disconnects   `--clients` streams opened at once, each closed after its first chunk or two
  fake_worker   POST /internal/register unsigned and signed with a wrong token: must get 401
  sigterm       SIGTERM of the launcher: in-flight requests finish, new ones get 503 with
                Retry-After, exit 0; then a fresh deployment for what follows

Per fault and repetition, for the steady load: requests completed, refused with
a clear error (HTTP 4xx/503 with an OpenAI-shaped message, or an SSE error
event with a message), lost (no answer: connection broken or refused, or a
stream that ended without finish and without error), hung (no answer within
60 s), and HTTP 500s (answers with status 500, plus SSE error events the router
logged as 500s); then, for the deployment: KV blocks each worker still holds
once idle, seconds until a probe completion succeeds after the fault (< 30 s),
P99 TTFT and ITL in the fault window (from the injection until the fault is
over and the deployment serves again) and after it, and the fault's own check.

    .venv/bin/python benchmarks/chaos.py                      # all faults, 3 repetitions -> results/chaos/
    .venv/bin/python benchmarks/chaos.py --quick --faults kill_decode,kv_cut --out results/chaos-quick
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import numpy as np
import psutil

from pdserve import auth, faults
from pdserve.bench import datasets
from pdserve.bench.client import CHAT, COMPLETIONS
from pdserve.bench.runner import RunState, run_benchmark
from pdserve.bench.tokens import TokenSource
from pdserve.config import cpu_model
from pdserve.ports import free_port, wait_until

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAULT_ENV = faults.ENABLE_ENV
PREFILL, DECODE = "prefill-0", "decode-1"  # the worker ids `pdserve serve --prefill 1 --decode 1` gives
HUNG_S = 60.0  # no answer this long: hung (also the load's read timeout)
RECOVERY_LIMIT_S = 30.0  # the deployment must serve again this soon after a fault
PROBE_LIMIT_S = 90.0  # probes give up after this (a failure well past the limit is still timed)
PROBE_TIMEOUT_S = 30.0  # one probe's own limit
STUCK_S = 5.0  # a probe unanswered this long was stuck (a 2-token completion takes well under a second)
MIN_WINDOW_S = 5.0  # the fault window lasts at least this long, so it has samples
IDLE_WAIT_S = 30.0  # how long blocks may take to come back once the load is over


# ---------------------------------------------------------------- the deployment


class Deployment:
    """`pdserve serve` as a subprocess, with signed access to its internal routes.

    Every process the launcher ever started is remembered (psutil handles, which
    also guard against pid reuse), so `stop` reaches restarted and orphaned
    children too, whatever state the launcher is in."""

    def __init__(self, args, log_dir: str):
        self.args = args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        token = auth.new_token()  # this deployment's cluster secret: for its children and our signed calls
        self.env = {**os.environ, auth.TOKEN_ENV: token, FAULT_ENV: "1"}
        self.http = httpx.Client(auth=auth.http_auth(token.encode()), timeout=10, trust_env=False)
        self.log_path = os.path.join(log_dir, f"deployment-{self.port}.log")
        self.proc: subprocess.Popen | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.started_s = 0.0

    def command(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prefill",
            "1",
            "--decode",
            "1",
            "--worker-timeout-s",
            str(self.args.worker_timeout_s),
            "--num-gpu-blocks",
            str(self.args.num_gpu_blocks),
            # info: the router logs one line per request with its outcome (where SSE 500s show)
            "--log-level",
            "info",
            "--log-format",
            "json",
        ]
        return cmd + (["--model", self.args.model] if self.args.model else [])

    def start(self) -> float:
        """Start and wait until both workers are registered and a completion succeeds; returns the seconds."""
        t0 = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), cwd=REPO, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.seen[self.proc.pid] = psutil.Process(self.proc.pid)
        if not self.wait_healthy(self.args.startup_timeout_s):
            raise RuntimeError(
                f"the deployment did not come up in {self.args.startup_timeout_s:.0f} s; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        self.started_s = time.monotonic() - t0
        return self.started_s

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def children(self) -> list[psutil.Process]:
        """The launcher's live descendants (each remembered for `stop`)."""
        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except (psutil.Error, AttributeError):
            kids = []
        live = []
        for p in kids:
            self.seen.setdefault(p.pid, p)
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:  # killed, not yet reaped by the launcher
                    live.append(p)
        return live

    def process(self, name: str) -> psutil.Process | None:
        """The router ("router": a word of its command line) or a worker (`--worker-id NAME`, or
        `--config <dir>/NAME.json` as pdserve serve starts it)."""
        for p in self.children():
            try:
                cmd = p.cmdline()
            except psutil.Error:
                continue
            if name == "router" and "router" in cmd:
                return p
            if "--worker-id" in cmd and cmd[cmd.index("--worker-id") + 1 :][:1] == [name]:
                return p
            if any(a.endswith(f"/{name}.json") for a in cmd):
                return p
        return None

    def workers(self) -> dict[str, dict]:
        r = self.http.get(self.url + "/internal/workers")
        r.raise_for_status()
        return {w["worker_id"]: w for w in r.json()["workers"]}

    def worker_call(self, wid: str, method: str, path: str, **kw) -> httpx.Response:
        return self.http.request(method, self.workers()[wid]["url"] + path, **kw)

    def metrics(self) -> dict[str, float]:
        """The router's /metrics as {"name{labels}": value}."""
        r = httpx.get(self.url + "/metrics", timeout=10, trust_env=False)
        out = {}
        for line in r.text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    def healthy(self) -> bool:
        try:
            ws = self.workers()
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        return all(ws.get(w, {}).get("alive") for w in (PREFILL, DECODE)) and probe(self.url, 20.0)

    def wait_healthy(self, timeout_s: float) -> bool:
        """Whether it became healthy within `timeout_s` (False as soon as the launcher exits)."""

        def ready() -> bool:
            self.children()  # remember every child seen, for `stop`
            return self.healthy()

        if not self.running():
            return False
        try:
            wait_until(ready, [self.proc], timeout_s, "the deployment", interval_s=0.5)
        except (RuntimeError, TimeoutError):
            return False
        return True

    def log_offset(self) -> int:
        return os.path.getsize(self.log_path) if os.path.exists(self.log_path) else 0

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_offset() - n))
            return f.read().decode(errors="replace")

    def log_since(self, offset: int) -> list[str]:
        with open(self.log_path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace").splitlines()

    def stop(self, grace_s: float = 60.0) -> int | None:
        """SIGTERM to the launcher (it drains its children), then SIGKILL to whatever is left."""
        if self.proc is None:
            return None
        self.children()
        for p in self.seen.values():  # a stopped process would hold the drain (and ignore SIGTERM) forever
            with contextlib.suppress(psutil.Error):
                p.resume()
        code = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running():
                    p.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self.http.close()
        return code

    def survivors(self) -> list[int]:
        """Pids of processes of this deployment still running (zombies aside)."""
        out = []
        for pid, p in self.seen.items():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
        return out


def probe(url: str, timeout_s: float = 10.0) -> bool:
    """One short completion: does the deployment serve?"""
    try:
        r = httpx.post(
            url + COMPLETIONS,
            json={"prompt": "Hello", "max_tokens": 2, "temperature": 0},
            timeout=timeout_s,
            trust_env=False,
        )
        return r.status_code == 200 and bool(r.json().get("choices"))
    except (httpx.HTTPError, ValueError):
        return False


class Recovery:
    """Probes from the fault on, one every `every_s` without waiting for the last (a probe stuck on a
    stopped worker must not hide that new ones succeed): the seconds until the first one succeeded,
    and how many were still unanswered `STUCK_S` after they were sent."""

    def __init__(self, url: str, t0: float, every_s: float = 0.5):
        self.url, self.t0, self.every_s = url, t0, every_s
        self.seconds: float | None = None
        self.stuck = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _one(self, client: httpx.AsyncClient, done: asyncio.Event) -> None:
        sent = time.monotonic()
        try:
            r = await client.post(self.url + COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
            ok = r.status_code == 200 and bool(r.json().get("choices"))
        except (httpx.HTTPError, ValueError):
            ok = False
        self.stuck += time.monotonic() - sent > STUCK_S
        if ok and self.seconds is None:
            self.seconds = time.monotonic() - self.t0
            done.set()

    async def _run(self) -> None:
        done = asyncio.Event()
        async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S, trust_env=False) as client:
            tasks = []
            while not done.is_set() and time.monotonic() - self.t0 < PROBE_LIMIT_S:
                tasks.append(asyncio.create_task(self._one(client, done)))
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), self.every_s)
            await asyncio.gather(*tasks)  # the stuck ones too: each ends by its timeout

    def wait(self) -> float | None:
        self._thread.join(max(0.0, self.t0 + PROBE_LIMIT_S + PROBE_TIMEOUT_S + 5 - time.monotonic()))
        return self.seconds


# ---------------------------------------------------------------- the steady load


class Load:
    """The steady load in a thread (run_benchmark): short chats, Poisson at `rate`, at most `streams` at once,
    sent for `seconds`. The arrival rate, not a closed loop: while requests fail fast (no router), a closed
    loop would spin out thousands of failures a second."""

    def __init__(
        self, url: str, requests: list[datasets.Request], args, seconds: float, seed: int, rate: float | None = None
    ):
        self.requests, self.seconds = requests, seconds
        self.rate = args.rate if rate is None else rate
        self.state = RunState([])
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(url, args, seed), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while self.state.start == 0.0 and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.t0_mono = time.monotonic() - self.now()

    def _run(self, url: str, args, seed: int) -> None:
        try:
            run_benchmark(
                self.requests,
                url,
                endpoint=CHAT,
                request_rate=self.rate,
                tag_concurrency={"chat": args.streams},
                ignore_eos=True,
                timeout_s=HUNG_S,
                state=self.state,
                send_until_s=self.seconds,
                seed=seed,
            )
        except Exception as e:  # BenchError: the endpoint was unusable at the start
            self.error = f"{type(e).__name__}: {e}"

    def now(self) -> float:
        """Seconds on the load's clock (RequestOutput.start_s is on it)."""
        return time.perf_counter() - self.state.start if self.state.start else 0.0

    def wait(self, deadline_mono: float) -> bool:
        self._thread.join(max(0.0, deadline_mono - time.monotonic()))
        return not self._thread.is_alive()


def chat_requests(n: int, tokens: TokenSource, args, seed: int) -> list[datasets.Request]:
    return datasets.random(
        n, args.input_len, args.output_len, tokens, seed=seed, range_ratio=0.33, as_text=True, tag="chat"
    )


def classify(out, max_tokens: int, in_flight_is_hung: bool = False) -> tuple[str, str]:
    """(category, why) of one request: completed, refused, lost, hung, http500, or unsent."""
    if not out.sent:
        return "unsent", ""
    if out.success:
        if out.latency_s > HUNG_S:
            return "hung", f"answered only after {out.latency_s:.0f} s"
        # with ignore_eos and include_usage a whole answer ends with usage = max_tokens; the bench
        # client counts any stream with output as a success, even one that just stopped
        if not out.usage_reported or out.output_tokens != max_tokens:
            return "lost", f"the stream ended without finish ({out.output_tokens} of {max_tokens} tokens)"
        return "completed", ""
    e = out.error
    if not e:
        if out.start_s == 0.0:
            return "unsent", ""
        return ("hung", "still running at the deadline") if in_flight_is_hung else ("lost", "not finished")
    if e.startswith("HTTP 500"):
        return "http500", e
    if "timed out" in e:
        return "hung", e
    m = re.match(r"HTTP (\d{3}): (.*)", e, re.S)
    if m:
        status, msg = int(m.group(1)), m.group(2).strip()
        # the bench client shows error.message when the body had OpenAI's shape, else the raw body
        clear = msg and msg != "(empty body)" and msg[0] not in "{<[" and (status < 500 or status == 503)
        return ("refused" if clear else "lost"), e
    if e.startswith("error event mid-stream:") and e.split(":", 1)[1].strip():
        return "refused", e
    return "lost", e  # connection refused or broken, a stream without output


def percentile99(xs: list[float]) -> float | None:
    return float(np.percentile(xs, 99)) * 1e3 if xs else None


def window_latencies(outs, max_tokens: list[int], t0: float, t1: float) -> dict:
    """P99 TTFT (by send time) and ITL (by the time the gap ended) of completed requests, in [t0, t1)."""
    ttfts, itls = [], []
    for out, mt in zip(outs, max_tokens):
        if classify(out, mt)[0] != "completed":
            continue
        if t0 <= out.start_s < t1:
            ttfts.append(out.ttft_s)
        t = out.start_s + out.ttft_s
        for gap in out.itl_s:
            t += gap
            if t0 <= t < t1:
                itls.append(gap)
    return {
        "p99_ttft_ms": percentile99(ttfts),
        "p99_itl_ms": percentile99(itls),
        "num_ttft": len(ttfts),
        "num_itl": len(itls),
    }


# ---------------------------------------------------------------- what the deployment says

COUNTERS = (
    "kv_transfer_failed_total",
    "kv_transfer_retries_total",
    "request_recomputed_total",
    "request_replaced_total",
    "request_whole_on_one_worker_total",
    "internal_auth_refused_total",
    "request_resumed_total",
)
# the launcher's front: these do not start again when the router restarts
FRONT_COUNTERS = (
    "front_requests_resumed_total",
    "front_requests_retried_total",
    "front_requests_failed_total",
    "front_internal_auth_refused_total",  # internal requests the front refused before the router saw them
)


def counters(dep: Deployment) -> dict[str, float]:
    """The router's failure counters (reset when the router restarts) and the workers' restarts."""
    try:
        m = dep.metrics()
    except httpx.HTTPError:
        return {}
    out = {c: m.get(f"pdserve:{c}", 0.0) for c in COUNTERS + FRONT_COUNTERS}
    for key, v in m.items():
        if key.startswith("pdserve:worker_restarts_total{"):
            wid = re.search(r'worker_id="([^"]*)"', key)
            out[f"restarts:{wid.group(1) if wid else key}"] = v
    return out


def counter_deltas(before: dict, after: dict) -> dict[str, float]:
    """What the counters moved by; after a router restart they started again from 0, so
    the new router's values are the deltas (marked with `router_restarted`)."""
    keys = sorted(set(before) | set(after))
    front = {
        k: after.get(k, 0) - before.get(k, 0)
        for k in keys
        if k in FRONT_COUNTERS and after.get(k, 0) != before.get(k, 0)
    }
    keys = [k for k in keys if k not in FRONT_COUNTERS]
    if any(after.get(k, 0) < before.get(k, 0) for k in keys):
        return {"router_restarted": 1, **{k: after[k] for k in keys if after.get(k)}, **front}
    return {**{k: after.get(k, 0) - before.get(k, 0) for k in keys if after.get(k, 0) != before.get(k, 0)}, **front}


def worker_blocks(dep: Deployment) -> dict[str, dict]:
    """Per worker: KV blocks held (num_blocks - num_free_blocks), running and waiting requests."""
    out = {}
    for wid in (PREFILL, DECODE):
        try:
            st = dep.worker_call(wid, "GET", "/internal/state").json()["stats"]
            out[wid] = {
                "held_blocks": st["num_blocks"] - st["num_free_blocks"],
                "num_blocks": st["num_blocks"],
                "running": st.get("num_running", 0),
                "waiting": st.get("num_waiting", 0),
            }
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            out[wid] = {"held_blocks": None, "error": f"{type(e).__name__}: {e}"}
    return out


def idle_blocks(dep: Deployment, wait_s: float, then_s: float) -> dict[str, dict]:
    """Blocks each worker still holds once idle, after up to `wait_s` for the last requests to let
    go of theirs (the rule); if some are held then, how long until they came back (up to `then_s`
    more: a reservation nobody claims is freed when its lease, --kv-timeout-s, runs out)."""
    t0 = time.monotonic()

    def settled(blocks: dict) -> bool:
        return all(
            s["held_blocks"] == 0 and not s["running"] and not s["waiting"]
            for s in blocks.values()
            if s["held_blocks"] is not None
        )

    while not settled(held := worker_blocks(dep)) and time.monotonic() - t0 < wait_s:
        time.sleep(0.5)
    if settled(held) or then_s <= 0:
        return held
    while not settled(later := worker_blocks(dep)) and time.monotonic() - t0 < wait_s + then_s:
        time.sleep(1.0)
    for wid, s in held.items():
        if s.get("held_blocks"):
            s["released_after_s"] = round(time.monotonic() - t0, 1) if later[wid].get("held_blocks") == 0 else None
    return held


def stale_shm_files(dep: Deployment) -> list[str]:
    """KV cache files in /dev/shm left by this deployment's dead processes (other jobs on the machine
    leave theirs too). A decode worker sweeps the dead ones when it starts."""
    try:
        names = os.listdir("/dev/shm")
    except OSError:
        return []
    dead = {pid for pid, p in dep.seen.items() if not p.is_running()}
    return [n for n in names if (m := re.match(r"pdserve-kv-(\d+)-", n)) and int(m.group(1)) in dead]


def log_findings(lines: list[str]) -> dict:
    """From the deployment's log: SSE streams the router ended with a 500 error event, workers the
    router declared dead for missed heartbeats, and error-level records or tracebacks (the first few)."""
    stream_500s, errors, missed = 0, [], Counter()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            if line.startswith("Traceback") or re.match(r"\w+(Error|Exception)\b", line):
                errors.append(line[:200])
            continue
        if not isinstance(rec, dict):
            continue
        msg = str(rec.get("msg", ""))
        if msg == "request finished" and rec.get("outcome") == "error 500" and rec.get("stream"):
            stream_500s += 1
        if m := re.match(r"worker (\S+) missed its heartbeats", msg):
            missed[m.group(1)] += 1
        if rec.get("level") in ("error", "critical") or "exc" in rec:
            errors.append(f"{rec.get('logger')}: {msg}"[:200])
    return {
        "stream_500s": stream_500s,
        "heartbeats_missed": dict(missed),
        "num_errors": len(errors),
        "errors": list(dict.fromkeys(errors))[:8],
    }


# ---------------------------------------------------------------- the faults


class FaultError(RuntimeError):
    pass


@dataclass
class Ctx:
    dep: Deployment
    args: argparse.Namespace
    tokens: TokenSource
    t_inject: float  # time.monotonic() of the injection


def wait_for(cond: Callable[[], bool], timeout_s: float, every_s: float = 0.25) -> float | None:
    """Seconds until cond() held, or None if it did not within timeout_s."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, psutil.Error):
            if cond():
                return time.monotonic() - t0
        time.sleep(every_s)
    return None


def kill(dep: Deployment, name: str, sig: int = signal.SIGKILL) -> psutil.Process:
    p = dep.process(name)
    if p is None:
        raise FaultError(f"no {name} process among the launcher's children")
    p.send_signal(sig)
    return p


def fault_kill_worker(ctx: Ctx, name: str) -> dict:
    before = counters(ctx.dep).get(f"restarts:{name}", 0)
    old = kill(ctx.dep, name)

    def rejoined() -> bool:  # a new process, registered with the router again (its restart count is up)
        p = ctx.dep.process(name)
        return (
            p is not None
            and p.pid != old.pid
            and ctx.dep.workers()[name]["alive"]
            and counters(ctx.dep).get(f"restarts:{name}", 0) > before
        )

    back_s = wait_for(rejoined, ctx.args.rejoin_timeout_s, 0.5)
    ok = back_s is not None
    return {
        "ok": ok,
        "rejoined_s": back_s,
        "check": f"restarted and re-registered after {back_s:.1f} s"
        if ok
        else f"not back within {ctx.args.rejoin_timeout_s:.0f} s",
    }


def fault_kill_router(ctx: Ctx) -> dict:
    old = kill(ctx.dep, "router")

    def rejoined() -> bool:  # a new router that both workers registered with again
        p = ctx.dep.process("router")
        ws = ctx.dep.workers()
        return p is not None and p.pid != old.pid and all(ws.get(w, {}).get("alive") for w in (PREFILL, DECODE))

    back_s = wait_for(rejoined, ctx.args.rejoin_timeout_s, 0.25)
    ok = back_s is not None
    return {
        "ok": ok,
        "rejoined_s": back_s,
        "check": f"router back, both workers registered after {back_s:.1f} s"
        if ok
        else f"not back within {ctx.args.rejoin_timeout_s:.0f} s",
    }


def fault_stop_decode(ctx: Ctx) -> dict:
    p = kill(ctx.dep, DECODE, signal.SIGSTOP)
    try:
        dead_s = wait_for(lambda: not ctx.dep.workers()[DECODE]["alive"], ctx.args.stop_s)
        time.sleep(max(0.0, ctx.t_inject + ctx.args.stop_s - time.monotonic()))
    finally:
        p.send_signal(signal.SIGCONT)
    t_cont = time.monotonic()
    back_s = wait_for(lambda: ctx.dep.workers()[DECODE]["alive"], 30.0)
    ok = dead_s is not None and back_s is not None
    return {
        "ok": ok,
        "marked_dead_s": dead_s,
        "alive_after_cont_s": back_s,
        "resumed_at_s": t_cont - ctx.t_inject,
        "check": (f"marked dead after {dead_s:.1f} s" if dead_s is not None else "never marked dead")
        + (f"; alive again {back_s:.1f} s after SIGCONT" if back_s is not None else "; not alive after SIGCONT"),
    }


def fault_kv(ctx: Ctx, spec: str) -> dict:
    """Arm a KV sender fault on the prefill worker; it fires on the next transfer (the steady load's)."""
    before = counters(ctx.dep)
    r = ctx.dep.worker_call(PREFILL, "POST", "/internal/fault", json={"kv": spec})
    if r.status_code != 200:
        raise FaultError(f"/internal/fault answered {r.status_code}: {r.text[:200]}")
    keys = ("kv_transfer_retries_total", "kv_transfer_failed_total", "request_recomputed_total")

    def fired() -> bool:
        after = counters(ctx.dep)
        return any(after.get(k, 0) > before.get(k, 0) for k in keys)

    seen_s = wait_for(fired, 15.0, 0.5)
    return {
        "ok": True,
        "fired_s": seen_s,
        "check": (
            f"armed; retry/failure counted {seen_s:.1f} s later"
            if seen_s is not None
            else "armed; no retry, failure or recompute counted within 15 s"
        ),
    }


def fault_kv_fill(ctx: Ctx) -> dict:
    """A burst of long prompts at once, beside the steady load; the decode worker's free blocks are watched."""
    low = {"free": None}
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                free = ctx.dep.worker_call(DECODE, "GET", "/internal/state").json()["stats"]["num_free_blocks"]
                low["free"] = free if low["free"] is None else min(low["free"], free)
            stop.wait(0.3)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    burst = datasets.random(ctx.args.burst, ctx.args.burst_len, 16, ctx.tokens, seed=7, tag="long")
    state = RunState([])
    try:
        run_benchmark(burst, ctx.dep.url, endpoint=COMPLETIONS, ignore_eos=True, timeout_s=HUNG_S, state=state)
    finally:
        stop.set()
        watcher.join(2)
    kinds = Counter(classify(o, 16)[0] for o in state.outputs)
    errors = Counter(classify(o, 16)[1][:90] for o in state.outputs if o.error)
    bad = kinds["lost"] + kinds["hung"] + kinds["http500"]
    return {
        "ok": bad == 0,
        "burst": dict(kinds),
        "burst_errors": dict(errors),
        "decode_min_free_blocks": low["free"],
        "check": f"burst {dict(kinds)}; decode free blocks fell to {low['free']}",
    }


def fault_fanout(ctx: Ctx) -> dict:
    body = {"prompt": ["hi"] * 2000, "n": 128, "max_tokens": 4}
    seen = []
    for stream in (False, True):
        t0 = time.monotonic()
        r = httpx.post(ctx.dep.url + COMPLETIONS, json={**body, "stream": stream}, timeout=30, trust_env=False)
        try:
            err = r.json()["error"]
            shaped = bool(err.get("message")) and "type" in err
        except (ValueError, KeyError, TypeError, AttributeError):
            err, shaped = {"message": r.text[:200]}, False
        seen.append(
            {
                "stream": stream,
                "status": r.status_code,
                "openai_shape": shaped,
                "seconds": time.monotonic() - t0,
                "message": str(err.get("message"))[:160] if isinstance(err, dict) else None,
            }
        )
    ok = all(s["status"] == 400 and s["openai_shape"] for s in seen)
    return {
        "ok": ok,
        "answers": seen,
        "check": "; ".join(
            f"{'stream' if s['stream'] else 'plain'}: {s['status']} in {s['seconds'] * 1e3:.0f} ms"
            + ("" if s["openai_shape"] else " (not OpenAI-shaped)")
            for s in seen
        ),
    }


async def _disconnecting_clients(url: str, n: int, body: dict, read_s: float) -> Counter:
    """n streams at once; each reads its first two SSE data lines (or for read_s), then closes."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)

    async def one(client: httpx.AsyncClient) -> str:
        try:
            async with client.stream("POST", url + CHAT, json=body) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"HTTP {r.status_code}"
                chunks = 0
                async for line in r.aiter_lines():
                    chunks += line.startswith("data:")
                    if chunks >= 2:
                        break
                return f"closed after {chunks} chunk(s)"
        except asyncio.TimeoutError:
            return "closed while waiting"
        except httpx.HTTPError as e:
            return type(e).__name__

    async def bounded(client) -> str:
        try:
            return await asyncio.wait_for(one(client), read_s)
        except asyncio.TimeoutError:  # closing the stream mid-wait is the point too
            return "closed while waiting"

    async with httpx.AsyncClient(
        timeout=httpx.Timeout(read_s + 5, connect=30), limits=limits, trust_env=False
    ) as client:
        return Counter(await asyncio.gather(*(bounded(client) for _ in range(n))))


DISCONNECT_BODY = {
    "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}],
    "max_tokens": 64,
    "stream": True,
    "ignore_eos": True,
}


def fault_disconnects(ctx: Ctx) -> dict:
    # in a process of its own: 500 clients in this one would take the GIL from the steady load's
    # client and show up as the deployment's TTFT and ITL
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "_disconnects",
        ctx.dep.url,
        str(ctx.args.clients),
        str(ctx.args.disconnect_read_s),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.args.disconnect_read_s + 120)
    if run.returncode != 0:
        raise FaultError(f"the clients' process failed: {run.stderr[-500:]}")
    outcomes = Counter(json.loads(run.stdout))
    bad = sum(v for k, v in outcomes.items() if k.startswith("HTTP 5") and k != "HTTP 503")
    return {
        "ok": bad == 0,
        "clients": dict(outcomes),
        "check": ", ".join(f"{v} {k}" for k, v in outcomes.most_common()),
    }


def fault_fake_worker(ctx: Ctx) -> dict:
    dep = ctx.dep
    fake = {"worker_id": "chaos-fake", "url": "http://127.0.0.1:9", "role": "decode", "kv_address": "tcp://127.0.0.1:9"}

    def refusals() -> float:  # the front refuses those sent to it, the router those sent to it directly
        c = counters(dep)
        return c.get("internal_auth_refused_total", 0) + c.get("front_internal_auth_refused_total", 0)

    before = refusals()
    answers = {}
    wrong = httpx.Client(auth=auth.http_auth(auth.new_token().encode()), timeout=10, trust_env=False)
    plain = httpx.Client(timeout=10, trust_env=False)
    try:
        for label, client in (("unsigned", plain), ("wrong token", wrong)):
            r = client.post(dep.url + "/internal/register", json=fake)
            answers[f"register {label}"] = _status_and_shape(r)
            r = client.post(dep.url + "/internal/heartbeat", json={"worker_id": "chaos-fake", "stats": {}})
            answers[f"heartbeat {label}"] = _status_and_shape(r)
        # the workers' routes are guarded the same way: a fault armed by a stranger would be a weapon
        prefill_url = dep.workers()[PREFILL]["url"]
        answers["worker fault unsigned"] = _status_and_shape(
            plain.post(prefill_url + "/internal/fault", json={"kv": "cut_at_layer=1"})
        )
        answers["worker fault wrong token"] = _status_and_shape(
            wrong.post(prefill_url + "/internal/fault", json={"kv": "cut_at_layer=1"})
        )
    finally:
        wrong.close()
        plain.close()
    listed = "chaos-fake" in dep.workers()
    refused = refusals() - before
    ok = all(a == "401 ok" for a in answers.values()) and not listed and refused >= 4
    return {
        "ok": ok,
        "answers": answers,
        "fake_listed": listed,
        "auth_refused": refused,
        "check": f"{sum(a == '401 ok' for a in answers.values())}/{len(answers)} answered 401 (OpenAI-shaped); "
        f"front and router counted {refused:.0f} refused; fake {'LISTED' if listed else 'not listed'}",
    }


def _status_and_shape(r: httpx.Response) -> str:
    try:
        shaped = bool(r.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        shaped = False
    return f"{r.status_code} {'ok' if shaped else 'unshaped'}"


@dataclass
class Fault:
    name: str
    title: str
    action: Callable[[Ctx], dict]
    seconds: Callable[[argparse.Namespace], float]  # how long it usually takes: the load is sized to outlast it


FAULTS = [
    Fault("kill_prefill", "kill -9 prefill worker", lambda c: fault_kill_worker(c, PREFILL), lambda a: a.rejoin_s),
    Fault("kill_decode", "kill -9 decode worker", lambda c: fault_kill_worker(c, DECODE), lambda a: a.rejoin_s),
    Fault("kill_router", "kill -9 router", fault_kill_router, lambda a: 15.0),
    Fault("stop_decode", "SIGSTOP decode worker", fault_stop_decode, lambda a: a.stop_s + 5),
    Fault("kv_cut", "KV connection cut at layer 5", lambda c: fault_kv(c, "cut_at_layer=5"), lambda a: 10.0),
    Fault("kv_corrupt", "corrupt KV frame at layer 5", lambda c: fault_kv(c, "corrupt_at_layer=5"), lambda a: 10.0),
    Fault("kv_fill", "decode KV pool filled by long prompts", fault_kv_fill, lambda a: a.burst_s),
    Fault("fanout", "fan-out request (2000 prompts x n=128)", fault_fanout, lambda a: 5.0),
    Fault("disconnects", "clients disconnecting mid-stream", fault_disconnects, lambda a: a.disconnect_read_s + 10),
    Fault("fake_worker", "fake worker registering", fault_fake_worker, lambda a: 5.0),
    Fault("sigterm", "SIGTERM of the whole deployment", None, lambda a: 0.0),  # run_sigterm
]
BY_NAME = {f.name: f for f in FAULTS}


# ---------------------------------------------------------------- one fault, one repetition


def load_outcome(load: Load, in_flight_is_hung: bool) -> tuple[dict, dict]:
    max_tokens = [r.output_len for r in load.requests]
    kinds, errors = Counter(), Counter()
    for out, mt in zip(load.state.outputs, max_tokens):
        kind, why = classify(out, mt, in_flight_is_hung)
        kinds[kind] += 1
        if why:
            errors[f"{kind}: {why[:110]}"] += 1
    kinds.pop("unsent", None)
    return dict(kinds), dict(errors.most_common(6))


def run_fault(dep: Deployment, fault: Fault, rep: int, args, tokens: TokenSource) -> dict:
    seed = args.seed + 1000 * rep + FAULTS.index(fault)
    seconds = args.warmup_s + fault.seconds(args) + args.after_s
    requests = chat_requests(int(args.rate * seconds * 1.5) + 2 * args.streams, tokens, args, seed)
    before, offset = counters(dep), dep.log_offset()
    load = Load(dep.url, requests, args, seconds, seed)
    if load.error:
        raise RuntimeError(f"the load could not start: {load.error}")
    time.sleep(max(0.0, args.warmup_s - load.now()))
    t_inject, rel_inject = time.monotonic(), load.now()
    recovery = Recovery(dep.url, t_inject)
    try:
        result = fault.action(Ctx(dep, args, tokens, t_inject))
    except Exception as e:  # the fault could not be injected: say so, measure the rest anyway
        result = {"ok": False, "check": f"injection failed: {type(e).__name__}: {e}"}
    action_s = time.monotonic() - t_inject
    recovered_s = recovery.wait()
    result["stuck_probes"] = recovery.stuck
    if recovery.stuck:  # requests placed on a worker that stopped answering wait for it
        result["check"] += f"; {recovery.stuck} probe(s) unanswered for > {STUCK_S:.0f} s"
    window_s = max(action_s, recovered_s or PROBE_LIMIT_S, MIN_WINDOW_S)
    finished = load.wait(load.t0_mono + seconds + HUNG_S + 15)
    kinds, errors = load_outcome(load, in_flight_is_hung=not finished)
    if not finished:  # requests still open past every bound: hung; ending the deployment ends them
        result["ok"] = False
        result["check"] += "; the load did not finish in time: deployment restarted"
        dep.stop()
        load.wait(time.monotonic() + 30)
    held = idle_blocks(dep, IDLE_WAIT_S, args.lease_wait_s) if dep.running() else {}
    logs = log_findings(dep.log_since(offset))
    max_tokens = [r.output_len for r in requests]
    outs = load.state.outputs
    return {
        "fault": fault.name,
        "title": fault.title,
        "rep": rep,
        **result,
        "sent": sum(kinds.values()),
        **{k: kinds.get(k, 0) for k in ("completed", "refused", "lost", "hung")},
        "http500": kinds.get("http500", 0) + logs["stream_500s"],
        "errors": errors,
        "recovered_s": recovered_s,
        "action_s": action_s,
        "window_s": window_s,
        "fault_window": window_latencies(outs, max_tokens, rel_inject, rel_inject + window_s),
        "after_window": window_latencies(outs, max_tokens, rel_inject + window_s, float("inf")),
        "before_window": window_latencies(outs, max_tokens, 0.0, rel_inject),
        "held_blocks": held,
        "counters": counter_deltas(before, counters(dep)),
        "stale_shm_files": len(stale_shm_files(dep)),
        "log": logs,
        "load_finished": finished,
        "loadavg": os.getloadavg(),
    }


def run_sigterm(dep: Deployment, rep: int, args, tokens: TokenSource) -> dict:
    """SIGTERM with requests in flight: they must finish; new ones get 503 + Retry-After; exit 0.

    The steady load stops sending at the signal (what is in flight must finish); one long chat
    (`--drain-long-tokens`) is in flight too, so the drain lasts long enough to be probed."""
    fault = BY_NAME["sigterm"]
    seed = args.seed + 1000 * rep + FAULTS.index(fault)
    requests = chat_requests(int(args.rate * args.warmup_s * 1.5) + 2 * args.streams, tokens, args, seed)
    offset = dep.log_offset()
    load = Load(dep.url, requests, args, args.warmup_s, seed)
    time.sleep(max(0.0, args.warmup_s - 3 - load.now()))
    long = chat_requests(1, tokens, args, seed + 1)
    long[0].output_len = args.drain_long_tokens
    long_load = Load(dep.url, long, args, 1.0, seed, rate=float("inf"))
    wait_for(lambda: long_load.state.outputs and long_load.state.outputs[0].ttft_s > 0, 30.0, 0.05)
    time.sleep(max(0.0, args.warmup_s - load.now()))
    t_inject, rel_inject = time.monotonic(), load.now()
    dep.children()
    dep.proc.send_signal(signal.SIGTERM)
    answers = asyncio.run(drain_probes(dep, t_inject + args.drain_timeout_s))
    try:
        code = dep.proc.wait(max(1.0, t_inject + args.drain_timeout_s - time.monotonic()))
    except subprocess.TimeoutExpired:
        code = None
    exit_s = time.monotonic() - t_inject
    survivors = dep.survivors()
    finished = load.wait(time.monotonic() + HUNG_S + 15) and long_load.wait(time.monotonic() + HUNG_S + 15)
    kinds, errors = load_outcome(load, in_flight_is_hung=not finished)
    long_kind, long_why = classify(long_load.state.outputs[0], args.drain_long_tokens, not finished)
    logs = log_findings(dep.log_since(offset))
    dep.stop(5)  # whatever is left (nothing, if the drain worked)
    stale = len(stale_shm_files(dep))
    n503 = sum(a["status"] == 503 and a["retry_after"] and a["shaped"] for a in answers)
    other = unexpected_drain_answers(answers)
    ok = (
        code == 0
        and not survivors
        and n503 > 0
        and not other
        and stale == 0
        and long_kind == "completed"
        and kinds.get("lost", 0) + kinds.get("hung", 0) + kinds.get("http500", 0) == 0
    )
    check = (
        f"exit {code} after {exit_s:.1f} s; the {args.drain_long_tokens}-token chat in flight: {long_kind}"
        + (f" ({long_why})" if long_why else "")
        + f"; {n503}/{len(answers)} new requests got 503 + Retry-After"
        + (f"; unexpected answers {dict(Counter(str(a['status']) for a in other))}" if other else "")
        + (f"; {len(survivors)} process(es) left running" if survivors else "")
        + (f"; {stale} KV file(s) left in /dev/shm" if stale else "")
    )
    outs, max_tokens = load.state.outputs, [r.output_len for r in requests]
    return {
        "fault": fault.name,
        "title": fault.title,
        "rep": rep,
        "ok": ok,
        "check": check,
        "exit_code": code,
        "exit_s": exit_s,
        "drain_answers": answers[:60],
        "survivors": survivors,
        "long_request": long_kind,
        "sent": sum(kinds.values()),
        **{k: kinds.get(k, 0) for k in ("completed", "refused", "lost", "hung")},
        "http500": kinds.get("http500", 0) + logs["stream_500s"],
        "errors": errors,
        "recovered_s": None,
        "action_s": exit_s,
        "window_s": exit_s,
        "fault_window": window_latencies(outs, max_tokens, rel_inject, float("inf")),
        "after_window": window_latencies(outs, max_tokens, float("inf"), float("inf")),
        "before_window": window_latencies(outs, max_tokens, 0.0, rel_inject),
        "held_blocks": {},
        "counters": {},
        "stale_shm_files": stale,
        "log": logs,
        "load_finished": finished,
        "loadavg": os.getloadavg(),
    }


def unexpected_drain_answers(answers: list[dict]) -> list[dict]:
    """Answers a draining deployment must not give: anything but 503 + Retry-After (OpenAI-shaped) or a
    refused connection once it is gone. A 200 is fine until the first 503: the launcher forwards the
    signal to the router within its 0.2 s supervision tick."""
    first_503 = next((i for i, a in enumerate(answers) if a["status"] == 503), len(answers))
    return [
        a
        for i, a in enumerate(answers)
        if not (
            a["status"] == 200
            and i < first_503
            or a["status"] == "ConnectError"
            or a["status"] == 503
            and a["retry_after"]
            and a["shaped"]
        )
    ]


async def drain_probes(dep: Deployment, deadline: float, every_s: float = 0.1) -> list[dict]:
    """New requests while the deployment drains, one every `every_s` without waiting for the last (a
    drain can be over in a second), until the launcher has exited: each should get 503 + Retry-After."""
    t0 = time.monotonic()

    async def one(client: httpx.AsyncClient) -> dict:
        t = round(time.monotonic() - t0, 2)
        try:
            r = await client.post(dep.url + COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2})
            return {
                "t_s": t,
                "status": r.status_code,
                "retry_after": r.headers.get("retry-after"),
                "shaped": _status_and_shape(r).endswith(" ok"),
            }
        except httpx.HTTPError as e:
            return {"t_s": t, "status": type(e).__name__, "retry_after": None, "shaped": False}

    async with httpx.AsyncClient(timeout=30, trust_env=False) as client:
        tasks = []
        while dep.running() and time.monotonic() < deadline:
            tasks.append(asyncio.create_task(one(client)))
            await asyncio.sleep(every_s)
        return list(await asyncio.gather(*tasks))


# ---------------------------------------------------------------- the report


def fmt(v, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


def held_str(held: dict) -> str:
    """ "P/D" blocks held once idle, and when held ones came back ("0/6, freed at 121 s")."""
    if not held:
        return "n/a"
    text = "/".join(
        "?" if held.get(w, {}).get("held_blocks") is None else str(held[w]["held_blocks"]) for w in (PREFILL, DECODE)
    )
    late = [s["released_after_s"] for s in held.values() if s.get("held_blocks") and "released_after_s" in s]
    if late:
        text += ", " + ("never freed" if None in late else f"freed at {max(late):.0f} s")
    return text


HEADER = (
    "| fault | rep | sent | completed | refused | lost | hung | 500s | held blocks P/D | serving again (s) "
    "| P99 TTFT fault / after (ms) | P99 ITL fault / after (ms) | load | check |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(r: dict) -> str:
    f, a = r["fault_window"], r["after_window"]
    rec = (
        "n/a"
        if r["fault"] == "sigterm"
        else fmt(r["recovered_s"], ".1f")
        if r["recovered_s"] is not None
        else f"> {PROBE_LIMIT_S:.0f}"
    )
    flag = "" if r["ok"] else "FAIL: "
    return (
        f"| {r['fault']} | {r['rep']} | {r['sent']} | {r['completed']} | {r['refused']} | {r['lost']} | "
        f"{r['hung']} | {r['http500']} | {held_str(r['held_blocks'])} | {rec} | "
        f"{fmt(f['p99_ttft_ms'])} / {fmt(a['p99_ttft_ms'])} | {fmt(f['p99_itl_ms'])} / {fmt(a['p99_itl_ms'])} | "
        f"{r['loadavg'][0]:.1f} | {flag}{r['check']} |"
    )


def problems(r: dict) -> list[str]:
    """What this run did wrong, by the benchmark's rules."""
    out = []
    for k in ("lost", "hung", "http500"):
        if r[k]:
            out.append(f"{r[k]} {k}")
    held = [
        f"{w} holds {s['held_blocks']} blocks {IDLE_WAIT_S:.0f} s after the load"
        + (f" (freed {s['released_after_s']:.0f} s after it)" if s.get("released_after_s") else "")
        for w, s in r["held_blocks"].items()
        if s.get("held_blocks")
    ]
    out += held
    if r["fault"] != "sigterm" and (r["recovered_s"] is None or r["recovered_s"] >= RECOVERY_LIMIT_S):
        out.append(f"serving again after {fmt(r['recovered_s'], '.1f')} s (limit {RECOVERY_LIMIT_S:.0f})")
    if not r["ok"]:
        out.append(f"check failed: {r['check']}")
    target = {"kill_prefill": PREFILL, "kill_decode": DECODE, "stop_decode": DECODE}.get(r["fault"])
    missed = {w: n for w, n in r["log"]["heartbeats_missed"].items() if w != target}
    if missed:  # a live worker the router declared dead: its streams moved, its queue was dropped
        out.append(f"router declared live workers dead for missed heartbeats: {missed}")
    return out


def summary_rows(results: list[dict]) -> list[str]:
    lines = [
        "| fault | runs | sent | completed | refused | lost | hung | 500s | max held blocks | "
        "serving again, max (s) | P99 TTFT fault / after, median (ms) | P99 ITL fault / after, median (ms) | "
        "checks passed |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        rs = [r for r in results if r["fault"] == fault.name]
        if not rs:
            continue
        tot = {k: sum(r[k] for r in rs) for k in ("sent", "completed", "refused", "lost", "hung", "http500")}
        helds = [s.get("held_blocks") for r in rs for s in r["held_blocks"].values()]
        held = "n/a" if not helds else "?" if None in helds else str(max(helds))
        recs = [r["recovered_s"] for r in rs]
        rec = "n/a" if fault.name == "sigterm" else f"> {PROBE_LIMIT_S:.0f}" if None in recs else f"{max(recs):.1f}"

        def med(window, key):
            vals = [r[window][key] for r in rs if r[window][key] is not None]
            return fmt(float(np.median(vals)) if vals else None)

        lines.append(
            f"| {fault.title} | {len(rs)} | {tot['sent']} | {tot['completed']} | {tot['refused']} | "
            f"{tot['lost']} | {tot['hung']} | {tot['http500']} | {held} | {rec} | "
            f"{med('fault_window', 'p99_ttft_ms')} / {med('after_window', 'p99_ttft_ms')} | "
            f"{med('fault_window', 'p99_itl_ms')} / {med('after_window', 'p99_itl_ms')} | "
            f"{sum(r['ok'] for r in rs)}/{len(rs)} |"
        )
    return lines


def write_report(out_dir: str, meta: dict, results: list[dict]) -> None:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "chaos.json"), "w") as f:
        json.dump({**meta, "results": results}, f, indent=1, default=str)
    lines = [
        f"# pdserve chaos run, {meta['date']}",
        "",
        f"`{meta['command']}`",
        "",
        f"CPU: {meta['cpu']} ({meta['cores']} cores); load average (1, 5, 15 min) at the start "
        f"{', '.join(f'{x:.2f}' for x in meta['loadavg_start'])}, at the end "
        f"{', '.join(f'{x:.2f}' for x in meta.get('loadavg_end') or meta['loadavg_start'])}",
        "",
        "## Summary",
        "",
        *summary_rows(results),
        "",
        "## Every run",
        "",
        HEADER,
        *map(row, results),
        "",
    ]
    bad = [(r, p) for r in results if (p := problems(r))]
    lines += (
        ["## Problems", ""]
        + ([f"- {r['fault']} rep {r['rep']}: {'; '.join(p)}; errors: {r['errors']}" for r, p in bad] or ["none"])
        + [""]
    )
    with open(os.path.join(out_dir, "chaos.md"), "w") as f:
        f.write("\n".join(lines))


# ---------------------------------------------------------------- main

QUICK = dict(
    repetitions=1,
    warmup_s=5.0,
    after_s=8.0,
    stop_s=6.0,
    burst=6,
    burst_s=30.0,
    clients=100,
    disconnect_read_s=8.0,
    rejoin_s=10.0,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument(
        "--faults",
        default=",".join(f.name for f in FAULTS),
        help="comma-separated subset, in the order given (default: all, in the listed order)",
    )
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short smoke run: 1 repetition, short windows, a smaller burst, 100 clients, a 6 s stop",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument(
        "--out",
        default=os.path.join(REPO, "results", "chaos"),
        help="write chaos.json, chaos.md and the deployments' logs here (default: results/chaos)",
    )
    p.add_argument("--streams", type=int, default=4, help="steady load: chats in flight at most")
    p.add_argument("--rate", type=float, default=2.0, help="steady load: chats per second (Poisson)")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=48, help="mean; 32-64 with the +-33%% range")
    p.add_argument("--warmup-s", type=float, default=10.0, help="steady load before the fault")
    p.add_argument("--after-s", type=float, default=20.0, help="steady load planned after the fault's usual length")
    p.add_argument("--stop-s", type=float, default=20.0, help="stop_decode: seconds between SIGSTOP and SIGCONT")
    p.add_argument("--burst", type=int, default=16, help="kv_fill: long prompts at once")
    p.add_argument("--burst-len", type=int, default=1500, help="kv_fill: tokens per long prompt")
    p.add_argument("--burst-s", type=float, default=60.0, help="kv_fill: how long the burst usually takes")
    p.add_argument("--clients", type=int, default=500, help="disconnects: streams opened and closed")
    p.add_argument(
        "--disconnect-read-s",
        type=float,
        default=15.0,
        help="disconnects: a client waiting longer than this for its chunks closes anyway",
    )
    p.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=320,
        help="KV blocks per worker (16 tokens each): small, so --burst x --burst-len fills the decode pool",
    )
    p.add_argument(
        "--worker-timeout-s",
        type=float,
        default=2.0,
        help="the router's heartbeat timeout: a worker silent this long is dead (failures noticed fast)",
    )
    p.add_argument("--rejoin-s", type=float, default=15.0, help="kill_*: how long a restarted worker usually takes")
    p.add_argument("--rejoin-timeout-s", type=float, default=120.0)
    p.add_argument(
        "--drain-long-tokens",
        type=int,
        default=256,
        help="sigterm: a chat this long is in flight when the signal comes, and must finish",
    )
    p.add_argument("--drain-timeout-s", type=float, default=90.0, help="sigterm: the launcher must exit by then")
    p.add_argument(
        "--lease-wait-s",
        type=float,
        default=130.0,
        help="blocks still held 30 s after the load: wait this much longer to see whether they come "
        "back (a reservation's lease is --kv-timeout-s, 120 s by default), 0: do not",
    )
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    if p.parse_args(argv).quick:  # shorter defaults; flags given explicitly still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        p.error(f"unknown fault(s) {unknown}; choose from {', '.join(BY_NAME)}")
    args.fault_list = [BY_NAME[n] for n in names]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from pdserve.engine.loader import default_model_path

    tokens = TokenSource.from_path(args.model or str(default_model_path()))  # chat text needs real words
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "command": " ".join(
            [
                os.path.relpath(sys.executable, REPO) if sys.executable.startswith(REPO) else "python",
                "benchmarks/chaos.py",
                *(argv if argv is not None else sys.argv[1:]),
            ]
        ),
        "loadavg_start": os.getloadavg(),
        "args": {k: v for k, v in vars(args).items() if k != "fault_list"},
    }
    print(
        f"{meta['command']}\nCPU: {meta['cpu']}, load average {', '.join(f'{x:.2f}' for x in meta['loadavg_start'])}",
        flush=True,
    )
    results: list[dict] = []
    dep: Deployment | None = None
    try:
        for rep in range(args.repetitions):
            for fault in args.fault_list:
                dep = ready_deployment(dep, args, out_dir)
                print(f"[rep {rep}] {fault.name}: {fault.title} ...", flush=True)
                if fault.name == "sigterm":
                    r = run_sigterm(dep, rep, args, tokens)
                    dep = None  # exited (or stopped): the next fault gets a fresh one
                else:
                    r = run_fault(dep, fault, rep, args, tokens)
                results.append(r)
                print(HEADER.split("\n")[0] + "\n" + row(r), flush=True)
                if problems(r):
                    print(
                        f"  problems: {'; '.join(problems(r))}\n  errors: {r['errors']}\n  log: {r['log']}", flush=True
                    )
                write_report(out_dir, {**meta, "loadavg_end": os.getloadavg()}, results)
    except KeyboardInterrupt:
        print("interrupted: the report holds the runs so far", file=sys.stderr)
    finally:
        if dep is not None:
            dep.stop()
    meta["loadavg_end"] = os.getloadavg()
    write_report(out_dir, meta, results)
    print("\n" + "\n".join(summary_rows(results)) + f"\n\nreport: {os.path.join(out_dir, 'chaos.md')}", flush=True)
    return 0 if results and not any(problems(r) for r in results) else 1


def ready_deployment(dep: Deployment | None, args, out_dir: str) -> Deployment:
    """The deployment, healthy (both workers back, a completion served), or a fresh one in its place."""
    if dep is not None:
        if dep.running() and dep.wait_healthy(args.rejoin_timeout_s):
            return dep
        print(f"  the deployment is not healthy any more; starting a fresh one (log {dep.log_path})", flush=True)
        dep.stop()
    dep = Deployment(args, out_dir)
    try:
        print(f"  deployment up in {dep.start():.1f} s on {dep.url}", flush=True)
    except BaseException:
        dep.stop()
        raise
    return dep


if __name__ == "__main__":
    if sys.argv[1:2] == ["_disconnects"]:  # fault_disconnects' clients: URL N READ_S -> outcome counts (JSON)
        url, n, read_s = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
        print(json.dumps(asyncio.run(_disconnecting_clients(url, n, DISCONNECT_BODY, read_s))))
        sys.exit(0)
    sys.exit(main())
