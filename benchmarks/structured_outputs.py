"""What a structured output costs per token: the embedded model decoding free text against the
same requests held to a JSON schema (a token mask from the grammar before every sampling step).

    python benchmarks/structured_outputs.py [--rounds 3] [--tokens 96] [--batch 1 8]

Paired rounds (free, then constrained, on the same warm engine); prints the median time per
output token of each and their ratio with its spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdserve import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 400},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "year", "tags"],
}
PROMPT = [{"role": "user", "content": "Describe a film you like as JSON with a long title, its year and tags."}]


def per_token_ms(llm: LLM, batch: int, params: SamplingParams) -> float:
    t0 = time.perf_counter()
    outs = llm.chat([PROMPT] * batch, params, use_tqdm=False)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return (time.perf_counter() - t0) * 1000 / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    args = ap.parse_args(argv)
    llm = LLM()
    free = SamplingParams(temperature=0.8, seed=0, max_tokens=args.tokens, ignore_eos=True)
    held = SamplingParams(
        temperature=0.8, seed=0, max_tokens=args.tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    per_token_ms(llm, 1, held)  # warm: the tokenizer read into the grammar library, kernels
    for batch in args.batch:
        ratios, f_ms, h_ms = [], [], []
        for _ in range(args.rounds):
            f = per_token_ms(llm, batch, free)
            h = per_token_ms(llm, batch, held)
            f_ms.append(f)
            h_ms.append(h)
            ratios.append(h / f)
        print(
            f"batch {batch}: free {statistics.median(f_ms):.2f} ms/token, json schema "
            f"{statistics.median(h_ms):.2f} ms/token: x{statistics.median(ratios):.3f} "
            f"(rounds {min(ratios):.3f}-{max(ratios):.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
