"""`pdserve generate`: offline generation from the command line."""

from __future__ import annotations

import json
import sys
import time


def add_engine_arguments(p) -> None:
    """Engine flags, named as vLLM names them."""
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (0: torch default)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks", type=int, default=None, help="KV blocks (default: from --kv-cache-memory-bytes)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=_BoolAction, default=True)
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="largest prompt chunk per step with chunked prefill (0: the whole budget)",
    )
    p.add_argument("--enable-prefix-caching", action=_BoolAction, default=True)
    p.add_argument("--scheduling-policy", dest="policy", default="fcfs", choices=["fcfs", "priority"])
    p.add_argument(
        "--kv-transfer-headroom",
        type=float,
        default=0.05,
        help="share of the KV pool that admitting P->D transfers leaves to the running sequences",
    )
    g = p.add_argument_group("KV tiers below the pool (pdserve/kvstore)")
    g.add_argument(
        "--kv-offload-bytes", type=int, default=0, help="host memory for blocks evicted from the pool (L2; 0: none)"
    )
    g.add_argument(
        "--kv-disk-dir", default="", help="directory for blocks the host tier drops (L3; kept across restarts)"
    )
    g.add_argument("--kv-disk-bytes", type=int, default=4 << 30, help="bound on --kv-disk-dir")
    g.add_argument(
        "--kv-store",
        default="",
        choices=["", "mooncake"],
        help="shared tier every worker can load from: Mooncake Store",
    )
    g.add_argument(
        "--kv-store-master",
        default="",
        metavar="HOST:PORT",
        help="the Mooncake master to join (serve starts one on loopback when not given)",
    )
    g.add_argument(
        "--kv-store-metadata-url", default="", help="its metadata server (default http://<master host>:8080/metadata)"
    )
    g.add_argument(
        "--kv-store-segment-bytes", type=int, default=256 << 20, help="memory this worker lends to the shared store"
    )
    p.add_argument(
        "--int8-activations",
        action=_BoolAction,
        default=None,
        help="products on GGUF blocks round activations to int8 per 32 values (faster prefill and decode "
        "on CPUs without native bf16; not token-identical to exact fp32). Default: on under --dtype auto "
        "on an AVX2 CPU where auto resolves to float32, else off",
    )


TIER_FLAGS = (
    "kv_offload_bytes",
    "kv_disk_dir",
    "kv_disk_bytes",
    "kv_store",
    "kv_store_master",
    "kv_store_metadata_url",
    "kv_store_segment_bytes",
)


def engine_kwargs(args) -> dict:
    names = (
        "dtype",
        "device",
        "threads",
        "block_size",
        "num_gpu_blocks",
        "kv_cache_memory_bytes",
        "max_num_batched_tokens",
        "max_num_seqs",
        "max_model_len",
        "enable_chunked_prefill",
        "long_prefill_token_threshold",
        "enable_prefix_caching",
        "policy",
        "int8_activations",
        "kv_transfer_headroom",
    ) + TIER_FLAGS
    return {n: getattr(args, n) for n in names}


class _BoolAction:
    """--flag / --no-flag pairs, as vLLM spells them."""

    def __new__(cls, *a, **kw):
        import argparse

        return argparse.BooleanOptionalAction(*a, **kw)


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


def run(args) -> int:
    from pdserve import LLM, SamplingParams
    from pdserve.engine.loader import ModelLoadError
    from pdserve.engine.sampling_params import InvalidRequest

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        llm = LLM(args.model, **engine_kwargs(args))
        t0 = time.monotonic()
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outs = llm.generate(args.prompt, params)
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
    print(f"[{n} tokens in {elapsed:.2f}s, load {llm.engine.load_time_s:.2f}s]", file=sys.stderr)
    return 0
