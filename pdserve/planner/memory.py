"""Memory: weight bytes, KV bytes (MHA, GQA, MLA), fit and max concurrency."""

from __future__ import annotations

import math

from pdserve.planner.deployment import Deployment
from pdserve.planner.models import ModelShape, param_count


def weight_bytes(params: float, bytes_per_param: float) -> float:
    """Weight memory (7B x 2 B = 14 GB; INT4: 3.5 GB)."""
    return params * bytes_per_param


def kv_bytes_per_token_layer(model: ModelShape, bytes_per_element: float) -> float:
    """KV bytes one token adds to one layer.

    MHA/GQA: 2 (K and V) x n_kv_heads x d_head x bytes. MLA: (d_c + d_R) x bytes, the latent plus the decoupled
    RoPE key, with no factor 2.
    """
    if model.is_mla:
        return (model.kv_lora_rank + model.qk_rope_head_dim) * bytes_per_element
    return 2 * model.kv_heads * model.head_dim * bytes_per_element


def kv_bytes_per_token(model: ModelShape, bytes_per_element: float) -> float:
    """KV bytes per token over all layers (70B GQA: 80 x 4 KiB = 320 KiB)."""
    return model.layers * kv_bytes_per_token_layer(model, bytes_per_element)


def kv_bytes(model: ModelShape, tokens: int, bytes_per_element: float, requests: int = 1) -> float:
    """M_KV = 2 x L x n_kv x d_head x S x B x bytes."""
    return kv_bytes_per_token(model, bytes_per_element) * tokens * requests


def kv_shards(model: ModelShape, tp: int) -> int:
    """Ways the KV cache splits across TP ranks. KV heads split until each rank
    holds one (beyond that they are replicated); MLA's latent is shared by all
    heads, so every rank keeps all of it."""
    return 1 if model.is_mla else min(tp, model.kv_heads)


def usable_memory_bytes(memory_bytes: float, utilization: float) -> float:
    return memory_bytes * utilization


def fits(weight_bytes_: float, kv_bytes_: float, memory_bytes: float, utilization: float) -> bool:
    """Weights plus KV fit in the share of memory the engine may use."""
    return weight_bytes_ + kv_bytes_ <= usable_memory_bytes(memory_bytes, utilization)


def max_concurrency(free_bytes: float, kv_bytes_per_request: float) -> int:
    """Requests whose full-context KV fits in ``free_bytes`` (0 if none)."""
    if free_bytes <= 0 or kv_bytes_per_request <= 0:
        return 0
    return math.floor(free_bytes / kv_bytes_per_request)


# Deployment-level views of the same formulas, per accelerator.


def deployment_weight_bytes(dep: Deployment) -> float:
    return weight_bytes(param_count(dep.model), dep.weight_bytes_per_param)


def weight_bytes_per_gpu(dep: Deployment) -> float:
    # Embeddings and norms are split too in this estimate; the error is the
    # vocabulary slice, a few percent at most for the catalog's models.
    return deployment_weight_bytes(dep) / dep.gpus


def kv_bytes_per_token_per_gpu(dep: Deployment) -> float:
    per_token = kv_bytes_per_token(dep.model, dep.kv_bytes_per_element)
    return per_token / (kv_shards(dep.model, dep.tp) * dep.pp)


def free_kv_bytes_per_gpu(dep: Deployment) -> float:
    usable = usable_memory_bytes(dep.gpu.memory_bytes, dep.gpu_memory_utilization)
    return usable - weight_bytes_per_gpu(dep)


def deployment_max_concurrency(dep: Deployment, context_tokens: int) -> int:
    """Requests of ``context_tokens`` one instance (tp x pp GPUs) can hold."""
    per_request = kv_bytes_per_token_per_gpu(dep) * context_tokens
    return max_concurrency(free_kv_bytes_per_gpu(dep), per_request)
