"""Triton kernels for attention over the paged KV cache (the GPU path).

Same cache layout as ``attention.py``: per layer ``[num_blocks, block_size, n_kv_heads, head_dim]``,
token ``t`` of a sequence at slot ``block_table[t // block_size] * block_size + t % block_size``.

Three kernels:

* ``write_kv_triton``: scatter the step's new K/V rows into their slots (a slot < 0 is skipped,
  so padded rows of a fixed-size batch write nothing).
* ``decode_attention_triton``: one query token per sequence. A program owns one (sequence, KV head)
  pair and all the query heads that share that KV head, so each K/V tile is read once per group.
  Long contexts are cut into partitions ("split-K"): each partition keeps its own running max, sum
  and output, and a second small kernel merges them by their log-sum-exp.
* ``prefill_attention_triton``: many prefill spans in one launch (varlen). Every span's keys come
  from the cache through its block table, so earlier cached tokens (a prefix-cache hit or an earlier
  chunk) are attended exactly like the span's own tokens; causality is by absolute position.

All of them keep scores in registers with an online softmax (running max and sum, rescaled as new
tiles arrive), so no score matrix is ever stored, and they accumulate in fp32 whatever the cache
dtype (fp32, bf16, fp16). Products run with ``input_precision="ieee"`` on fp32 operands so an fp32
cache gives fp32-exact results (no TF32 rounding on the GPU). Prefill over a bf16/fp16 cache
multiplies its 16-bit tiles on the tensor cores instead (the probabilities rounded to the cache's
dtype before P @ V, as flash attention does); decode, bound by reading the cache, stays in fp32.

This module imports triton at import time; the engine imports it only when the triton backend is
chosen, so CPU start-up never loads triton. Under ``TRITON_INTERPRET=1`` (set before this module is
imported) the same kernels run on CPU tensors, which is how the tests check them.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Under Triton's CPU interpreter (read once, like triton itself reads it when kernels are defined)
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# Key/value tokens per inner tile, and query rows per prefill program. 16 is the smallest size
# tl.dot accepts; a tile spans several cache blocks when block_size < 16.
TILE_N = 16
TILE_M = 16
# Decode contexts longer than this are split across programs (split-K).
DEFAULT_PARTITION = 256
# Partitions the merge kernel takes at a time.
SPLIT_TILE = 16


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
    N_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        dst = slot * (N_KV * HEAD_DIM) + h * HEAD_DIM + d
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty))
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty))


def write_kv_triton(k_cache, v_cache, k, v, slot_mapping):
    """k, v: [T, n_kv, D] -> their slots of k_cache, v_cache ([num_blocks, block_size, n_kv, D], contiguous)."""
    t, n_kv, d = k.shape
    if t == 0:
        return
    _write_kv_kernel[(t, n_kv)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1), N_KV=n_kv, HEAD_DIM=d
    )


@triton.jit
def _tile_kv_offsets(bt_row_ptr, pos, valid, BLOCK_SIZE: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Element offset (at d=0, head 0) of each token position, read through the block table."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + (pos % BLOCK_SIZE)
    return slot * (N_KV * HEAD_DIM)


# The partition size and count are run-time values, not specialised: a constant would compile a
# kernel for each block-table width an eager step brings (seconds of stalls on a GPU).
@triton.jit(do_not_specialize=["partition", "num_splits"])
def _decode_partial_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, part_out_ptr, part_lse_ptr,
    stride_qt, stride_qh, stride_bt, sm_scale, partition, num_splits,
    N_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    part_start = split * partition
    # a partition past the sequence's end does nothing: the merge reads only the live ones
    # (a captured graph's tables are as wide as the longest context allowed, most of it empty)
    if part_start < seq_len:
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        g_ok = g < GROUP
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None], other=0.0)
        q = q.to(tl.float32) * sm_scale
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        lsum = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        part_end = tl.minimum(part_start + partition, seq_len)
        bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
        for tile_start in range(part_start, part_end, TILE):
            pos = tile_start + tl.arange(0, TILE)
            valid = pos < part_end
            base = _tile_kv_offsets(bt_row, pos, valid, BLOCK_SIZE, N_KV, HEAD_DIM) + kvh * HEAD_DIM
            kv_off = base[:, None] + d[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        out = acc / lsum[:, None]
        lse = m + tl.log(lsum)
        row = (seq * (N_KV * GROUP) + heads).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=g_ok[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit(do_not_specialize=["partition", "num_splits"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr, stride_ot, stride_oh, partition, num_splits,
    N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_TILE: tl.constexpr,
):  # fmt: skip
    """Merge the live partitions of one (sequence, head) by their log-sum-exp, SPLIT_TILE at a
    time with a running maximum, so any number of partitions fits in registers."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    live = tl.minimum(tl.cdiv(seq_len, partition), num_splits)
    d = tl.arange(0, HEAD_DIM)
    base = (seq * N_HEADS + h).to(tl.int64) * num_splits
    top = tl.full([1], float("-inf"), tl.float32)
    wsum = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, live, SPLIT_TILE):
        sp = s0 + tl.arange(0, SPLIT_TILE)
        ok = sp < live
        lse = tl.load(part_lse_ptr + base + sp, mask=ok, other=float("-inf"))
        new_top = tl.maximum(top, tl.max(lse, 0))
        alpha = tl.exp(top - new_top)  # 0 on the first tile (top = -inf; a live lse is finite)
        w = tl.where(ok, tl.exp(lse - new_top), 0.0)
        parts = tl.load(part_out_ptr + (base + sp)[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha + tl.sum(parts * w[:, None], 0)
        wsum = wsum * alpha + tl.sum(w, 0)
        top = new_top
    out = acc / tl.where(wsum > 0, wsum, 1.0)
    tl.store(out_ptr + seq * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_num_splits(max_context: int, partition: int = DEFAULT_PARTITION) -> int:
    """Partitions for a decode batch whose longest possible context is ``max_context`` tokens."""
    return max(1, math.ceil(max_context / partition))


def decode_attention_triton(
    out, q, k_cache, v_cache, block_tables, seq_lens, sm_scale, num_splits=None, partition=DEFAULT_PARTITION
):
    """out, q: [B, H, D]; block_tables: [B, max_blocks]; seq_lens: [B] (context incl. the new token).

    ``num_splits`` defaults to what the block tables' width can hold, so it depends only on shapes
    (a captured CUDA graph replays with any lengths up to that width).
    """
    b, n_heads, d = q.shape
    if b == 0:
        return out
    _, block_size, n_kv, _ = k_cache.shape
    group = n_heads // n_kv
    if num_splits is None:
        num_splits = decode_num_splits(block_tables.shape[1] * block_size, partition)
    partition = max(TILE_N, triton.cdiv(triton.cdiv(block_tables.shape[1] * block_size, num_splits), TILE_N) * TILE_N)
    part_out = torch.empty((b, n_heads, num_splits, d), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((b, n_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_partial_kernel[(b, n_kv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, part_out, part_lse,
        q.stride(0), q.stride(1), block_tables.stride(0), float(sm_scale), partition, num_splits,
        N_KV=n_kv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_SIZE=block_size, TILE=TILE_N,
    )  # fmt: skip
    _decode_reduce_kernel[(b, n_heads)](
        part_out, part_lse, seq_lens, out, out.stride(0), out.stride(1), partition, num_splits,
        N_HEADS=n_heads, HEAD_DIM=d, SPLIT_TILE=SPLIT_TILE,
    )  # fmt: skip
    return out


@triton.jit
def _lowp_dot(a, b, EMULATE: tl.constexpr):
    """a @ b of bf16/fp16 tiles with fp32 accumulation. The interpreter's bf16 dot returns
    garbage (Triton 3.9), so there it is computed in fp32 on the same values: a product of two
    16-bit floats is exact in fp32, which is what the tensor cores compute too."""
    if EMULATE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, spans_ptr, bt_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, sm_scale,
    N_KV: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_Q: tl.constexpr, TILE: tl.constexpr, LOWP: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    span = tl.program_id(0)
    h = tl.program_id(1)
    tile_q = tl.program_id(2)
    start = tl.load(spans_ptr + span * 3).to(tl.int32)
    end = tl.load(spans_ptr + span * 3 + 1).to(tl.int32)
    ctx = tl.load(spans_ptr + span * 3 + 2).to(tl.int32)
    length = end - start
    if tile_q * TILE_Q < length:
        i = tile_q * TILE_Q + tl.arange(0, TILE_Q)
        row_ok = i < length
        qpos = ctx - length + i  # absolute position of each query token in its sequence
        d = tl.arange(0, HEAD_DIM)
        tok = (start + i).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0)
        if not LOWP:
            q = q.to(tl.float32) * sm_scale
        kvh = h // GROUP
        m = tl.full([TILE_Q], float("-inf"), tl.float32)
        lsum = tl.zeros([TILE_Q], tl.float32)
        acc = tl.zeros([TILE_Q, HEAD_DIM], tl.float32)
        bt_row = bt_ptr + span.to(tl.int64) * stride_bt
        # keys past the tile's last query position are masked for every row: stop there
        key_end = tl.minimum(ctx, ctx - length + tile_q * TILE_Q + TILE_Q)
        for tile_start in range(0, key_end, TILE):
            pos = tile_start + tl.arange(0, TILE)
            valid = pos < key_end
            base = _tile_kv_offsets(bt_row, pos, valid, BLOCK_SIZE, N_KV, HEAD_DIM) + kvh * HEAD_DIM
            kv_off = base[:, None] + d[None, :]
            k = tl.load(k_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=valid[:, None], other=0.0)
            if LOWP:  # bf16/fp16 operands on the tensor cores, fp32 accumulators (as flash attention)
                s = _lowp_dot(q, tl.trans(k), EMULATE) * sm_scale
            else:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            allowed = valid[None, :] & (pos[None, :] <= qpos[:, None])
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            # rows with nothing allowed yet keep m = -inf: shift by 0 there to avoid inf - inf
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - shift)
            p = tl.exp(s - shift[:, None])
            lsum = lsum * alpha + tl.sum(p, 1)
            if LOWP:
                acc = acc * alpha[:, None] + _lowp_dot(p.to(v.dtype), v, EMULATE)
            else:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m = m_new
        out = acc / tl.where(lsum > 0, lsum, 1.0)[:, None]
        o_off = tok[:, None] * stride_ot + h * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention_triton(out, q, k_cache, v_cache, spans, block_tables, sm_scale, max_span_len=None):
    """out, q: [T, H, D]; spans: [S, 3] (start, end, context_len); block_tables: [S, max_blocks].

    Each span's K/V (its own new tokens included) must already be in the cache. ``max_span_len``
    sizes the launch grid; pass it from the host to avoid reading ``spans`` back from the device.
    """
    n_spans = spans.shape[0]
    if n_spans == 0:
        return out
    if max_span_len is None:
        max_span_len = int((spans[:, 1] - spans[:, 0]).max())
    _, block_size, n_kv, _ = k_cache.shape
    n_heads, d = q.shape[1], q.shape[2]
    grid = (n_spans, n_heads, triton.cdiv(max_span_len, TILE_M))
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, spans, block_tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0), float(sm_scale),
        N_KV=n_kv, GROUP=n_heads // n_kv, HEAD_DIM=d, BLOCK_SIZE=block_size, TILE_Q=TILE_M, TILE=TILE_N,
        LOWP=q.dtype == k_cache.dtype and k_cache.dtype in (torch.bfloat16, torch.float16), EMULATE=_INTERPRETED,
    )  # fmt: skip
    return out


class DeviceSpans(NamedTuple):
    spans: torch.Tensor  # [S, 3] int64 on the kernels' device
    max_len: int  # the longest span, in tokens


class TritonAttentionBackend:
    """The kernels behind the interface ``attention.paged_attention`` calls on its kernel modules.

    The method names and argument orders are those of the C++ CPU module, so the attention code
    has one path whichever backend the runner picked."""

    name = "triton"

    @staticmethod
    def supports(head_dim: int) -> bool:
        """tl.arange needs a power-of-two extent: the head dim is one tile edge."""
        return head_dim >= 16 and head_dim & (head_dim - 1) == 0

    def write_kv(self, k_cache, v_cache, k, v, slot_mapping):
        write_kv_triton(k_cache, v_cache, k, v, slot_mapping)

    def paged_decode_attention(self, out, q, k_cache, v_cache, block_tables, seq_lens, sm_scale):
        decode_attention_triton(out, q, k_cache, v_cache, block_tables, seq_lens, sm_scale)

    @staticmethod
    def prepare_spans(spans: torch.Tensor, device) -> DeviceSpans:
        """A step's host spans, copied to the device once for all its layers, with the longest
        span's length (read on the host: it sizes the grid without a device sync)."""
        return DeviceSpans(spans.to(device), int((spans[:, 1] - spans[:, 0]).max()))

    def prefill_attention(self, out, q, k_cache, v_cache, spans, block_tables, sm_scale):
        """``spans``: a host tensor, or what ``prepare_spans`` made of one."""
        if not isinstance(spans, DeviceSpans):
            spans = self.prepare_spans(spans, q.device)
        prefill_attention_triton(
            out, q, k_cache, v_cache, spans.spans, block_tables.to(q.device), sm_scale, spans.max_len
        )
