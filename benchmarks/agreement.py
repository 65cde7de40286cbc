"""Agreement of pdserve's numeric modes with `transformers` in the same dtype.

For every mode that is not token-identical to the exact float32 default, the
engine decodes the parity prompts (tests/engine/test_parity_hf.py: 4 short, and
120 / 400 / 900 / 1,500 tokens) greedily, and transformers, in the mode's
dtype, reads each prompt + the engine's tokens and names its own greedy token at
every step (teacher-forced; `pdserve/testing/agreement.py`). Printed per mode:
top-1 agreement, the mean log-probability gap, and at the disagreements the
median and largest gap (near-ties or real errors). For scale, the same is printed
for transformers bf16 against transformers fp32 (what bf16 itself costs).

    .venv/bin/python benchmarks/agreement.py --threads 2 --tokens 32 --json agreement.json
"""

from __future__ import annotations

import argparse
import json

import torch

from pdserve import LLM
from pdserve.engine.loader import default_model_path
from pdserve.testing.agreement import ENGINE_MODES, engine_outputs, load_reference, measure, parity_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["bfloat16", "float32"],
        choices=sorted(ENGINE_MODES),
        help="engine modes to measure (float32 is the exact baseline: expect 100%%; int8: fp32 with int8 activations)",
    )
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    path = default_model_path()
    refs = {dt: load_reference(path, getattr(torch, dt)) for dt in ("float32", "bfloat16")}
    results = {}
    prompts = None
    for mode in args.modes:
        kwargs, same_dtype = ENGINE_MODES[mode]
        llm = LLM(threads=args.threads, block_size=16, max_num_batched_tokens=2048, **kwargs)
        prompts = prompts or parity_prompts(llm.tokenizer)
        outs = engine_outputs(llm, prompts, args.tokens)
        for ref_dtype in sorted({same_dtype, "float32"}):
            r = measure(refs[ref_dtype], prompts, outs).summary()
            results[f"pdserve {mode} vs transformers {ref_dtype}"] = r
            print(f"pdserve {mode:8s} vs transformers {ref_dtype:8s}: {r}", flush=True)
        del llm
    # what bf16 costs transformers itself: its bf16 greedy tokens, judged by its fp32 model
    with torch.no_grad():
        outs = []
        for p in prompts:
            ids = torch.tensor([p])
            g = refs["bfloat16"].generate(
                ids,
                max_new_tokens=args.tokens,
                do_sample=False,
                attention_mask=torch.ones_like(ids),
                pad_token_id=2,
                eos_token_id=None,
            )
            outs.append(g[0, len(p) :].tolist())
    r = measure(refs["float32"], prompts, outs).summary()
    results["transformers bfloat16 vs transformers float32"] = r
    print(f"transformers bfloat16 vs transformers float32: {r}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
