"""What speculative decoding by prompt lookup gains, and costs, on the embedded model.

    python benchmarks/spec_decode.py [--rounds 3] [--tokens 160] [--k 4] [--temperature 0]

Two engines side by side (same weights, same settings), one with
`speculative_config={"method": "ngram", "num_speculative_tokens": k}` (n-grams of 5 tokens, vLLM's
default; `--lookup MIN MAX` to change); each round runs both on two workloads:

- copy: the answer repeats much of the prompt (repeat, fix typos, edit code, reformat);
- chat: open questions, whose answers the prompt does not contain.

For each: batch 1 (the requests one after another; decode tokens per second, first token to
last) and all the workload's requests at once, twice over (output tokens per second of wall
time). Prints the median ratio (drafts / no drafts) of each with its spread over the rounds,
the drafts' acceptance, and how many outputs are token-identical to the engine without drafts
(greedy in float32 they all are; in bfloat16 a pass of several rows runs other kernels than a
one-token decode, so a near tie may fall the other way: for scale, the engine without drafts is
compared with itself at batch 1 and batch 8, which differ the same way).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve import LLM, SamplingParams  # noqa: E402
from pdserve.config import cpu_description  # noqa: E402

NOTE = (
    "Our team met on Monday to plan the move to the new office. We agreed that the servers go first, "
    "on the weekend, so that nobody loses a working day; the desks, the kitchen and the meeting rooms "
    "follow during the week after. Anna will book the trucks, Ben will label every box with its room, "
    "and Carla will tell the building manager which doors must stay open on Saturday morning."
)
TYPOS = NOTE.replace("agreed", "agred").replace("servers", "severs").replace("building", "buildng")
CODE = """def total_price(items, tax):
    x = 0
    for item in items:
        x = x + item["price"] * item["quantity"]
    if x > 100:
        x = x * 0.95
    return x * (1 + tax)
"""
LIST = "- apples: 3, red\n- pears: 5, green\n- plums: 12, purple\n- lemons: 2, yellow\n- grapes: 40, green"
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{NOTE}",
    f"Fix the spelling mistakes in this text and return the whole corrected text:\n\n{TYPOS}",
    f"Rename the variable x to subtotal in this Python function and return the whole function:\n\n{CODE}",
    f"Rewrite this list as a JSON array of objects with the keys name, count and colour:\n\n{LIST}",
]
CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me five ideas for a weekend trip in the mountains, with one sentence each.",
    "What are the pros and cons of working from home?",
]


def run(llm: LLM, prompts: list[str], params: SamplingParams, together: bool):
    """(output tokens per second, outputs): decode rate for one at a time, wall rate together."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    if together:
        t0 = time.perf_counter()
        outs = llm.chat(chats * 2, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0), outs
    outs, tokens, seconds = [], 0, 0.0
    for c in chats:
        o = llm.chat(c, params, use_tqdm=False)[0]
        m = o.metrics
        tokens += len(o.outputs[0].token_ids) - 1
        seconds += m["last_token_time"] - m["first_token_time"]
        outs.append(o)
    return tokens / seconds, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=160)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--lookup",
        type=int,
        nargs=2,
        default=[5, 5],
        metavar=("MIN", "MAX"),
        help="n-gram lengths (vLLM's default 5 5)",
    )
    ap.add_argument("--workloads", nargs="+", default=["copy", "chat"], choices=["copy", "chat"])
    args = ap.parse_args(argv)
    lo, hi = args.lookup
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": hi, "prompt_lookup_min": lo}
    plain = LLM(dtype=args.dtype)
    spec = LLM(dtype=args.dtype, speculative_config=spec_cfg)
    params = SamplingParams(temperature=args.temperature, seed=0, max_tokens=args.tokens)
    print(f"CPU: {cpu_description()}; dtype {plain.engine.config.device.dtype}; {spec_cfg}; {params.temperature=}")
    for llm in (plain, spec):  # warm: kernels, the prefix cache of every prompt
        for prompts in (COPY, CHAT):
            run(llm, prompts, SamplingParams(temperature=0, max_tokens=4), True)
    for name, prompts in (("copy", COPY), ("chat", CHAT)):
        if name not in args.workloads:
            continue
        alone = None
        for together in (False, True):
            ratios, rates, same, total = [], [], 0, 0
            s0 = dict(spec.engine.stats())
            for r in range(args.rounds):
                order = (plain, spec) if r % 2 == 0 else (spec, plain)
                got = {id(llm): run(llm, prompts, params, together) for llm in order}
                (a, outs_a), (b, outs_b) = got[id(plain)], got[id(spec)]
                ratios.append(b / a)
                rates.append((a, b))
                same += sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(outs_a, outs_b))
                total += len(outs_a)
                if not together:
                    alone = outs_a
                elif alone is not None:
                    ref_same = sum(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(alone, outs_a))
            s1 = spec.engine.stats()
            drafts = s1["spec_decode_num_drafts"] - s0["spec_decode_num_drafts"]
            acc = s1["spec_decode_num_accepted_tokens"] - s0["spec_decode_num_accepted_tokens"]
            dtok = s1["spec_decode_num_draft_tokens"] - s0["spec_decode_num_draft_tokens"]
            how = f"batch {2 * len(prompts)} (wall)" if together else "batch 1 (decode)"
            print(
                f"{name:5s} {how:17s} tok/s plain {statistics.median(a for a, _ in rates):6.1f} "
                f"spec {statistics.median(b for _, b in rates):6.1f}  ratio median {statistics.median(ratios):.2f} "
                f"[{min(ratios):.2f}-{max(ratios):.2f}]  accepted {acc}/{dtok} drafted tokens "
                f"({acc / max(1, dtok):.0%}), {1 + acc / max(1, drafts):.2f} tokens per drafted step; "
                f"identical outputs {same}/{total}"
                + (f" (no drafts, batch 1 vs batch 8: {ref_same}/{len(prompts)})" if together and alone else "")
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
