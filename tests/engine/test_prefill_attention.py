"""The C++ flash prefill kernel (bf16 caches) against float64 attention on the same bf16 numbers,
and the engine's greedy tokens with it against torch's SDPA path."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine import cpu_kernels
from pdserve.engine.model_runner import ModelRunner
from pdserve.kv.slots import slot_mapping
from tests.tiny import write_tiny_model

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(
    kernels is None or not hasattr(kernels, "prefill_attention"), reason="C++ kernels could not be built here"
)

# (span length, tokens already in the cache before it): a fresh prompt longer than a
# query tile and not a multiple of it, single-token spans, a prefix ending inside a
# block, one of several blocks and a key tile, a span spread over many key tiles, and
# contexts longer than the AMX path's 256-key softmax step (4 + 2 and 4 + 4 + 2 tiles)
SPANS = [(37, 0), (1, 0), (1, 5), (20, 7), (70, 67), (5, 96), (150, 3), (300, 40), (3, 600)]

# The bf16 paths this CPU has: AMX tiles (where present, the default) and AVX512-BF16 dot
# products (PDSERVE_NO_AMX=1 there); elsewhere the one path the kernels were built with.
BF16_PATHS = (
    ["amx-bf16", "avx512-bf16"] if kernels is not None and kernels.prefill_attention_path() == "amx-bf16" else [None]
)


@pytest.fixture(params=BF16_PATHS)
def bf16_path(request, monkeypatch):
    if request.param == "avx512-bf16":
        monkeypatch.setenv("PDSERVE_NO_AMX", "1")
    if request.param is not None:
        assert kernels.prefill_attention_path() == request.param
    return request.param


def reference(q, kc, vc, spans, tables):
    """Causal attention in float64 over the cache through the block tables: [T, H, D]."""
    bs, kvh, d = kc.shape[1:]
    group = q.shape[1] // kvh
    out = torch.zeros(q.shape, dtype=torch.float64)
    for (start, end, ctx), table in zip(spans, tables):
        pos = torch.arange(ctx)
        slots = slot_mapping(table.tolist(), 0, ctx, bs)
        k = kc.double().flatten(0, 1)[slots].repeat_interleave(group, 1)  # [ctx, H, D]
        v = vc.double().flatten(0, 1)[slots].repeat_interleave(group, 1)
        s = torch.einsum("lhd,chd->hlc", q[start:end].double(), k) * d**-0.5
        q_pos = torch.arange(ctx - (end - start), ctx)
        s = s.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[start:end] = torch.einsum("hlc,chd->lhd", s.softmax(-1), v)
    return out


def make_case(heads, kv_heads, d, bs, first_row=2, seed=0, dtype=torch.bfloat16):
    """Random q and caches (bf16 unless told), SPANS laid out from row `first_row` on (rows before it stand for
    decode tokens the kernel must not touch), each span's blocks scattered over the cache."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum((pre + n + bs - 1) // bs for n, pre in SPANS) + 5
    kc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kv_heads, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    spans, tables, row = [], [], first_row
    for n, pre in SPANS:
        ctx = pre + n
        tables.append(torch.tensor([free.pop() for _ in range((ctx + bs - 1) // bs)]))
        spans.append((row, row + n, ctx))
        row += n
    q = (torch.randn(row, heads, d, generator=g) * 2).to(dtype)  # * 2: peakier softmax rows
    width = max(len(t) for t in tables)
    padded = torch.stack([torch.cat([t, t.new_zeros(width - len(t))]) for t in tables])
    return q, kc, vc, spans, tables, padded


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (6, 2), (8, 2)], ids=["group1", "group3", "group4"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_matches_float64_attention(heads, kv_heads, d, bs, bf16_path):
    q, kc, vc, spans, tables, padded = make_case(heads, kv_heads, d, bs)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(out, q, kc, vc, torch.tensor(spans), padded, d**-0.5)
    ref = reference(q, kc, vc, spans, tables)
    first = spans[0][0]
    assert out[:first].isnan().all()  # rows outside the spans are left alone
    # P is rounded to bf16 for P.V (relative 2^-9 per weight) and the output to bf16
    torch.testing.assert_close(out[first:].double(), ref[first:], rtol=2e-2, atol=2e-2)
    assert (out[first:].double() - ref[first:]).abs().mean() < 2e-3  # no bias beyond rounding


@pytest.mark.parametrize("heads, kv_heads", [(2, 2), (9, 3)], ids=["group1", "group3"])
@pytest.mark.parametrize("d", [64, 128])
def test_fp32_caches_match_float64_attention(heads, kv_heads, d):
    """fp32 q and caches (int8 mode on a CPU without native bf16): P stays fp32, so the
    kernel is within float rounding of float64 attention."""
    q, kc, vc, spans, tables, padded = make_case(heads, kv_heads, d, 16, dtype=torch.float32)
    out = torch.full_like(q, float("nan"))
    kernels.prefill_attention(out, q, kc, vc, torch.tensor(spans), padded, d**-0.5)
    ref = reference(q, kc, vc, spans, tables)
    first = spans[0][0]
    assert out[:first].isnan().all()
    torch.testing.assert_close(out[first:].double(), ref[first:], rtol=1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.prefill_attention(out, q, kc.bfloat16(), vc.bfloat16(), torch.tensor(spans), padded, d**-0.5)


def test_unsupported_head_dim_is_named():
    assert 48 not in kernels.prefill_attention_head_dims
    q = torch.zeros(4, 2, 48, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 2, 48, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="head_dim"):
        kernels.prefill_attention(
            torch.empty_like(q),
            q,
            cache,
            cache,
            torch.tensor([[0, 4, 4]]),
            torch.zeros(1, 1, dtype=torch.long),
            48**-0.5,
        )


@pytest.mark.parametrize(
    "mode", [{"dtype": "bfloat16"}, {"dtype": "float32", "int8_activations": True}], ids=["bf16", "fp32-int8"]
)
def test_engine_tokens_match_the_torch_path(tmp_path, monkeypatch, mode, bf16_path):
    """bf16 engine (and fp32 in int8 mode, whose fp32 caches the kernel reads too), head_dim 64
    and 3 query heads per KV head: the kernel against torch's SDPA, over fresh prompts, prefill
    chunks (a span with earlier context) and prefix-cache hits."""
    d = write_tiny_model(str(tmp_path / "m"), hidden=384, heads=6, kv_heads=2, seed=5, logit_scale=4.0)
    prompts = [
        "the quick brown fox jumps over the lazy dog " * 4,
        "x",
        "a prompt of a few words",
        "the quick brown fox jumps over the lazy dog " * 4 + "again",
    ]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run():
        llm = LLM(
            d,
            block_size=16,
            num_gpu_blocks=128,
            max_num_batched_tokens=96,
            long_prefill_token_threshold=64,
            **mode,
        )
        return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]

    llm, with_kernel = run()
    assert llm.engine.runner.prefill_kernel is not None
    monkeypatch.setattr(ModelRunner, "_prefill_kernel", lambda self, cfg: None)
    llm, with_torch = run()
    assert llm.engine.runner.prefill_kernel is None
    assert with_kernel == with_torch
