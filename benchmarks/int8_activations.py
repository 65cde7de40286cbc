"""The opt-in int8-activation kernels: decode speed and agreement with the fp32 default.

Speed: decode tokens/s at several batch sizes, fp32 GGUF kernels vs
`int8_activations=True`, the two engines alternating round by round in one run
(the machine is shared; only same-run ratios mean anything).

Agreement: each prompt is decoded greedily with int8 activations; at every step
the fp32 engine, given the same history (prompt + the int8 engine's tokens so
far, prefilled on the exact fp32 path), names its own greedy token. Reported:
the share of steps where the two pick the same token (top-1 agreement), where
the int8 and fp32 greedy sequences first part, and, at the disagreements, how
far apart the two tokens are in the fp32 model's log-probabilities (near-ties
or real errors).

    .venv/bin/python benchmarks/int8_activations.py --threads 2
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics

import torch

from pdserve import LLM, SamplingParams

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning' into French, German and Spanish.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give me a recipe for pancakes.",
    "Summarise the plot of Romeo and Juliet in three sentences.",
]


def _engine_bench():
    spec = importlib.util.spec_from_file_location("engine_bench", os.path.join(os.path.dirname(__file__), "engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def speed(threads: int, batches: list[int], rounds: int, steps: int) -> None:
    decode = _engine_bench().ours_decode
    llms = {
        mode: LLM(dtype="float32", threads=threads, max_num_seqs=64, int8_activations=(mode == "int8"))
        for mode in ("fp32", "int8")
    }
    for b in batches:
        runs: dict[str, list[float]] = {"fp32": [], "int8": []}
        for _ in range(rounds):
            for mode, llm in llms.items():
                runs[mode].append(decode(llm, b, 256, steps))
        f, i = max(runs["fp32"]), max(runs["int8"])
        print(
            f"decode batch {b:2d}: fp32 {f:7.1f} tok/s   int8 {i:7.1f} tok/s   ratio {i / f:5.2f}x   "
            f"(best of {rounds}; all fp32 {[round(v) for v in runs['fp32']]}, int8 {[round(v) for v in runs['int8']]})",
            flush=True,
        )


def agreement(threads: int, max_tokens: int) -> None:
    fp32 = LLM(dtype="float32", threads=threads)
    int8 = LLM(dtype="float32", threads=threads, int8_activations=True)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    same = total = 0
    first_split, gaps = [], []
    for text in PROMPTS:
        tok = fp32.get_tokenizer()
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        ref = fp32.generate([ids], greedy)[0].outputs[0].token_ids
        got = int8.generate([ids], greedy)[0].outputs[0].token_ids
        first_split.append(next((t for t, (a, b) in enumerate(zip(ref, got)) if a != b), len(ref)))
        one = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
        for t in range(len(got)):
            out = fp32.generate([ids + got[:t]], one)[0].outputs[0]
            total += 1
            if out.token_ids[0] == got[t]:
                same += 1
                continue
            lp = {tok: x.logprob for tok, x in out.logprobs[0].items()}
            gaps.append(lp[out.token_ids[0]] - lp.get(got[t], min(lp.values())))
    print(
        f"top-1 agreement along the int8 path: {same}/{total} = {same / total:.1%} "
        f"({len(PROMPTS)} chat prompts x {max_tokens} tokens)"
    )
    print(f"greedy sequences first differ at token: {first_split} (median {statistics.median(first_split)})")
    if gaps:
        print(
            f"at the {len(gaps)} disagreements, fp32 log-prob of its token minus int8's token: "
            f"median {statistics.median(gaps):.3f}, max {max(gaps):.3f} (a gap of 0.1 is a 10% probability ratio)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48, help="decoded tokens per prompt in the agreement test")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-agreement", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"load average before: {os.getloadavg()[0]:.2f}; cpu capability "
        f"{torch.backends.cpu.get_cpu_capability()}; threads {args.threads}",
        flush=True,
    )
    if not args.skip_speed:
        speed(args.threads, args.batches, args.rounds, args.steps)
    if not args.skip_agreement:
        agreement(args.threads, args.max_tokens)
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
