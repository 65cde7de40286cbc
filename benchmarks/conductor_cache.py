"""cache_aware vs round_robin on 2 prefill workers + 1 decode, in one run (issue 5).

Workload: a scaled replay of conversations from the Mooncake conversation
trace. Each selected conversation's turns share their prefix (turn k+1's hash
ids extend turn k's); the same hash id is the same `--block-tokens` tokens
everywhere (pdserve/bench/datasets.py's mooncake loader), so a prefill worker
that served turn k caches most of turn k+1. The first `--conversations`
conversations of the trace with at least `--min-turns` turns are kept (their
first `--max-turns` turns), in trace order, sent at `--request-rate` (Poisson):
the trace's own gaps (minutes between turns) would make the run hours long.

Reported per policy: the prefill workers' prefix-cache hit rate (hit tokens /
looked-up tokens, from their own counters) and mean TTFT from the client.

    flock /tmp/pdserve-measure.lock .venv/bin/python benchmarks/conductor_cache.py

Results in docs/conductor.md (x1.63 hit rate, x0.73 mean TTFT at the defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from conductor_common import Deployment, load_str
from pdserve.bench import datasets
from pdserve.bench.runner import run_benchmark
from pdserve.bench.tokens import TokenSource

# The sample in tests/data holds the 75 requests the defaults select; pass the whole
# trace with --trace to select other ones.
TRACE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "mooncake_conversation_sample.jsonl"
)


def run_policy(policy: str, requests, args) -> dict:
    engine = ["--block-size", str(args.block_size), "--max-model-len", "4096"]
    if args.kv_blocks:
        engine += ["--num-gpu-blocks", str(args.kv_blocks)]
    with Deployment(2, 1, model=args.model, router_args=["--policy", policy], worker_args=engine) as dep:
        before = dep.worker_stats("prefill")
        res = run_benchmark(
            requests,
            dep.url,
            request_rate=args.request_rate,
            use_trace_times=False,
            ignore_eos=True,
            seed=args.seed,
            timeout_s=600,
        )
        time.sleep(1.5)  # one heartbeat carries the final counters
        after = dep.worker_stats("prefill")
        q = sum(s["prefix_cache_queries_tokens"] for s in after) - sum(s["prefix_cache_queries_tokens"] for s in before)
        h = sum(s["prefix_cache_hits_tokens"] for s in after) - sum(s["prefix_cache_hits_tokens"] for s in before)
        return {
            "policy": policy,
            "hit_rate": h / q if q else 0.0,
            "hit_tokens": h,
            "query_tokens": q,
            "mean_ttft_ms": res["mean_ttft_ms"],
            "median_ttft_ms": res["median_ttft_ms"],
            "p99_ttft_ms": res.get("p99_ttft_ms"),
            "completed": res["completed"],
            "failed": res["failed"],
            "duration_s": res["duration"],
            "conductor": dep.conductor(),
        }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=TRACE, help="a Mooncake trace (default: the sample in tests/data)")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--min-turns", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-input-tokens", type=int, default=12000, help="trace tokens (before scaling)")
    p.add_argument("--block-tokens", type=int, default=32, help="tokens per trace hash id (the trace's is 512)")
    p.add_argument("--output-scale", type=float, default=0.02)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=0.5)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=128,
        help="KV blocks per worker; 128 x 16 tokens is a quarter of the 8,768 distinct prompt tokens of the "
        "defaults, so placement decides what stays cached, as in production (0: the engine's default "
        "pool, far larger than this workload)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", nargs="+", default=["round_robin", "cache_aware"])
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    from pdserve.engine.loader import default_model_path, load_model_info

    vocab = load_model_info(args.model or default_model_path()).config.vocab_size
    convs = datasets.mooncake_conversations(
        args.trace,
        args.conversations,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        max_input_tokens=args.max_input_tokens,
    )
    recs = sorted((t for c in convs for t in c), key=lambda t: t["timestamp"])
    scaling = datasets.MooncakeScaling(block_tokens=args.block_tokens, output_scale=args.output_scale)
    requests = datasets.mooncake_records(recs, TokenSource(vocab_size=vocab), seed=args.seed, scaling=scaling)
    mean_in = sum(r.prompt_len for r in requests) / len(requests)
    mean_out = sum(r.output_len for r in requests) / len(requests)
    unique = len({h for r in recs for h in r["hash_ids"]}) * args.block_tokens
    print(
        f"{len(requests)} requests from {args.conversations} conversations, mean {mean_in:.0f} prompt / "
        f"{mean_out:.1f} output tokens, {unique} distinct prompt tokens, {args.request_rate} req/s, "
        f"KV blocks per worker: {args.kv_blocks or 'default'}; load before: {load_str()}",
        flush=True,
    )
    results = []
    for policy in args.policies:
        r = run_policy(policy, requests, args)
        results.append(r)
        print(
            f"{policy:12s} hit rate {r['hit_rate']:.3f} ({r['hit_tokens']}/{r['query_tokens']} tokens)  "
            f"mean TTFT {r['mean_ttft_ms']:.0f} ms  median {r['median_ttft_ms']:.0f} ms  "
            f"completed {r['completed']} failed {r['failed']}  load {load_str()}",
            flush=True,
        )
    if len(results) == 2:
        a, b = results
        print(
            f"{b['policy']} / {a['policy']}: hit rate x{b['hit_rate'] / max(a['hit_rate'], 1e-9):.2f}, "
            f"mean TTFT x{b['mean_ttft_ms'] / a['mean_ttft_ms']:.2f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
