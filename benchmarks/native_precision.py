"""pdserve's faster compute modes against the exact float32 mode: bf16 (`dtype="auto"` on CPUs
with AVX512-BF16/AMX) and int8 activations (`--int8-activations`; `dtype="auto"` on AVX2-only CPUs).

Both engines are loaded in one process on the same weights (the embedded
SmolLM2-135M GGUF) and run the same workloads alternately, round by round
(the machine is shared: only paired, same-run figures mean anything). Printed
per workload: the median over the rounds with the min-max spread, for each
mode, and the median of the per-round bf16/fp32 ratios.

Workloads (those of the native-precision issue): prefill of 512 and 2,048
tokens (tok/s), batch-1 decode at 256 context (tok/s), batch-32 decode (tok/s),
64 requests x 256 in / 128 out (output tok/s).

    .venv/bin/python benchmarks/native_precision.py --threads 2 --rounds 3 --json np.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

import torch

from pdserve import LLM
from pdserve.testing.agreement import ENGINE_MODES

MODES = {name: kwargs for name, (kwargs, _) in ENGINE_MODES.items()}


def _engine_bench():
    spec = importlib.util.spec_from_file_location("engine_bench", os.path.join(os.path.dirname(__file__), "engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=sorted(MODES),
        help="int8: float32 with int8 activations",
    )
    ap.add_argument("--only", nargs="*", default=[], help="workload names to run (default: all)")
    ap.add_argument("--workload-n", type=int, default=64, help="requests in the 256/128 workload")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    eb = _engine_bench()
    torch.set_num_threads(args.threads)
    # no prefix caching: every round re-runs the same prompts, which would otherwise be cache hits
    llms = {m: LLM(threads=args.threads, max_num_seqs=64, enable_prefix_caching=False, **MODES[m]) for m in args.modes}
    work = {
        "prefill_512": lambda llm: eb.ours_prefill(llm, 512),
        "prefill_2048": lambda llm: eb.ours_prefill(llm, 2048),
        "decode_b1": lambda llm: eb.ours_decode(llm, 1, 256, 48),
        "decode_b32": lambda llm: eb.ours_decode(llm, 32, 256, 16),
        f"workload_{args.workload_n}x256x128": lambda llm: eb.ours_workload(llm, args.workload_n, 256, 128),
    }
    if args.only:
        work = {k: v for k, v in work.items() if k in args.only}
    results = {"threads": args.threads, "rounds": args.rounds, "load_before": os.getloadavg()[0], "workloads": {}}
    for name, fn in work.items():
        runs: dict[str, list[float]] = {m: [] for m in llms}
        if not name.startswith("workload"):  # untimed warm-up: first-call allocations, oneDNN primitives
            for llm in llms.values():
                fn(llm)
        for r in range(args.rounds):
            order = list(llms) if r % 2 == 0 else list(llms)[::-1]  # alternate who goes first
            for m in order:
                runs[m].append(fn(llms[m]))
        row = {m: {"median": statistics.median(v), "min": min(v), "max": max(v), "all": v} for m, v in runs.items()}
        if len(llms) == 2:
            a, b = list(llms)
            row[f"ratio_{b}_over_{a}"] = statistics.median(y / x for x, y in zip(runs[a], runs[b]))
        results["workloads"][name] = row
        print(
            name,
            "  ".join(f"{m}: {row[m]['median']:.1f} [{row[m]['min']:.1f}-{row[m]['max']:.1f}]" for m in llms),
            "  ratio",
            f"{row.get(f'ratio_{list(llms)[-1]}_over_{list(llms)[0]}', 0):.2f}x",
            f"(load {os.getloadavg()[0]:.1f}, {time.strftime('%H:%M:%S')})",
            flush=True,
        )
    results["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
