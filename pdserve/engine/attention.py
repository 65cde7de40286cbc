"""Attention over the paged KV cache, for a batch that mixes prefill chunks and decodes.

Cache layout, per layer: ``k_cache, v_cache: [num_blocks, block_size, n_kv_heads, head_dim]``.
Token t of a sequence lives in block ``block_table[t // block_size]`` at offset
``t % block_size``; its flat "slot" is ``block * block_size + offset``
(``pdserve.kv.slots`` computes them; the runner passes them in ``slot_mapping``).

Batch layout: the first ``num_decodes`` tokens are decode tokens (one per
sequence), the rest are prefill spans. Decodes run as one batched call. With a
bf16 cache and the C++ kernels, all prefill spans run in one call of the flash
prefill kernel, which reads every span's context through its block table;
otherwise each span runs through torch's SDPA on its own (its length differs
from every other).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # index of the span's first token in the flattened batch
    end: int
    context_len: int  # tokens in the cache for this sequence after this step
    # the torch path's inputs (left None when the prefill kernel runs the spans):
    block_table: torch.Tensor | None  # None -> no earlier context: attend only to this span
    mask: torch.Tensor | None = None  # [L, context_len] bool, when block_table is set


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat slot for each token's new K/V
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks]
    decode_seq_lens: torch.Tensor | None = None  # [B] int64, context incl. the new token
    # [B, 1, 1, max_blocks * block_size] bool; only built when the kernel is not used
    decode_mask: torch.Tensor | None = None
    decode_kernel: object | None = None  # compiled CPU paged-attention module, if any
    prefills: list[PrefillSpan] = field(default_factory=list)
    # All prefill spans as one call of the C++ prefill kernel (bf16 caches), when set:
    prefill_kernel: object | None = None
    # [S, 3] int64: start, end, context_len (or what the kernel's `prepare_spans` made of them)
    prefill_spans: object | None = None
    prefill_block_tables: torch.Tensor | None = None  # [S, max_blocks] int64, every span's table
    # Called after each layer's forward (its K/V are in the cache): the KV bridge
    # hooks here to ship a layer while the next one computes.
    on_layer_done: Callable[[int], None] | None = None
    # Writes the step's K/V into the cache (k_cache, v_cache, k, v, slot_mapping); None: index_copy_.
    # The triton backend sets its kernel, which also skips slots < 0 (padded rows of a CUDA graph).
    kv_writer: Callable | None = None
    # The step's LoRA adapters (lora.LoRABatch): each projection adds its rows' adapter deltas
    lora: object | None = None


def write_kv(k_cache, v_cache, k, v, slot_mapping):
    n_kv, d = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, n_kv, d).index_copy_(0, slot_mapping, v)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, nb] block ids -> [B, n_kv, nb * block_size, D] contiguous keys or values."""
    g = cache[block_tables]  # [B, nb, bs, n_kv, D]
    b, nb, bs, n_kv, d = g.shape
    return g.view(b, nb * bs, n_kv, d).transpose(1, 2)


def paged_attention(q, k, v, kv_caches, meta: AttentionMetadata, layer_idx: int) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, n_kv, D] for the new tokens. Returns [T, H, D]."""
    k_cache, v_cache = kv_caches[layer_idx]
    (meta.kv_writer or write_kv)(k_cache, v_cache, k, v, meta.slot_mapping)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: its first rows are the decodes'
    n_heads, n_kv, d = q.shape[1], k.shape[1], q.shape[2]
    group = n_heads // n_kv
    nd = meta.num_decodes
    if nd and meta.decode_kernel is not None:
        meta.decode_kernel.paged_decode_attention(
            out[:nd], q[:nd].contiguous(), k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, d**-0.5
        )
    elif nd:
        # One query token per sequence: present the `group` query heads that share
        # a KV head as `group` query rows against that head (exact, no K/V repeat).
        qd = q[:nd].view(nd, n_kv, group, d)
        kd = gather_kv(k_cache, meta.decode_block_tables)
        vd = gather_kv(v_cache, meta.decode_block_tables)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out[:nd] = od.reshape(nd, n_heads, d)
    if meta.prefill_kernel is not None and meta.prefills:
        meta.prefill_kernel.prefill_attention(
            out, q.contiguous(), k_cache, v_cache, meta.prefill_spans, meta.prefill_block_tables, d**-0.5
        )
        return out
    for span in meta.prefills:
        qs = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        if span.block_table is None:
            ks = k[span.start : span.end].transpose(0, 1).unsqueeze(0)
            vs = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            bt = span.block_table.unsqueeze(0)
            ks = gather_kv(k_cache, bt)[:, :, : span.context_len]
            vs = gather_kv(v_cache, bt)[:, :, : span.context_len]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=span.mask, enable_gqa=True)
        out[span.start : span.end] = o[0].transpose(0, 1)
    return out
