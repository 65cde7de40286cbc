"""What request tracing costs: a disaggregated `pdserve serve` with and without
--otlp-traces-endpoint, same workload, alternating rounds.

Each round starts the deployment (router + 1 prefill + 1 decode worker, the embedded
model) once without tracing and once exporting every request's spans over OTLP/grpc to
a receiver in this process (which decodes them, as a collector would), in alternating
order, and sends the same streamed completions at a fixed concurrency. Prints per mode
the mean TTFT, the median inter-token gap and output tokens/s, the traced/untraced
ratio of each per round, and their median [min-max] over the rounds. First, in this
process, the CPU that the spans of one request cost (`span_cost`): the end-to-end
ratios of a 2-core machine are noisier than that cost.

    python benchmarks/tracing.py --rounds 3 --json tracing.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import httpx
import numpy as np

from pdserve.testing.otlp import Collector
from pdserve.testing.serve import Serve

WARMUP = 2  # requests before each timed workload


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    stamps = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                if json.loads(line[6:])["choices"][0]["text"] or not stamps:
                    stamps.append(time.perf_counter())
    return {"ttft": stamps[0] - t0, "gaps": np.diff(stamps).tolist(), "tokens": max_tokens}


async def _workload(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300, trust_env=False) as client:

        async def run(p):
            async with sem:
                return await _one(client, url, p, max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        wall = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "mean_ttft_ms": 1e3 * statistics.mean(r["ttft"] for r in results),
        "median_itl_ms": 1e3 * statistics.median(gaps),
        "p99_itl_ms": 1e3 * float(np.percentile(gaps, 99)),
        "output_tok_s": sum(r["tokens"] for r in results) / wall,
    }


def run_mode(args, traced: bool, prompts, collector: Collector) -> dict:
    flags = ["--served-model-name", "m"]
    if traced:
        flags += ["--otlp-traces-endpoint", collector.endpoint]
    before = len(collector.spans)
    with Serve(flags, wait_workers=2, env={"OTEL_BSP_SCHEDULE_DELAY": "500"}) as srv:
        asyncio.run(_workload(srv.url, prompts[:WARMUP], 4, WARMUP))
        out = asyncio.run(_workload(srv.url, prompts, args.output_len, args.concurrency))
    time.sleep(1.0 if traced else 0)  # the last batch of spans
    out["spans"] = len(collector.spans) - before
    return out


def _receiver(endpoint_q, stop, count_q) -> None:
    """A collector in a process of its own (span_cost): its decoding is not ours."""
    with Collector("grpc") as col:
        endpoint_q.put(col.endpoint)
        stop.wait()
        time.sleep(0.5)
        count_q.put(len(col.spans))


def span_cost(n: int) -> dict:
    """CPU per request of the spans themselves: the eight spans of one disaggregated request
    (with the header each call carries and each worker reads), made n times in this process
    and exported over OTLP/gRPC to a receiver in another. Per request: `made_us`, wall time
    of the loop that makes them; `cpu_us`, this process's CPU including the export."""
    import multiprocessing

    from pdserve import tracing

    os.environ[tracing.PROTOCOL_ENV] = "grpc"
    os.environ["OTEL_BSP_MAX_QUEUE_SIZE"] = str(16 * n)  # a burst far above any request rate: keep every span
    ctx = multiprocessing.get_context("spawn")
    endpoint_q, count_q, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_receiver, args=(endpoint_q, stop, count_q), daemon=True)
    proc.start()
    try:
        tracing.configure(endpoint_q.get(timeout=60), "bench")
        caller = {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            now = time.monotonic()
            req = tracing.start(
                "llm_request",
                tracing.extract(caller),
                kind="server",
                attributes={"gen_ai.request.id": str(i), "gen_ai.request.n": 1},
                start_s=now,
            )
            route = tracing.start("route", req, attributes={"pdserve.choice": 0, "gen_ai.usage.prompt_tokens": 256})
            for name in ("reserve", "prefill", "decode"):
                with tracing.span(name, route, kind="client", attributes={"pdserve.worker.id": "w"}) as sp:
                    remote = tracing.extract(sp.headers())
                    if name != "reserve":
                        attrs = {"gen_ai.usage.prompt_tokens": 256, "gen_ai.latency.e2e": 0.1}
                        events = [("scheduled", now), ("first_token", now)]
                        tracing.record("engine_request", remote, now, now + 0.1, attrs, events=events)
                    if name == "prefill":
                        tracing.record("kv_transfer", remote, now, now + 0.01, {"pdserve.kv.bytes": 1 << 20})
            route.set({"pdserve.kv.bytes": 1 << 20, "gen_ai.usage.completion_tokens": 32})
            route.end()
            req.set({"gen_ai.usage.completion_tokens": 32, "pdserve.outcome": "ok"})
            req.end()
        made_s = time.perf_counter() - t0
        tracing.shutdown()  # exports what is left
        cpu_s = time.process_time() - cpu0
        stop.set()
        spans = count_q.get(timeout=60)
    finally:
        stop.set()
        proc.join(10)
        del os.environ["OTEL_BSP_MAX_QUEUE_SIZE"]
    return {"requests": n, "spans": spans, "made_us": 1e6 * made_s / n, "cpu_us": 1e6 * cpu_s / n}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--json", help="write the rounds and the summary here")
    ap.add_argument("--span-cost-requests", type=int, default=2000, help="requests of the in-process span cost")
    args = ap.parse_args()
    cost = span_cost(args.span_cost_requests)
    print("span cost: " + json.dumps(cost), flush=True)
    rng = np.random.default_rng(0)
    # random ids (no shared prefix, no special token of SmolLM2's: those are below 17)
    prompts = [rng.integers(100, 40000, args.input_len).tolist() for _ in range(args.num_prompts)]
    rounds = []
    with Collector("grpc") as col:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            res = {("traced" if t else "untraced"): run_mode(args, t, prompts, col) for t in order}
            rounds.append(res)
            print(f"round {r + 1}: " + json.dumps(res), flush=True)
    keys = ("mean_ttft_ms", "median_itl_ms", "p99_itl_ms", "output_tok_s")
    summary = {}
    for k in keys:
        ratios = [x["traced"][k] / x["untraced"][k] for x in rounds]
        summary[k] = {
            "untraced": statistics.median(x["untraced"][k] for x in rounds),
            "traced": statistics.median(x["traced"][k] for x in rounds),
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    summary["spans_per_request"] = statistics.median(x["traced"]["spans"] for x in rounds) / (args.num_prompts + WARMUP)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"\n{cpu}, {os.cpu_count()} cores; traced / untraced, median of {args.rounds} rounds [min-max]:")
    for k in keys:
        s = summary[k]
        print(
            f"  {k:14s} {s['untraced']:9.1f} -> {s['traced']:9.1f}   "
            f"{s['ratio']:.3f}x [{s['ratio_min']:.3f}-{s['ratio_max']:.3f}]"
        )
    print(f"  spans per request: {summary['spans_per_request']:.1f}")
    print(
        f"span cost per request (8 spans, made in one process): {cost['made_us']:.0f} us, "
        f"{cost['cpu_us']:.0f} us CPU with their export"
    )
    if args.json:
        with open(args.json, "w") as f:
            doc = {"args": vars(args), "cpu": cpu, "span_cost": cost, "rounds": rounds, "summary": summary}
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
