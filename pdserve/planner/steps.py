"""The plan's steps. Each computes with the pure functions and writes what one
writes by hand: the formula, the numbers put into it, the result."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.planner import memory as mem
from pdserve.planner.deployment import Deployment
from pdserve.planner.models import param_count
from pdserve.planner.units import KiB, fmt_bytes, fmt_count, fmt_gb, fmt_gib, fmt_si

if TYPE_CHECKING:  # plan.py imports this module
    from pdserve.planner.plan import PlanInputs


@dataclass
class Step:
    key: str
    title: str
    section: str  # the formula or idea the step applies
    lines: list[str]
    values: dict  # base units: bytes, seconds, tokens/s

    def to_dict(self) -> dict:
        return {"key": self.key, "title": self.title, "section": self.section, "lines": list(self.lines)}


def equation(lhs: str, formula: str, numbers: str, result: str) -> list[str]:
    """Three lines, as worked by hand: formula, numbers put in, result."""
    pad = " " * len(lhs)
    return [f"{lhs} = {formula}", f"{pad} = {numbers}", f"{pad} = {result}"]


def headline(inp: PlanInputs) -> str:
    p, d = inp.prefill, inp.decode
    gpu = p.gpu.name if p.gpu == d.gpu else f"{p.gpu.name} (prefill) + {d.gpu.name} (decode)"
    return (
        f"pdserve plan: {p.model.name} on {gpu}, TP={p.tp} PP={p.pp}; compute {p.dtype}, "
        f"weights {p.weight_quant if p.weight_quant != 'none' else p.dtype}, "
        f"KV {p.kv_dtype}; context {inp.context_tokens:,} tokens"
    )


def describe_inputs(inp: PlanInputs) -> dict:
    p = inp.prefill
    return {
        "model": p.model.name,
        "gpu": p.gpu.name,
        "decode_gpu": inp.decode.gpu.name,
        "tp": p.tp,
        "pp": p.pp,
        "dtype": p.dtype,
        "weight_quant": p.weight_quant,
        "kv_dtype": p.kv_dtype,
        "gpu_memory_utilization": p.gpu_memory_utilization,
        "context_tokens": inp.context_tokens,
        "lin": inp.lin,
        "lout": inp.lout,
        "qps": inp.qps,
        "slo_ttft_s": inp.slo_ttft_s,
        "slo_tpot_s": inp.slo_tpot_s,
        "links": [{"network": n, "bytes_per_s": b} for n, b in inp.links],
        "nics": inp.nics,
        "redundancy": inp.redundancy,
        "units": "binary" if inp.binary_units else "decimal",
        "decode_batch": inp.decode_batch,
        "theta_p": inp.theta_p,
        "theta_d": inp.theta_d,
        "latency_model": p.latency_model,
    }


def _gpu_line(g) -> list[str]:
    fp8 = f", {fmt_si(g.fp8_flops, 'FLOP/s')} fp8" if g.fp8_flops else ", no fp8"
    return [
        f"gpu    {g.name}: {fmt_si(g.bf16_flops, 'FLOP/s')} bf16{fp8} (dense); "
        f"{fmt_gib(g.memory_bytes)} at {fmt_si(g.memory_bytes_per_s, 'B/s')}; "
        f"intra-node {fmt_si(g.intra_node_bytes_per_s, 'B/s')}; NIC {g.nic_gbps:g} Gbps",
        f"       source: {g.source}",
    ]


def hardware_step(inp: PlanInputs, notes: list[str]) -> Step:
    m, p, d = inp.prefill.model, inp.prefill, inp.decode
    params, active = param_count(m), param_count(m, active=True)
    lines = [
        f"model  {m.name}: {m.layers} layers, hidden {m.hidden}, {m.heads} heads, "
        f"{m.kv_heads} KV heads ({m.attention_kind}), d_head {m.head_dim}, vocab {m.vocab:,}",
        f"       params {fmt_count(params)} from the shapes (published "
        f"{fmt_count(m.published_params) if m.published_params else 'n/a'}); "
        f"max context {m.max_context_tokens:,}",
    ]
    if m.is_mla:
        lines.append(
            f"       MLA: latent {m.kv_lora_rank} + RoPE key {m.qk_rope_head_dim} per "
            f"layer; per head d_qk {m.qk_dim}, d_v {m.v_dim}"
        )
    if m.is_moe:
        lines.append(
            f"       MoE: {m.routed_experts} routed + {m.shared_experts} shared experts, "
            f"{m.experts_per_token} per token, {m.dense_layers} dense layers; "
            f"{fmt_count(active)} active"
        )
    lines.append(f"       source: {m.source}")
    lines += _gpu_line(p.gpu) + (_gpu_line(d.gpu) if d.gpu != p.gpu else [])
    if m.max_context_tokens and inp.context_tokens > m.max_context_tokens:
        notes.append(f"context {inp.context_tokens:,} exceeds {m.name}'s {m.max_context_tokens:,}-token window")
    values = {
        "model": {**dataclasses.asdict(m), "params": params, "active_params": active},
        "gpu": dataclasses.asdict(p.gpu),
        "decode_gpu": dataclasses.asdict(d.gpu),
    }
    return Step("hardware", "Model and hardware", "catalog", lines, values)


def weights_step(inp: PlanInputs) -> Step:
    dep = inp.prefill
    params, bpp = param_count(dep.model), dep.weight_bytes_per_param
    total = mem.weight_bytes(params, bpp)
    per_gpu = total / dep.gpus
    lines = equation("weights", "params x bytes/param", f"{fmt_count(params)} x {bpp:g} B", fmt_bytes(total))
    lines += equation("per GPU", "weights / (TP x PP)", f"{fmt_gb(total)} / ({dep.tp} x {dep.pp})", fmt_bytes(per_gpu))
    values = {"params": params, "bytes_per_param": bpp, "weight_bytes": total, "weight_bytes_per_gpu": per_gpu}
    return Step("weights", "Weight memory", "weights = params x bytes per param", lines, values)


def kv_step(inp: PlanInputs) -> Step:
    dep, ctx = inp.prefill, inp.context_tokens
    m, b = dep.model, dep.kv_bytes_per_element
    layer = mem.kv_bytes_per_token_layer(m, b)
    token = mem.kv_bytes_per_token(m, b)
    request = token * ctx
    shards = mem.kv_shards(m, dep.tp)
    per_gpu = request / (shards * dep.pp)
    if m.is_mla:
        lines = equation(
            "KV/token/layer",
            "(d_c + d_R) x bytes",
            f"({m.kv_lora_rank} + {m.qk_rope_head_dim}) x {b:g} B",
            f"{layer:,.0f} B",
        )
        why = "the MLA latent is whole on every TP rank"
    else:
        lines = equation(
            "KV/token/layer",
            "2 (K, V) x n_kv x d_head x bytes",
            f"2 x {m.kv_heads} x {m.head_dim} x {b:g} B",
            f"{layer:,.0f} B = {layer / KiB:g} KiB",
        )
        why = f"KV heads split over min(TP={dep.tp}, n_kv={m.kv_heads})"
    lines += equation(
        "KV/token", "layers x KV/token/layer", f"{m.layers} x {layer / KiB:g} KiB", f"{token / KiB:,.2f} KiB"
    )
    lines += equation("KV/request", "context x KV/token", f"{ctx:,} x {token / KiB:,.2f} KiB", fmt_bytes(request))
    lines += equation(
        "KV/request/GPU",
        "KV/request / (shards x PP)",
        f"{fmt_gib(request)} / ({shards} x {dep.pp})",
        f"{fmt_bytes(per_gpu)}  ({why})",
    )
    values = {
        "attention": m.attention_kind,
        "bytes_per_element": b,
        "kv_bytes_per_token_layer": layer,
        "kv_bytes_per_token": token,
        "kv_bytes_per_request": request,
        "kv_shards": shards,
        "kv_bytes_per_request_per_gpu": per_gpu,
    }
    return Step("kv", "KV cache size", "KV = 2 x L x n_kv x d_head x S x bytes (MLA: latent + RoPE key)", lines, values)


def _suggestions(dep: Deployment, ctx: int) -> list[str]:
    """Single changes that make one request fit: quantize weights or KV, or add TP."""
    tries = [("--weight-quant int4", {"weight_quant": "int4"}), ("--kv-dtype fp8", {"kv_dtype": "fp8"})]
    tries += [(f"--tp {tp}", {"tp": tp}) for tp in (2, 4, 8, 16, 32, 64) if tp > dep.tp]
    out = []
    for flag, change in tries:
        n = mem.deployment_max_concurrency(dataclasses.replace(dep, **change), ctx)
        if n >= 1:
            out.append(f"{flag}: {n} requests per instance")
            if "tp" in change:
                break  # the smallest TP that fits is the useful one
    return out


def fit_step(inp: PlanInputs, notes: list[str]) -> Step:
    dep, ctx = inp.decode, inp.context_tokens
    usable = mem.usable_memory_bytes(dep.gpu.memory_bytes, dep.gpu_memory_utilization)
    weights = mem.weight_bytes_per_gpu(dep)
    free = usable - weights
    kv_req = mem.kv_bytes_per_token_per_gpu(dep) * ctx
    n = mem.max_concurrency(free, kv_req)
    lines = [f"decode instance: {dep.tp} x {dep.pp} {dep.gpu.name}"]
    lines += equation(
        "usable",
        "memory x gpu_memory_utilization",
        f"{fmt_gib(dep.gpu.memory_bytes)} x {dep.gpu_memory_utilization:g}",
        fmt_bytes(usable),
    )
    lines += equation("free for KV", "usable - weights/GPU", f"{fmt_gib(usable)} - {fmt_gib(weights)}", fmt_bytes(free))
    lines += equation(
        "max concurrency",
        "floor(free / KV per request per GPU)",
        f"floor({fmt_gib(free)} / {fmt_gib(kv_req)})",
        f"{n} requests of {ctx:,} tokens",
    )
    values = {"usable_bytes": usable, "free_bytes": free, "max_concurrency": n, "fits": n >= 1}
    if n < 1:
        fixes = _suggestions(dep, ctx)
        lines.append("DOES NOT FIT: weights and one request's KV exceed the usable memory")
        lines += [f"  try {fix}" for fix in fixes]
        values["suggestions"] = fixes
        notes.append("the model does not fit the decode instance; later steps assume batch 1")
    if inp.prefill.gpu != dep.gpu:
        p_n = mem.deployment_max_concurrency(inp.prefill, ctx)
        lines.append(f"prefill instance ({inp.prefill.gpu.name}): holds {p_n} such requests")
        values["prefill_max_concurrency"] = p_n
        if p_n < 1:
            notes.append("one request does not fit the prefill instance")
    return Step("fit", "Fit and max concurrency", "weights + KV x concurrency <= usable memory", lines, values)
