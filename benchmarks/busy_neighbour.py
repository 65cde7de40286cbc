"""Decode steps with a busy neighbour: how much slower an unpinned engine decodes while another
process holds a core, against the same engine with the machine quiet, in the same run.

SmolLM2-135M-Instruct as a Hugging Face directory (the embedded model converted; `--model` for
another), the offline engine, unpinned, prefix caching off. One step's time is (time of N + 1
tokens - time of 1 token) / N after a warm-up, for fp32 and bf16 at batch 1 and 4. A round
measures every case quiet, then with `python -c "while True: pass"` running beside it; printed
per case: the median busy / quiet ratio of the paired rounds with its min-max, and the median
ms of each.

    .venv/bin/python benchmarks/busy_neighbour.py --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tempfile
import time

from pdserve import LLM, SamplingParams
from pdserve.config import cpu_description

CASES = [("float32", 1), ("float32", 4), ("bfloat16", 1), ("bfloat16", 4)]


def step_ms(llm: LLM, batch: int, tokens: int) -> float:
    prompt = [random.Random(0).randrange(2, 500) for _ in range(16)]

    def run(n: int) -> float:
        q = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        t = time.perf_counter()
        llm.generate([prompt] * batch, q)
        return time.perf_counter() - t

    run(2)
    one = run(1)
    return (run(tokens + 1) - one) / tokens * 1e3


def measure(engines: dict, tokens: int) -> dict:
    return {(d, b): step_ms(engines[d], b, tokens) for d, b in CASES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face directory (default: the embedded model, converted)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per measurement")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from pdserve.engine.convert import convert

            model = convert(None, tmp + "/hf")
        engines = {d: LLM(model, dtype=d, device="cpu", enable_prefix_caching=False) for d in ("float32", "bfloat16")}
        quiet, busy = [], []
        for r in range(args.rounds):
            quiet.append(measure(engines, args.tokens))
            neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            try:
                time.sleep(0.5)
                busy.append(measure(engines, args.tokens))
            finally:
                neighbour.kill()
                neighbour.wait()
            print(f"round {r + 1}: " + " | ".join(f"{d} b{b} {quiet[-1][d, b]:.1f} / {busy[-1][d, b]:.1f} ms"
                                                  for d, b in CASES), flush=True)  # fmt: skip
        for e in engines.values():
            e.close()
    print(f"CPU: {cpu_description()}; {args.rounds} paired rounds, {args.tokens} steps each")
    for d, b in CASES:
        ratios = [bz[d, b] / q[d, b] for q, bz in zip(quiet, busy)]
        print(
            f"{d:8s} batch {b}: busy / quiet {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
            f"  (quiet {statistics.median(q[d, b] for q in quiet):.1f} ms, busy "
            f"{statistics.median(x[d, b] for x in busy):.1f} ms per step)"
        )


if __name__ == "__main__":
    main()
