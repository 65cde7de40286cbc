"""Fitted step time: what one engine iteration costs on a real GPU.

The roofline (``roofline.py``) is a lower bound: every byte at full bandwidth,
every FLOP at peak, nothing else. Real serving adds, per layer, kernels that
reach only part of the peak plus a launch each, element-wise kernels, and two
tensor-parallel all-reduces with a latency floor; and per step, CPU work
(scheduling, sampling, input preparation, the driver-to-worker hop under TP)
that does not shrink with TP. This module prices an iteration with those
terms, their constants fitted per GPU kind on operator profiles
(``fitted.py``). The planner and the simulator both call ``step_time``.

Host and GPU overlap where the hardware lets them: kernel launches are
asynchronous, so the CPU time an eager engine spends issuing a step's kernels
(``launch_s``) runs while the GPU executes the kernels already issued. A step
costs ``overhead_s + max(GPU time, launch_s)``: the synchronous host work
(scheduling, input preparation, sampling, output processing) plus whichever of
the GPU and the launching CPU finishes last.

Standard library only: ``pdserve plan`` starts without numpy or torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.planner import fitted
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import ALLREDUCE_LATENCY_INTER_NODE_S
from pdserve.planner.memory import kv_bytes_per_token_layer, kv_shards
from pdserve.planner.models import ModelShape, param_count
from pdserve.planner.roofline import ACTIVATION_BYTES, pp_hop_time_s, weight_bytes_read


@dataclass(frozen=True)
class StepCost:
    """One iteration of one instance, split by where the time goes (seconds)."""

    gemm_s: float  # projections and MLP of every layer, plus the LM head
    attention_s: float  # prefill (FLOP-bound) and decode (KV-read-bound) attention
    elementwise_s: float  # norms, RoPE, activation, residual adds
    comm_s: float  # TP all-reduces, two per layer
    overhead_s: float  # synchronous host work: schedule, sample, prepare, TP hop, a prefill's extra
    pp_s: float = 0.0  # activations handed between pipeline stages
    launch_s: float = 0.0  # host time issuing the kernels, overlapping the GPU (eager engines only)

    @property
    def gpu_s(self) -> float:
        return self.gemm_s + self.attention_s + self.elementwise_s + self.comm_s

    @property
    def total_s(self) -> float:
        return self.overhead_s + max(self.gpu_s, self.launch_s) + self.pp_s

    def to_dict(self) -> dict:
        return {**asdict(self), "gpu_s": self.gpu_s, "total_s": self.total_s}


def fit_for(gpu_name: str) -> tuple[str, dict]:
    """(GPU kind, its fitted constants). Kinds without profiles borrow the
    nearest profiled one's efficiencies, applied to their own peaks."""
    kind = fitted.GPU_KIND.get(gpu_name, fitted.DEFAULT_KIND)
    return kind, fitted.FITS[kind]


def is_profiled(gpu_name: str) -> bool:
    """The GPU kind itself was profiled (else its constants are borrowed)."""
    return gpu_name in fitted.GPU_KIND


def has_fit(gpu_name: str) -> bool:
    """False for accelerators the fitted model does not describe at all (the
    CPU 'GPU' of this machine): the plan uses the roofline there."""
    return gpu_name not in fitted.NO_FIT


def _gemm_shapes(m: ModelShape, tp: int) -> list[tuple[int, int]] | None:
    """(k, n) of one layer's GEMMs on one TP rank, for dense GQA/MHA models."""
    if m.is_moe or m.is_mla:
        return None
    d = m.head_dim
    return [
        (m.hidden, (m.heads + 2 * m.kv_heads) * d // tp),
        (m.heads * d // tp, m.hidden),
        (m.hidden, 2 * m.intermediate // tp),
        (m.intermediate // tp, m.hidden),
    ]


def _gemm_s(fit: dict, peak: float, bw: float, flops: float, bytes_: float) -> float:
    g = fit["gemm"]
    return g["launch_s"] + max(flops / (g["compute_eff"] * peak), bytes_ / (g["bandwidth_eff"] * bw))


def _layer_gemm_s(dep: Deployment, fit: dict, tokens: int) -> float:
    m, peak, bw = dep.model, dep.gpu.peak_flops(dep.dtype), dep.gpu.memory_bytes_per_s
    wb = dep.weight_bytes_per_param
    shapes = _gemm_shapes(m, dep.tp)
    if shapes is not None:
        return sum(
            _gemm_s(fit, peak, bw, 2.0 * tokens * k * n, wb * k * n + ACTIVATION_BYTES * tokens * (k + n))
            for k, n in shapes
        )
    # MoE / MLA: one layer's share of the weights read and of the active FLOPs,
    # priced as four GEMMs' worth of launches.
    embed = m.vocab * m.hidden * (1 if m.tied_embeddings else 2)
    weights = (weight_bytes_read(m, tokens, wb) - embed * wb) / m.layers / dep.tp
    flops = 2.0 * (param_count(m, active=True) - embed) * tokens / m.layers / dep.tp
    acts = ACTIVATION_BYTES * tokens * m.hidden * 8
    return 3 * fit["gemm"]["launch_s"] + _gemm_s(fit, peak, bw, flops, weights + acts)


def _allreduce_s(dep: Deployment, fit: dict, message_bytes: float) -> float:
    if dep.tp <= 1:
        return 0.0
    if dep.tp > dep.gpu.gpus_per_node:  # across nodes: the NIC, at its line rate
        return ALLREDUCE_LATENCY_INTER_NODE_S + 2.0 * message_bytes / (dep.gpu.nic_gbps * 1e9 / 8)
    ar = fit["allreduce"]
    # TP sizes the profiles lack take the next larger profiled group (4 for 3, 8 beyond)
    key = min((n for n in ar if n >= dep.tp), default=max(ar))
    scale = dep.gpu.intra_node_bytes_per_s / fitted.FABRIC_BYTES_PER_S[fit_for(dep.gpu.name)[0]]
    return ar[key]["latency_s"] + message_bytes / (ar[key]["bytes_per_s"] * scale)


def _cpu_s(dep: Deployment, fit: dict, seqs: int) -> float:
    cpu = fit["cpu"]
    known = sorted(cpu)
    if dep.tp > known[-1]:
        # beyond the profiles: the driver-to-worker cost grows linearly with TP,
        # as it does between the two largest profiled sizes
        (t0, c0), (t1, c1) = (known[-2], cpu[known[-2]]), (known[-1], cpu[known[-1]])
        fixed = c1["fixed_s"] + (dep.tp - t1) * (c1["fixed_s"] - c0["fixed_s"]) / (t1 - t0)
        return fixed + c1["per_seq_s"] * seqs
    c = cpu[min(t for t in known if t >= dep.tp)]
    return c["fixed_s"] + c["per_seq_s"] * seqs


def _engine_s(dep: Deployment, kind: str, seqs: int, prefills: bool) -> tuple[float, float]:
    """(synchronous, overlapping) host seconds the serving engine adds beyond the
    CPU terms above (fitted.ENGINES): per step, per sequence and per prefilling
    step, plus, for an engine read as issuing kernels eagerly, the issue window."""
    e = fitted.ENGINES[dep.engine].get(kind)
    if not e:
        return 0.0, 0.0
    sync = e.get("fixed_s", 0.0) + e["per_seq_s"] * seqs + (e["prefill_fixed_s"] if prefills else 0.0)
    return sync, e.get("launch_per_layer_s", 0.0) * dep.model.layers


def _prefill_attention_s(dep: Deployment, a: dict, tokens: int, causal_pairs: float, cached_pairs: float) -> float:
    """One layer's prefill attention: a launch, per-query work, and the query-key
    pairs within the new tokens (causal, half their tiles masked) and against
    cached tokens (dense), each at its own share of peak."""
    m, peak = dep.model, dep.gpu.peak_flops(dep.dtype)
    heads = m.heads / dep.tp
    per_pair = 2.0 * heads * (m.qk_dim + m.v_dim) / peak
    return (
        a["fixed_s"]
        + a["per_token_head_s"] * tokens * heads
        + per_pair * (causal_pairs / a["causal_eff"] + cached_pairs / a["cached_eff"])
    )


def step_time(
    dep: Deployment,
    prefill_tokens: int = 0,
    prefill_pairs: float = 0.0,
    decode_seqs: int = 0,
    decode_context: float = 0.0,
    prefill_seqs: int = 0,
    prefill_context: float = 0.0,
    prefill_cached_pairs: float = 0.0,
) -> StepCost:
    """One iteration over ``prefill_tokens`` prompt tokens (``prefill_pairs``
    causal query-key pairs, of them ``prefill_cached_pairs`` against the
    ``prefill_context`` cached tokens read) and ``decode_seqs`` decoding
    sequences holding ``decode_context`` tokens in all."""
    tokens = prefill_tokens + decode_seqs
    if tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
    m = dep.model
    kind, fit = fit_for(dep.gpu.name)
    peak, bw = dep.gpu.peak_flops(dep.dtype), dep.gpu.memory_bytes_per_s
    gemm = m.layers * _layer_gemm_s(dep, fit, tokens)
    # the LM head runs on the last position of each sequence only
    seqs = max(1, prefill_seqs + decode_seqs if prefill_tokens else decode_seqs)
    head = m.vocab * m.hidden // dep.tp
    gemm += _gemm_s(
        fit, peak, bw, 2.0 * seqs * head, dep.weight_bytes_per_param * head + ACTIVATION_BYTES * seqs * m.hidden
    )
    a = fit["attention"]
    attn = 0.0
    if prefill_tokens:
        cached = min(prefill_cached_pairs, prefill_pairs)
        attn += _prefill_attention_s(dep, a["prefill"], prefill_tokens, prefill_pairs - cached, cached)
    kv_read = decode_context + prefill_context
    if decode_seqs or kv_read:
        kv = kv_bytes_per_token_layer(m, dep.kv_bytes_per_element) / kv_shards(m, dep.tp)
        attn += a["decode"]["fixed_s"] + kv * kv_read / (a["decode"]["eff"] * bw)
    e = fit["elementwise"]
    elem = e["fixed_s"] + e["bytes_per_token_hidden"] * tokens * m.hidden / bw
    comm = 2 * _allreduce_s(dep, fit, tokens * m.hidden * ACTIVATION_BYTES)
    sync, launch = _engine_s(dep, kind, prefill_seqs + decode_seqs, prefill_tokens > 0)
    host = _cpu_s(dep, fit, prefill_seqs + decode_seqs) + sync
    return StepCost(gemm, m.layers * attn, m.layers * elem, m.layers * comm, host, pp_hop_time_s(dep, tokens), launch)


@dataclass(frozen=True)
class AttentionRates:
    """The parts of ``step_time`` that grow with context, over all layers (seconds)."""

    causal_pair_s: float  # per query-key pair among a chunk's new tokens
    cached_pair_s: float  # per query-key pair against a cached token
    kv_token_s: float  # per cached token read
    kv_fixed_s: float  # one KV-read kernel


def attention_rates(dep: Deployment) -> AttentionRates:
    """Per-unit attention costs, so a caller can add them to a memoised step (the simulator)."""
    m = dep.model
    a = fit_for(dep.gpu.name)[1]["attention"]
    peak, bw = dep.gpu.peak_flops(dep.dtype), dep.gpu.memory_bytes_per_s
    pair = m.layers * 2.0 * m.heads * (m.qk_dim + m.v_dim) / dep.tp / peak
    kv = kv_bytes_per_token_layer(m, dep.kv_bytes_per_element) / kv_shards(m, dep.tp)
    return AttentionRates(
        pair / a["prefill"]["causal_eff"],
        pair / a["prefill"]["cached_eff"],
        m.layers * kv / (a["decode"]["eff"] * bw),
        m.layers * a["decode"]["fixed_s"],
    )


def prefill_cost(dep: Deployment, tokens: int) -> StepCost:
    """One ``tokens``-long prompt, alone in its step."""
    return step_time(dep, prefill_tokens=tokens, prefill_pairs=tokens * (tokens + 1) / 2.0, prefill_seqs=1)


def decode_cost(dep: Deployment, batch: int, context_tokens: int) -> StepCost:
    """One decode step of ``batch`` sequences of ``context_tokens`` each."""
    return step_time(dep, decode_seqs=batch, decode_context=float(batch * context_tokens))
