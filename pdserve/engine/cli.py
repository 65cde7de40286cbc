"""`pdserve generate`: offline generation from the command line."""

from __future__ import annotations

import json
import sys
import time

from pdserve.config import ENGINE_SECTIONS, engine_kwargs
from pdserve.flags import add_arguments as add_flags

__all__ = ["add_engine_arguments", "engine_kwargs", "add_arguments", "run"]


def add_engine_arguments(p) -> None:
    """The engine's flags, made from config.py's sections (vLLM's names)."""
    add_flags(p, ENGINE_SECTIONS)


def add_arguments(p) -> None:
    add_engine_arguments(p)
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.add_argument(
        "--lora-name", metavar="NAME", help="run the prompts with this LoRA adapter, one of the --lora-modules"
    )


def run(args) -> int:
    from pdserve import LLM, SamplingParams
    from pdserve.engine.loader import ModelLoadError
    from pdserve.engine.sampling_params import InvalidRequest

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        lora = _lora_request(args)
        llm = LLM(args.model, **engine_kwargs(args))
        t0 = time.monotonic()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, lora_request=lora)
        else:
            outs = llm.generate(args.prompt, params, lora_request=lora)
    except (ModelLoadError, InvalidRequest, ValueError) as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    elapsed = time.monotonic() - t0
    for out in outs:
        c = out.outputs[0]
        if args.json:
            print(
                json.dumps(
                    {"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                )
            )
        else:
            print(c.text)
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    if lora is not None:
        print(f"[with the LoRA adapter {lora.lora_name!r}]", file=sys.stderr)
    print(f"[{n} tokens in {elapsed:.2f}s, load {llm.engine.load_time_s:.2f}s]", file=sys.stderr)
    return 0


def _lora_request(args):
    """--lora-name: the --lora-modules adapter of that name (ValueError if none)."""
    if not args.lora_name:
        return None
    from pdserve.engine.lora import LoRARequest, parse_modules

    paths = dict(parse_modules(args.lora_modules or []))
    if args.lora_name not in paths:
        given = ", ".join(paths) or "none"
        raise ValueError(f"--lora-name {args.lora_name!r} is not one of the --lora-modules (given: {given})")
    return LoRARequest(args.lora_name, list(paths).index(args.lora_name) + 1, paths[args.lora_name])
