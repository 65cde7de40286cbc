"""Overload: a burst of 10x the sustainable rate for 30 s, with and without early rejection (issue 5).

1. A deployment without admission control (1 prefill + 1 decode worker):
   - a light probe (closed loop, 2 at a time) gives the unloaded median TTFT and
     TPOT; unless given, the SLOs are `--slo-factor` times those;
   - the sustainable rate: open-loop Poisson runs of `--probe-s` seconds, from
     `--rate-factor` x the probe's throughput down by 0.7x until at least 90% of
     requests meet both SLOs;
   - the burst: `--burst-x` x that rate for `--burst-s` seconds.
2. A fresh deployment with --slo-ttft-ms / --slo-tpot-ms on the router: the same burst.

Goodput = requests that met both SLOs / the run's duration (vLLM's definition:
from the first send to the last response). A request "timed out" when it had
no complete answer `--timeout-s` after it was sent; rejected = HTTP 429.

    flock /tmp/pdserve-measure.lock .venv/bin/python benchmarks/conductor_overload.py
"""

from __future__ import annotations

import argparse
import json
import sys

from conductor_common import Deployment, load_str
from pdserve.bench import datasets
from pdserve.bench.metrics import tpot_s
from pdserve.bench.runner import RunState, run_benchmark
from pdserve.bench.tokens import TokenSource


def workload(n: int, args, tokens, seed: int):
    return datasets.random(n, args.input_len, args.output_len, tokens, seed=seed, range_ratio=0.25)


def run(dep: Deployment, requests, args, rate: float | None, slos_ms: dict | None, concurrency=None) -> dict:
    state = RunState([])
    res = run_benchmark(
        requests,
        dep.url,
        request_rate=rate or float("inf"),
        max_concurrency=concurrency,
        ignore_eos=True,
        seed=args.seed,
        timeout_s=args.timeout_s,
        goodput=slos_ms,
        state=state,
    )
    outs = state.outputs
    rejected = sum("HTTP 429" in o.error for o in outs)
    # no answer in time: a read that waited timeout_s, or a stream that completed later than that
    timeout_errors = sum(not o.success and "HTTP 429" not in o.error and "timed out" in o.error for o in outs)
    timed_out = timeout_errors + sum(o.success and o.latency_s > args.timeout_s for o in outs)
    good = (
        sum(
            o.success and o.ttft_s * 1e3 <= slos_ms["ttft"] and (tpot_s(o) or 0.0) * 1e3 <= slos_ms["tpot"]
            for o in outs
        )
        if slos_ms
        else None
    )
    other = sum(not o.success and "HTTP 429" not in o.error for o in outs) - timeout_errors
    return {
        "sent": len(outs),
        "completed": res["completed"],
        "rejected_429": rejected,
        "admitted": len(outs) - rejected,
        "admitted_timed_out": timed_out,
        "other_failures": other,
        "errors": sorted({o.error[:120] for o in outs if o.error and "HTTP 429" not in o.error})[:5],
        "good": good,
        "duration_s": res["duration"],
        "goodput_rps": good / res["duration"] if good is not None and res["duration"] else None,
        "request_throughput": res["request_throughput"],
        "median_ttft_ms": res["median_ttft_ms"],
        "median_tpot_ms": res["median_tpot_ms"],
        "p99_ttft_ms": res.get("p99_ttft_ms"),
        "p99_tpot_ms": res.get("p99_tpot_ms"),
    }


def engine_args(args) -> list[str]:
    return ["--max-model-len", "2048", "--max-num-seqs", str(args.max_num_seqs)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-factor", type=float, default=4.0, help="SLO = this x the unloaded median (when not given)")
    p.add_argument("--rate", type=float, default=None, help="the sustainable rate (default: found)")
    p.add_argument("--rate-factor", type=float, default=0.7)
    p.add_argument("--probe-s", type=float, default=20.0)
    p.add_argument("--burst-x", type=float, default=10.0)
    p.add_argument("--burst-s", type=float, default=30.0)
    p.add_argument("--timeout-s", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from pdserve.engine.loader import default_model_path, load_model_info

    tokens = TokenSource(vocab_size=load_model_info(args.model or default_model_path()).config.vocab_size)
    report: dict = {"args": vars(args), "load_before": load_str()}
    print(f"load before: {report['load_before']}", flush=True)
    with Deployment(1, 1, model=args.model, worker_args=engine_args(args)) as dep:
        probe = run(dep, workload(8, args, tokens, 1), args, None, None, concurrency=2)
        slos = {
            "ttft": args.slo_ttft_ms or max(500.0, args.slo_factor * probe["median_ttft_ms"]),
            "tpot": args.slo_tpot_ms or max(50.0, args.slo_factor * probe["median_tpot_ms"]),
        }
        print(f"probe: {json.dumps(probe)}\nSLOs (ms): {slos}", flush=True)
        rate = args.rate or args.rate_factor * probe["request_throughput"]
        for attempt in range(3 if args.rate is None else 0):
            n = max(4, round(rate * args.probe_s))
            r = run(dep, workload(n, args, tokens, 10 + attempt), args, rate, slos)
            print(f"rate {rate:.3f} req/s: {r['good']}/{n} met both SLOs  ({load_str()})", flush=True)
            if r["good"] >= 0.9 * n:
                break
            rate *= 0.7
        report.update(slos_ms=slos, sustainable_rps=rate, probe=probe)
        burst = workload(max(1, round(args.burst_x * rate * args.burst_s)), args, tokens, 99)
        print(f"burst: {len(burst)} requests at {args.burst_x * rate:.2f} req/s", flush=True)
        report["without_rejection"] = run(dep, burst, args, args.burst_x * rate, slos)
        print(f"without rejection: {json.dumps(report['without_rejection'])}  ({load_str()})", flush=True)
    flags = ["--slo-ttft-ms", str(slos["ttft"]), "--slo-tpot-ms", str(slos["tpot"])]
    with Deployment(1, 1, model=args.model, worker_args=engine_args(args), router_args=flags) as dep:
        run(dep, workload(4, args, tokens, 2), args, None, slos, concurrency=1)  # the same warm state as above
        report["with_rejection"] = run(dep, burst, args, args.burst_x * rate, slos)
        report["router_admission"] = dep.status().get("admission")
        print(f"with rejection: {json.dumps(report['with_rejection'])}  ({load_str()})", flush=True)
    a, b = report["without_rejection"], report["with_rejection"]
    ratio = b["goodput_rps"] / a["goodput_rps"] if a["goodput_rps"] else float("inf")
    report["goodput_ratio"] = ratio
    print(
        f"goodput: {a['goodput_rps']:.3f} -> {b['goodput_rps']:.3f} req/s (x{ratio:.2f}); rejected "
        f"{b['rejected_429']}; admitted and timed out: without {a['admitted_timed_out']}, with "
        f"{b['admitted_timed_out']}; load after: {load_str()}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
