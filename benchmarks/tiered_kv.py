"""KV tiers on vs off on a multi-turn replay of the Mooncake conversation trace (issue 17), one run.

Workload: the first `--conversations` conversations of the trace with at least
`--min-turns` turns (their first `--max-turns` turns, each under
`--max-input-tokens` trace tokens), in trace order. A conversation's turns
share their prefix (turn k+1's hash ids extend turn k's), and every hash id is
the same `--block-tokens` tokens wherever it appears (the trace's is 512), so
turn k+1 can reuse the KV of turn k if it is still somewhere. Every request
asks for `--max-tokens` output tokens (greedy, EOS ignored). Requests are
sent one at a time in trace order (a closed loop of one user), the same
requests in the same order for every configuration: TTFT is then prefill plus
any tier load, with no queueing, and two configurations differ only in what
they had to compute.

Part 1, collocated (`pdserve serve --mode collocated`): a pool of
`--kv-blocks` blocks, a fraction of the workload's distinct prompt blocks (the
working set), so a conversation's prefix is usually evicted before its next
turn; tiers off, then the same with `--kv-offload-bytes` (L2) and
`--kv-disk-dir` (L3, a fresh directory per run). Reported: mean, P50 and P99
TTFT, prompt tokens computed, tier hits per tier and their load seconds; the
ratios on/off. For reference each round also runs a pool large enough never to
evict (tiers off): what a perfect cache would give, since every configuration
must still compute the tokens no earlier request sent. `--rounds` paired rounds, the order alternating (off, on), (on,
off), ..., medians over rounds with their min-max.

Part 2, disaggregated (`pdserve serve`, 2 prefill + 1 decode, `--policy
round_robin`): the first `--disagg-conversations` of those conversations, with
and without `--kv-store mooncake` (each worker's own pool large enough to keep
everything, so a prefill worker misses only what another worker computed).
Hit rate = 1 - (prompt tokens the prefill workers computed) / (prompt tokens
of the requests): the share of prompt tokens served from a cache, local or
loaded from the store; the store's share is its hits x block size / prompt
tokens.

    .venv/bin/python benchmarks/tiered_kv.py --out results/tiered_kv.json

Results in docs/kv_store.md; the log in docs/results/2026-12-01-tiered-kv.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time

from pdserve.bench import datasets
from pdserve.bench.runner import run_benchmark
from pdserve.bench.tokens import TokenSource
from pdserve.config import cpu_flags, cpu_model
from pdserve.testing.serve import Serve

TRACE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "mooncake_conversation_sample.jsonl"
)
TIERS = ("host", "disk", "mooncake")


# ---- workload
def build_requests(convs: list[list[dict]], args, vocab_size: int) -> tuple[list, dict]:
    """The requests in trace order, and what they are (sizes against the pool)."""
    recs = sorted((t for c in convs for t in c), key=lambda t: t["timestamp"])
    scaling = datasets.MooncakeScaling(block_tokens=args.block_tokens)
    reqs = datasets.mooncake_records(recs, TokenSource(vocab_size=vocab_size), seed=args.seed, scaling=scaling)
    for r in reqs:
        r.output_len = args.max_tokens
    bs = args.block_size
    distinct = set()  # the working set: distinct full prompt blocks (a block is its whole prefix)
    for r in reqs:
        distinct.update(tuple(r.prompt[: (i + 1) * bs]) for i in range(r.prompt_len // bs))
    lens = [r.prompt_len for r in reqs]
    info = {
        "requests": len(reqs),
        "conversations": len(convs),
        "prompt_tokens": sum(lens),
        "mean_prompt_tokens": round(sum(lens) / len(lens)),
        "min_prompt_tokens": min(lens),
        "max_prompt_tokens": max(lens),
        "working_set_blocks": len(distinct),
    }
    return reqs, info


def _metric(m: dict, name: str, tier: str = "") -> float:
    """A counter by its name without the `_total` suffix the client library adds."""
    label = f"{{{tier}}}" if tier else ""
    return m.get(f"pdserve:{name}_total{label}", m.get(f"pdserve:{name}{label}", 0.0))


def _tier_delta(before: dict, after: dict, name: str) -> dict[str, float]:
    return {
        t: _metric(after, name, t) - _metric(before, name, t)
        for t in TIERS
        if f"pdserve:{name}_total{{{t}}}" in after or f"pdserve:{name}{{{t}}}" in after
    }


def _ttfts(res: dict) -> dict:
    return {
        "mean_ttft_ms": res["mean_ttft_ms"],
        "p50_ttft_ms": res["median_ttft_ms"],
        "p99_ttft_ms": res["p99_ttft_ms"],
        "completed": res["completed"],
        "failed": res["failed"],
        "duration_s": round(res["duration"], 1),
        "ttfts_ms": [round(t * 1000, 1) for t in res["ttfts"]],
    }


def _send(reqs, url: str) -> dict:
    res = run_benchmark(reqs, url, max_concurrency=1, use_trace_times=False, ignore_eos=True, timeout_s=900)
    if res["interrupted"]:  # run_benchmark keeps what it measured; this benchmark stops (and stops its server)
        raise KeyboardInterrupt
    return res


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


# ---- part 1: collocated, tiers off vs on
def run_collocated(reqs, args, tiers_on: bool, kv_blocks: int | None = None) -> dict:
    serve = [
        "--mode",
        "collocated",
        "--threads",
        str(args.threads),
        "--block-size",
        str(args.block_size),
        "--num-gpu-blocks",
        str(kv_blocks or args.kv_blocks),
        "--max-model-len",
        "4096",
    ]
    with tempfile.TemporaryDirectory(prefix="tiered-kv-") as disk_dir:  # fresh: L3 outlives a process
        if tiers_on:
            serve += [
                "--kv-offload-bytes",
                str(args.offload_bytes),
                "--kv-disk-dir",
                disk_dir,
                "--kv-disk-bytes",
                str(args.disk_bytes),
            ]
        with Serve(serve) as dep:
            before = dep.metrics()
            res = _send(reqs, dep.url)
            time.sleep(0.5)
            after = dep.metrics()
    out = {
        "tiers": "on" if tiers_on else "off",
        "kv_blocks": kv_blocks or args.kv_blocks,
        **_ttfts(res),
        "prompt_tokens": sum(res["input_lens"]),
        "prompt_tokens_computed": (
            _metric(after, "prompt_tokens_computed") - _metric(before, "prompt_tokens_computed")
        ),
        "prefix_cache_hit_tokens": _metric(after, "prefix_cache_hits") - _metric(before, "prefix_cache_hits"),
    }
    if tiers_on:
        out["tier_hit_blocks"] = _tier_delta(before, after, "kv_tier_hits")
        out["tier_load_s"] = {t: round(v, 3) for t, v in _tier_delta(before, after, "kv_tier_load_seconds").items()}
        out["tier_errors"] = _tier_delta(before, after, "kv_tier_errors")
        out["tier_evictions"] = _tier_delta(before, after, "kv_tier_evictions")
    return out


# ---- part 2: disaggregated, 2 prefill workers under round robin, with and without the shared store
def run_disagg(reqs, args, store_on: bool) -> dict:
    serve = [
        "--prefill",
        "2",
        "--decode",
        "1",
        "--policy",
        "round_robin",
        "--threads",
        "1",
        "--block-size",
        str(args.block_size),
        "--max-model-len",
        "4096",
    ]
    if args.disagg_kv_blocks:
        serve += ["--num-gpu-blocks", str(args.disagg_kv_blocks)]
    if store_on:
        serve += ["--kv-store", "mooncake"]
    with Serve(serve, wait_workers=3) as dep:
        time.sleep(2.0)  # counters after the workers' start-up calibration, which computes prompts too
        before = _prefill_counters(dep)
        res = _send(reqs, dep.url)
        time.sleep(2.0)  # one heartbeat carries the workers' final counters
        after = _prefill_counters(dep)
    d = {k: after[k] - before[k] for k in after}
    prompt = sum(res["input_lens"])
    return {
        "store": "mooncake" if store_on else "none",
        **_ttfts(res),
        "prompt_tokens": prompt,
        "prompt_tokens_computed": d["computed"],
        "hit_rate": 1 - d["computed"] / prompt,
        "local_hit_tokens": d["local"],
        "looked_up_tokens": d["looked_up"],
        "store_hit_blocks": d["store"],
        "store_hit_rate": d["store"] * args.block_size / prompt,
        "store_load_s": round(d["store_s"], 3),
    }


def _prefill_counters(dep: Serve) -> dict[str, float]:
    """The prefill workers' counters, summed (the router's /metrics would add the decode worker's)."""
    stats = [w["stats"] for w in dep.workers() if w["role"] == "prefill" and w["stats"]]
    store = [s.get("kv_store", {}).get("tiers", {}).get("mooncake", {}) for s in stats]
    return {
        "computed": sum(s.get("prompt_tokens_computed", 0) for s in stats),
        "local": sum(s.get("prefix_cache_hits_tokens", 0) for s in stats),
        "looked_up": sum(s.get("prefix_cache_queries_tokens", 0) for s in stats),
        "store": sum(t.get("hits", 0) for t in store),
        "store_s": sum(t.get("load_seconds", 0.0) for t in store),
    }


# ---- report
def cpu() -> dict:
    return {"model": cpu_model(), "cores": os.cpu_count(), "avx512_bf16": "avx512_bf16" in cpu_flags()}


def _spread(values: list[float], fmt: str = "{:,.0f}") -> str:
    """The median of the rounds, with their range when there are several."""
    med = fmt.format(statistics.median(values))
    return med if len(values) == 1 else f"{med} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def summarize_collocated(rounds: list[dict]) -> dict:
    ratio = {k: [r["on"][k] / r["off"][k] for r in rounds] for k in ("mean_ttft_ms", "prompt_tokens_computed")}
    return {
        "mean_ttft_ratio": statistics.median(ratio["mean_ttft_ms"]),
        "mean_ttft_ratio_range": [min(ratio["mean_ttft_ms"]), max(ratio["mean_ttft_ms"])],
        "prompt_tokens_computed_ratio": statistics.median(ratio["prompt_tokens_computed"]),
        "prompt_tokens_computed_ratio_range": [
            min(ratio["prompt_tokens_computed"]),
            max(ratio["prompt_tokens_computed"]),
        ],
        "target_met": max(statistics.median(v) for v in ratio.values()) <= 0.5,
        **(
            {
                "ideal_mean_ttft_ratio": statistics.median(
                    r["ideal"]["mean_ttft_ms"] / r["off"]["mean_ttft_ms"] for r in rounds
                ),
                "share_of_ideal_gain": statistics.median(_share(r) for r in rounds),
            }
            if "ideal" in rounds[0]
            else {}
        ),
    }


def _share(r: dict) -> float:
    """How much of the TTFT a pool that never evicts saves, the tiers save."""
    gain = r["off"]["mean_ttft_ms"] - r["ideal"]["mean_ttft_ms"]
    return (r["off"]["mean_ttft_ms"] - r["on"]["mean_ttft_ms"]) / gain if gain > 0 else float("nan")


def collocated_table(rounds: list[dict], summary: dict) -> str:
    def col(cfg, key, fmt="{:,.0f}"):
        return _spread([r[cfg][key] for r in rounds], fmt)

    def ratio(key, fmt="{:.2f}"):
        return _spread([r["on"][key] / r["off"][key] for r in rounds], fmt)

    rows = [
        ("mean TTFT, ms", "mean_ttft_ms"),
        ("P50 TTFT, ms", "p50_ttft_ms"),
        ("P99 TTFT, ms", "p99_ttft_ms"),
        ("prompt tokens computed", "prompt_tokens_computed"),
        ("prefix-cache hit tokens", "prefix_cache_hit_tokens"),
    ]
    ideal = "ideal" in rounds[0]
    head = "| collocated (median [min-max] of rounds) | tiers off | tiers on | on/off |"
    if ideal:
        head += f" no eviction ({rounds[0]['ideal']['kv_blocks']} blocks, no tiers) |"
    lines = [head, "|---|---|---|---|" + ("---|" if ideal else "")]
    lines += [
        f"| {label} | {col('off', k)} | {col('on', k)} | {ratio(k)} |" + (f" {col('ideal', k)} |" if ideal else "")
        for label, k in rows
    ]
    for t in rounds[0]["on"]["tier_hit_blocks"]:
        hits = _spread([r["on"]["tier_hit_blocks"][t] for r in rounds])
        load = _spread([r["on"]["tier_load_s"][t] for r in rounds], "{:.2f}")
        lines.append(f"| {t} tier: blocks loaded / load s | - | {hits} / {load} | |" + (" |" if ideal else ""))
    cfgs = ("off", "on", "ideal") if ideal else ("off", "on")
    done = [f"{r[c]['completed']}/{r[c]['completed'] + r[c]['failed']}" for r in rounds for c in cfgs]
    lines.append(f"| completed (each run) | | | {', '.join(done)} |" + (" |" if ideal else ""))
    if ideal:
        lines.append(
            f"\nA pool that never evicts: mean TTFT x{summary['ideal_mean_ttft_ratio']:.2f} of tiers off "
            f"(the floor for any cache here); the tiers get {summary['share_of_ideal_gain']:.0%} of its gain."
        )
    lines.append(
        f"\nTarget (both ratios <= 0.5): {'met' if summary['target_met'] else 'NOT met'} "
        f"(mean TTFT x{summary['mean_ttft_ratio']:.2f}, prompt tokens computed "
        f"x{summary['prompt_tokens_computed_ratio']:.2f})"
    )
    return "\n".join(lines)


def disagg_table(runs: list[dict]) -> str:
    by = {r["store"]: r for r in runs}
    a, b = by["none"], by["mooncake"]
    rows = [
        ("hit rate: 1 - computed / prompt tokens", "hit_rate", "{:.3f}"),
        ("of which loaded from the store", "store_hit_rate", "{:.3f}"),
        ("prompt tokens (requests)", "prompt_tokens", "{:,}"),
        ("prompt tokens computed (prefill workers)", "prompt_tokens_computed", "{:,}"),
        ("local prefix-cache hit tokens", "local_hit_tokens", "{:,}"),
        ("store blocks loaded / load s", None, None),
        ("mean TTFT, ms", "mean_ttft_ms", "{:,.0f}"),
        ("P50 TTFT, ms", "p50_ttft_ms", "{:,.0f}"),
        ("P99 TTFT, ms", "p99_ttft_ms", "{:,.0f}"),
    ]
    lines = ["| 2 prefill (round_robin) + 1 decode | no shared store | --kv-store mooncake |", "|---|---|---|"]
    for label, k, fmt in rows:
        if k is None:
            lines.append(f"| {label} | - | {b['store_hit_blocks']:,} / {b['store_load_s']:.2f} |")
        else:
            lines.append(f"| {label} | {fmt.format(a[k])} | {fmt.format(b[k])} |")
    lines.append(
        f"| completed | {a['completed']}/{a['completed'] + a['failed']} | "
        f"{b['completed']}/{b['completed'] + b['failed']} |"
    )
    return "\n".join(lines)


# ---- main
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=TRACE, help="a Mooncake trace (default: the sample in tests/data)")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--min-turns", type=int, default=4)
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-input-tokens", type=int, default=12000, help="trace tokens, before scaling")
    p.add_argument(
        "--block-tokens",
        type=int,
        default=64,
        help="tokens per trace hash id (the trace's is 512): prompts of ~200-1,500 tokens",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens of every request")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--kv-blocks",
        type=int,
        default=128,
        help="collocated pool, in blocks: ~14%% of the default workload's 922-block working set, "
        "1.4x its longest prompt (at 256 blocks, 28%%, even a pool that never evicts "
        "only reaches ~0.54x the TTFT: the pool alone already keeps half the prefixes)",
    )
    p.add_argument(
        "--offload-bytes",
        type=int,
        default=128 << 20,
        help="--kv-offload-bytes (L2) with tiers on: ~340 blocks, so older prefixes reach L3",
    )
    p.add_argument("--disk-bytes", type=int, default=2 << 30, help="--kv-disk-bytes (L3) with tiers on")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="collocated engine threads (2 threads on 2 shared cores stall whenever anything else runs)",
    )
    p.add_argument("--rounds", type=int, default=3, help="paired collocated rounds (off and on each)")
    p.add_argument(
        "--no-ideal",
        dest="ideal",
        action="store_false",
        help="skip the reference run with a pool that never evicts (the floor for any cache)",
    )
    p.add_argument("--disagg-conversations", type=int, default=8, help="0: skip the disaggregated part")
    p.add_argument("--disagg-kv-blocks", type=int, default=0, help="0: the engine's default pool (no eviction)")
    p.add_argument("--skip-collocated", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/tiered_kv.json", help="the results as JSON")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the deployment too, not only this process
    from pdserve.engine.loader import default_model_path, load_model_info

    vocab = load_model_info(default_model_path()).config.vocab_size
    convs = datasets.mooncake_conversations(
        args.trace,
        args.conversations,
        min_turns=args.min_turns,
        max_turns=args.max_turns,
        max_input_tokens=args.max_input_tokens,
    )
    reqs, info = build_requests(convs, args, vocab)
    result = {"args": vars(args), "cpu": cpu(), "workload": info, "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(f"CPU: {result['cpu']['model']}, {result['cpu']['cores']} cores, avx512_bf16: {result['cpu']['avx512_bf16']}")
    print(
        f"workload: {json.dumps(info)}; pool {args.kv_blocks} blocks = "
        f"{args.kv_blocks / info['working_set_blocks']:.0%} of the working set",
        flush=True,
    )
    if not args.skip_collocated:
        rounds = []
        for i in range(args.rounds):
            order = ("off", "on") if i % 2 == 0 else ("on", "off")  # alternate, so drift hits both
            order += ("ideal",) if args.ideal else ()
            r = {}
            for cfg in order:
                blocks = info["working_set_blocks"] + 2 * info["max_prompt_tokens"] // args.block_size + 8
                r[cfg] = run_collocated(reqs, args, cfg == "on", blocks if cfg == "ideal" else None)
                shown = {k: v for k, v in r[cfg].items() if k != "ttfts_ms"}
                print(f"round {i + 1} {cfg:5s}: {json.dumps(shown)}", flush=True)
            rounds.append(r)
        result["collocated"] = {"rounds": rounds, "summary": summarize_collocated(rounds)}
        print("\n" + collocated_table(rounds, result["collocated"]["summary"]) + "\n", flush=True)
    if args.disagg_conversations:
        dreqs, dinfo = build_requests(convs[: args.disagg_conversations], args, vocab)
        print(f"disaggregated workload: {json.dumps(dinfo)}", flush=True)
        runs = []
        for on in (False, True):
            runs.append(run_disagg(dreqs, args, on))
            shown = {k: v for k, v in runs[-1].items() if k != "ttfts_ms"}
            print(f"store {'on ' if on else 'off'}: {json.dumps(shown)}", flush=True)
        result["disaggregated"] = {"workload": dinfo, "runs": runs}
        print("\n" + disagg_table(runs), flush=True)
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
