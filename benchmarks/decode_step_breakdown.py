"""Where a decode step's time goes, by batch size, in one run.

Runs `LLM.generate` with `--batch` rows of 32-token prompts for 64 output tokens
each and wraps the engine's step, the model runner, the output head and the
sampler with timers; prints ms per step of each and output tokens/s. With the
default (temperature 1) sampling the sampler's own share shows; `--greedy` for argmax.

    flock /tmp/pdserve-measure.lock .venv/bin/python benchmarks/decode_step_breakdown.py --threads 1 --batch 1 8 16
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from pdserve import LLM, SamplingParams

STEPS = 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--int8-activations", action="store_true", help="the opt-in int8 GGUF kernels")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(max_num_seqs=max(args.batch), int8_activations=args.int8_activations or None)
    eng = llm.llm_engine if hasattr(llm, "llm_engine") else llm.engine
    acc: dict[str, float] = {}

    def timed(obj, name: str, key: str) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, wrapper)

    timed(eng, "step", "step")
    timed(eng.runner, "execute", "model")
    timed(eng.runner.model.lm_head, "forward", "head")
    timed(type(eng.sampler), "__call__", "sampler")
    temperature = 0.0 if args.greedy else 1.0
    for b in args.batch:
        rows = [[100 + i] * 32 for i in range(b)]
        llm.generate(rows, SamplingParams(max_tokens=4, ignore_eos=True, temperature=temperature))
        acc.clear()
        t = time.perf_counter()
        llm.generate(rows, SamplingParams(max_tokens=STEPS, ignore_eos=True, temperature=temperature))
        dt = time.perf_counter() - t
        parts = "  ".join(f"{k} {v * 1e3 / STEPS:6.2f}" for k, v in acc.items())
        print(f"batch {b:3d}: {b * STEPS / dt:6.1f} tok/s; ms per step: {parts}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
