"""`pdserve plan`: size a deployment and show each step as one would by hand.

Standard library only, so the command starts without torch.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve import flags
from pdserve.config import DeviceConfig
from pdserve.flags import Section
from pdserve.planner.deployment import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    ENGINES,
    LATENCY_MODELS,
    WEIGHT_QUANTS,
    Deployment,
    modelled_dtype,
)
from pdserve.planner.hardware import GPU_ALIASES, GPUS, resolve_gpu
from pdserve.planner.models import MODEL_ALIASES, MODELS, param_count, resolve_model
from pdserve.planner.plan import PlanInputs, make_plan
from pdserve.planner.transfer import link
from pdserve.planner.units import GiB, fmt_count, fmt_si
from pdserve.settings import ModelledConfig, SLOConfig

PLAN_SECTIONS = (
    Section(ModelledConfig),
    Section(DeviceConfig, only=("dtype",)),
    Section(SLOConfig, only=("slo_ttft_ms", "slo_tpot_ms")),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--list", action="store_true", help="list catalog models and GPUs, then exit")
    flags.add_arguments(parser, PLAN_SECTIONS)
    a(
        "--model",
        dest="model_config",
        action=flags.Deprecated,
        replacement="--model-config",
        help=argparse.SUPPRESS,  # `--model` is the weights to serve everywhere else
    )
    a("--decode-gpu", help="accelerator of the decode pool, if it differs (e.g. H100 prefill, H20 decode)")
    a("--context", type=int, help="tokens a request holds in KV (default: lin + lout)")
    a("--tp", type=int, default=1, help="tensor-parallel GPUs per instance")
    a("--pp", type=int, default=1, help="pipeline stages per instance")
    a("--weight-quant", choices=WEIGHT_QUANTS, default="none", help="weight storage; none = the compute dtype")
    a("--lin", type=int, help="mean prompt tokens")
    a("--lout", type=int, help="mean output tokens")
    a("--qps", type=float, help="peak requests per second (needs --lin/--lout)")
    a(
        "--link-gbps",
        "--network-gbps",
        dest="link_gbps",
        type=float,
        action="append",
        help="P->D link in Gb/s, any number, repeatable (100/200/400: measured effective "
        "rates, else 90%% of line rate); default: 100, 200 and 400",
    )
    a("--link-gbytes", type=float, action="append", help="P->D link as an effective bandwidth in GB/s, repeatable")
    a(
        "--units",
        choices=("decimal", "binary"),
        default="decimal",
        help="binary reads a link's GB/s as GiB/s, as hand calculations with KV in GiB do",
    )
    a("--nics", type=int, default=1, help="NICs one request's KV crosses in parallel")
    a("--redundancy", type=float, default=0.3, help="spare share of GPUs (0.3 = 30%%)")
    a("--decode-batch", type=int, help="decode batch; default: max concurrency, lowered to meet --slo-tpot-ms")
    a("--theta-p", type=float, help="measured prefill tokens/s per GPU, instead of the model's")
    a("--theta-d", type=float, help="measured decode tokens/s per GPU, instead of the model's")
    a(
        "--occupancy-s",
        type=float,
        help="mean seconds a request occupies a slot (GPU count by concurrency, with --qps and --concurrency-per-gpu)",
    )
    a("--concurrency-per-gpu", type=float, help="requests one GPU carries at once")
    a("--spec-k", type=int, help="speculative decoding: draft tokens per step (gamma)")
    a("--spec-acceptance", type=float, help="speculative decoding: acceptance rate (alpha)")
    a("--spec-draft-cost", type=float, default=0.0, help="one draft token's cost in target decode steps (default 0)")
    a(
        "--latency-model",
        choices=LATENCY_MODELS,
        default="fitted",
        help="fitted: profile-fitted step times (default); roofline: the lower bound",
    )
    a(
        "--engine",
        choices=ENGINES,
        default="vidur",
        help="host-side costs the fitted model adds: vidur (Vidur's CPU profile, default) or "
        "vllm-2023 (plus the per-sequence and per-prefill costs of 2023 vLLM, fitted on "
        "Splitwise's BLOOM-176B runs; measured for batches up to 64), or vllm-2023-overlap "
        "(the same runs read with the eager engine's kernel issue overlapping the GPU)",
    )
    a(
        "--gpu-memory-utilization",
        type=float,
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        help="share of GPU memory for weights + KV, as in vLLM",
    )
    a("--compute-efficiency", type=float, default=1.0, help="reached share of peak FLOP/s (roofline)")
    a("--bandwidth-efficiency", type=float, default=1.0, help="reached share of memory bandwidth (roofline)")
    a("--json", action="store_true", help="print a machine-readable dict")


def catalog() -> dict:
    """Names and headline figures of every catalog entry (for --list)."""
    return {
        "models": {
            n: {
                "layers": m.layers,
                "attention": m.attention_kind,
                "params": param_count(m),
                "max_context_tokens": m.max_context_tokens,
            }
            for n, m in MODELS.items()
        },
        "gpus": {
            n: {"bf16_flops": g.bf16_flops, "memory_bytes": g.memory_bytes, "memory_bytes_per_s": g.memory_bytes_per_s}
            for n, g in GPUS.items()
        },
        "aliases": {**MODEL_ALIASES, **GPU_ALIASES},
    }


def _print_catalog(as_json: bool) -> None:
    cat = catalog()
    if as_json:
        print(json.dumps(cat, indent=2))
        return
    print("models:")
    for n, m in cat["models"].items():
        print(
            f"  {n:<14} {m['layers']:>4} layers  {m['attention']}  "
            f"{fmt_count(m['params']):>8} params  {m['max_context_tokens']:>7,} tokens"
        )
    print("gpus (dense bf16, memory, bandwidth):")
    for n, g in cat["gpus"].items():
        print(
            f"  {n:<12} {fmt_si(g['bf16_flops'], 'FLOP/s'):>13}  "
            f"{g['memory_bytes'] / GiB:>4.0f} GiB  {fmt_si(g['memory_bytes_per_s'], 'B/s'):>9}"
        )
    print("aliases: " + ", ".join(f"{a} -> {n}" for a, n in cat["aliases"].items()))


def build_inputs(args: argparse.Namespace) -> PlanInputs:
    """PlanInputs from parsed flags; ValueError with a clear message if wrong."""
    if not args.model_config or not args.gpu:
        raise ValueError("--model-config and --gpu are required (or --list)")
    model = resolve_model(args.model_config)
    common = dict(
        model=model,
        tp=args.tp,
        pp=args.pp,
        dtype=modelled_dtype(args.dtype),
        weight_quant=args.weight_quant,
        kv_dtype=args.kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        compute_efficiency=args.compute_efficiency,
        bandwidth_efficiency=args.bandwidth_efficiency,
        latency_model=args.latency_model,
        engine=args.engine,
    )
    prefill = Deployment(gpu=resolve_gpu(args.gpu), **common)
    decode = Deployment(gpu=resolve_gpu(args.decode_gpu), **common) if args.decode_gpu else prefill
    context = args.context
    if context is None:
        if args.lin is None or args.lout is None:
            raise ValueError("give --context, or --lin and --lout")
        context = args.lin + args.lout
    ms = {k: None if getattr(args, k) is None else getattr(args, k) / 1e3 for k in ("slo_ttft_ms", "slo_tpot_ms")}
    binary = args.units == "binary"
    links = tuple(link(gbps=g, binary=binary) for g in args.link_gbps or ())
    links += tuple(link(gbytes=g, binary=binary) for g in args.link_gbytes or ())
    if not links:
        links = tuple(link(gbps=g, binary=binary) for g in (100, 200, 400))
    return PlanInputs(
        prefill,
        decode,
        context,
        lin=args.lin,
        lout=args.lout,
        qps=args.qps,
        slo_ttft_s=ms["slo_ttft_ms"],
        slo_tpot_s=ms["slo_tpot_ms"],
        links=links,
        nics=args.nics,
        redundancy=args.redundancy,
        binary_units=binary,
        decode_batch=args.decode_batch,
        theta_p=args.theta_p,
        theta_d=args.theta_d,
        occupancy_s=args.occupancy_s,
        concurrency_per_gpu=args.concurrency_per_gpu,
        spec_k=args.spec_k,
        spec_acceptance=args.spec_acceptance,
        spec_draft_cost=args.spec_draft_cost,
    )


def run(args: argparse.Namespace) -> int:
    if args.list:
        _print_catalog(args.json)
        return 0
    try:
        plan = make_plan(build_inputs(args))
    except (ValueError, OSError) as e:  # bad names, numbers or config files
        print(f"pdserve plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.render(), end="")
    return 0
