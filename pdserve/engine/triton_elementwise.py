"""Fused elementwise kernels in Triton: the GPU twin of ``csrc/elementwise.cpp``.

In bf16, PyTorch computes RMSNorm as about six kernels (cast, square, mean, rsqrt, scale, cast,
weight), RoPE as about ten per tensor (slices, negation, concatenation, products, sum), SiLU * up
as two and each residual add as one. A decode step of a small batch on a GPU is bound by launches
and by the weights' bytes, not by these kernels' arithmetic: at batch 1 on a 32-layer model they
were over a thousand launches a step, some 2 us each even inside a CUDA graph. Here each is one
kernel: bf16 in and out, fp32 arithmetic, one program per row (or head).

The functions and their arguments are those of the C++ module, so ``DecoderLayer.forward_fused_elementwise``
runs either. The roundings are PyTorch's, as there: RMSNorm rounds the normalised row before the
weight multiplies it; the residual add rounds once; RoPE rounds cos and sin, each product and
their sum; SiLU is rounded before the product with ``up``. What may differ from PyTorch is the
order of the fp32 sum of squares, now and then one bf16 step (tests/engine/test_triton_elementwise.py).

Like ``triton_attention``, this module imports triton at import time and is imported only when
the Triton backend runs in bf16; under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(block: int) -> int:
    return 4 if block <= 1024 else 8 if block <= 4096 else 16


@triton.jit
def _bf16(x):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32. Written out on the bits because
    Triton's interpreter truncates in ``.to(tl.bfloat16)`` where the GPU rounds; a value this
    returns converts to bf16 exactly either way. (NaN inputs are not kept NaN.)"""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, width, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    if ADD:  # residual += x, rounded as a bf16 add, then normalise the sum
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        x = _bf16(x + r)
        tl.store(res_ptr + row * stride_r + cols, x.to(tl.bfloat16), mask=ok)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / width + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, _bf16(_bf16(x * inv) * w).to(tl.bfloat16), mask=ok)


@triton.jit
def _rope_kernel(
    qkv_ptr, q_ptr, cos_ptr, sin_ptr, pos_ptr, stride_t, stride_pos,
    N_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    i = tl.arange(0, HALF_PAD)
    ok = i < half
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c1 = _bf16(tl.load(cos_ptr + pos * stride_pos + i, mask=ok, other=0.0))
    s1 = _bf16(tl.load(sin_ptr + pos * stride_pos + i, mask=ok, other=0.0))
    c2 = _bf16(tl.load(cos_ptr + pos * stride_pos + half + i, mask=ok, other=0.0))
    s2 = _bf16(tl.load(sin_ptr + pos * stride_pos + half + i, mask=ok, other=0.0))
    src = qkv_ptr + t * stride_t + h * HEAD_DIM  # q heads, then k heads (v is not rotated)
    a = tl.load(src + i, mask=ok, other=0.0).to(tl.float32)
    b = tl.load(src + half + i, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded, then the sum
    lo = _bf16(_bf16(a * c1) - _bf16(b * s1))
    hi = _bf16(_bf16(b * c2) + _bf16(a * s2))
    if h < N_HEADS:  # q into a contiguous tensor of its own
        dst = q_ptr + (t * N_HEADS + h) * HEAD_DIM
    else:  # k in place
        dst = src
    tl.store(dst + i, lo.to(tl.bfloat16), mask=ok)
    tl.store(dst + half + i, hi.to(tl.bfloat16), mask=ok)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_o, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=ok, other=0.0).to(tl.float32)
    s = _bf16(g / (1.0 + tl.exp(-g)))
    tl.store(out_ptr + row * stride_o + cols, _bf16(s * u).to(tl.bfloat16), mask=ok)


class TritonElementwise:
    """``rms_norm``, ``add_rms_norm``, ``rope_qkv`` and ``silu_and_mul`` with the C++ module's
    signatures and results, for bf16 rows on any device Triton runs on."""

    name = "triton"

    @staticmethod
    def _norm(x, residual, weight, eps):
        rows, width = x.shape
        out = torch.empty_like(x)
        if rows == 0:
            return out
        block = triton.next_power_of_2(width)
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](
            x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), width, float(eps),
            ADD=residual is not None, BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
        return out

    def rms_norm(self, x, weight, eps):
        """RMSNorm(x) * weight; x: [T, H] with unit stride along H."""
        return self._norm(x, None, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        """residual += x in place; returns RMSNorm(residual) * weight."""
        return self._norm(x, residual, weight, eps)

    def rope_qkv(self, qkv, cos, sin, positions, n_heads, n_kv, head_dim):
        """RoPE on the q and k heads of ``qkv`` [T, (n_heads + 2 n_kv) * head_dim]: returns q
        (a contiguous tensor of its own), k (rotated in place) and v, both views of ``qkv``."""
        rows = qkv.shape[0]
        q_size, kv_size = n_heads * head_dim, n_kv * head_dim
        q = torch.empty((rows, n_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
        if rows:
            _rope_kernel[(rows, n_heads + n_kv)](
                qkv, q, cos, sin, positions, qkv.stride(0), cos.stride(0),
                N_HEADS=n_heads, HEAD_DIM=head_dim, HALF_PAD=triton.next_power_of_2(head_dim // 2),
            )  # fmt: skip
        k = qkv[:, q_size : q_size + kv_size].view(rows, n_kv, head_dim)
        v = qkv[:, q_size + kv_size : q_size + 2 * kv_size].view(rows, n_kv, head_dim)
        return q, k, v

    def silu_and_mul(self, gate_up):
        """[T, 2I] (gate, then up) -> silu(gate) * up: [T, I]."""
        rows, width = gate_up.shape
        inter = width // 2
        out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
        if rows:
            block = min(1024, triton.next_power_of_2(inter))
            _silu_mul_kernel[(rows, triton.cdiv(inter, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), inter, BLOCK=block
            )
        return out
