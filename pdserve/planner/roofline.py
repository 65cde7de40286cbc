"""Roofline time of one prefill or decode iteration, with TP and PP costs.

time = max(FLOPs / peak, bytes / bandwidth) + TP all-reduces + PP hops.
Compute and memory traffic overlap inside a kernel, so they take a max;
the collectives wait on both and are added, as a hand count of the all-reduces adds them.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import (
    ALLREDUCE_LATENCY_INTER_NODE_S,
    ALLREDUCE_LATENCY_INTRA_NODE_S,
)
from pdserve.planner.memory import kv_bytes_per_token, kv_shards
from pdserve.planner.models import ModelShape, param_count

ACTIVATION_BYTES = 2  # activations cross the wire in bf16 even with fp8 GEMMs


def ridge_point(peak_flops: float, bytes_per_s: float) -> float:
    """FLOP/byte where a kernel turns compute-bound (H100: 989e12 / 3.35e12 ≈ 295)."""
    return peak_flops / bytes_per_s


def arithmetic_intensity(flops: float, bytes_: float) -> float:
    return flops / bytes_


def roofline_time_s(flops: float, bytes_: float, peak_flops: float, bytes_per_s: float) -> float:
    return max(flops / peak_flops, bytes_ / bytes_per_s)


def matmul_flops(m: int, k: int, n: int) -> float:
    """[m, k] x [k, n]: one multiply and one add each (S x d by d x d: 2 x S x d^2)."""
    return 2.0 * m * k * n


def prefill_flops(model: ModelShape, tokens: int) -> float:
    """2 x N_active per token plus causal attention: QK^T and
    AV over half the S x S square, per head and layer."""
    linear = 2.0 * param_count(model, active=True) * tokens
    attention = model.layers * model.heads * (model.qk_dim + model.v_dim) * tokens**2
    return linear + attention


def decode_flops(model: ModelShape, batch: int, context_tokens: int) -> float:
    """One new token per sequence: 2 x N_active, plus attention over its context."""
    linear = 2.0 * param_count(model, active=True) * batch
    attention = 2.0 * model.layers * model.heads * (model.qk_dim + model.v_dim)
    return linear + attention * context_tokens * batch


def weight_bytes_read(model: ModelShape, tokens: int, bytes_per_param: float) -> float:
    """Weights streamed from memory by one iteration over ``tokens`` tokens.

    Dense models read everything. An MoE layer reads only the experts some
    token was routed to: with uniform routing of k of E experts, a batch of
    T tokens touches E x (1 - (1 - k/E)^T) of them in expectation.
    """
    total = param_count(model)
    if not model.is_moe:
        return total * bytes_per_param
    E, k = model.routed_experts, model.experts_per_token
    touched = E * (1.0 - (1.0 - k / E) ** tokens)
    expert = 3 * model.hidden * model.moe_intermediate
    moe_layers = model.layers - model.dense_layers
    untouched = moe_layers * (E - touched) * expert
    return (total - untouched) * bytes_per_param


def allreduce_time_s(tp: int, message_bytes: float, latency_s: float, link_bytes_per_s: float) -> float:
    """Ring all-reduce: a latency floor plus 2 (n-1)/n of the message per link."""
    if tp <= 1:
        return 0.0
    return latency_s + 2.0 * (tp - 1) / tp * message_bytes / link_bytes_per_s


def _link(dep: Deployment, gpus: int) -> tuple[float, float]:
    """(latency, bytes/s one way) of the link between ``gpus`` accelerators."""
    if gpus <= dep.gpu.gpus_per_node:
        return ALLREDUCE_LATENCY_INTRA_NODE_S, dep.gpu.intra_node_bytes_per_s / 2
    return ALLREDUCE_LATENCY_INTER_NODE_S, dep.gpu.nic_gbps * 1e9 / 8


def tp_comm_time_s(dep: Deployment, tokens: int) -> float:
    """2 all-reduces per layer (attention output and MLP down projection,
    80 layers -> 160), each over tokens x hidden activations."""
    latency, bw = _link(dep, dep.tp)
    message = tokens * dep.model.hidden * ACTIVATION_BYTES
    return 2 * dep.model.layers * allreduce_time_s(dep.tp, message, latency, bw)


def pp_hop_time_s(dep: Deployment, tokens: int) -> float:
    """Activations handed from stage to stage, pp - 1 times per iteration."""
    if dep.pp <= 1:
        return 0.0
    latency, bw = _link(dep, dep.gpus)
    return (dep.pp - 1) * (latency + tokens * dep.model.hidden * ACTIVATION_BYTES / bw)


def pp_bubble_ratio(pp: int, micro_batches: int) -> float:
    """Idle share of a pipeline: (P - 1) / (P + B - 1) (P = 4, B = 1: 75%)."""
    return (pp - 1) / (pp + micro_batches - 1)


@dataclass(frozen=True)
class StepTime:
    """One iteration of one instance; a token passes every stage in turn."""

    flops: float
    bytes: float  # per accelerator of a TP group
    compute_s: float
    memory_s: float
    comm_s: float  # TP all-reduces
    pp_s: float  # PP stage hops

    @property
    def total_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.comm_s + self.pp_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def _step(dep: Deployment, flops: float, bytes_: float, tokens: int) -> StepTime:
    # Stages run one after another, so the latency covers all layers on one
    # TP group; PP only adds hops here (its gain is throughput, see below).
    return StepTime(
        flops,
        bytes_,
        flops / dep.tp / dep.peak_flops,
        bytes_ / dep.memory_bytes_per_s,
        tp_comm_time_s(dep, tokens),
        pp_hop_time_s(dep, tokens),
    )


def prefill_time(dep: Deployment, tokens: int) -> StepTime:
    """Prefill of one ``tokens``-long prompt: read weights, write its KV."""
    m = dep.model
    weights = weight_bytes_read(m, tokens, dep.weight_bytes_per_param) / dep.tp
    kv = kv_bytes_per_token(m, dep.kv_bytes_per_element) * tokens / kv_shards(m, dep.tp)
    return _step(dep, prefill_flops(m, tokens), weights + kv, tokens)


def decode_step_time(dep: Deployment, batch: int, context_tokens: int) -> StepTime:
    """One decode iteration for ``batch`` sequences of ``context_tokens``:
    every step reads the weights and all their KV."""
    m = dep.model
    weights = weight_bytes_read(m, batch, dep.weight_bytes_per_param) / dep.tp
    kv = kv_bytes_per_token(m, dep.kv_bytes_per_element) * context_tokens * batch / kv_shards(m, dep.tp)
    return _step(dep, decode_flops(m, batch, context_tokens), weights + kv, batch)


def tokens_per_s_per_gpu(dep: Deployment, tokens: int, step: StepTime, micro_batches: int) -> float:
    """Throughput of one accelerator. PP stages work on different micro-batches
    at once, busy (1 - bubble) of the time, so PP multiplies the instance's
    rate by pp x (1 - bubble); with one micro-batch it gains nothing."""
    busy = 1.0 - pp_bubble_ratio(dep.pp, micro_batches)
    return tokens / step.total_s * dep.pp * busy / dep.gpus
