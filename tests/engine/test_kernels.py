"""The CPU kernels against plain PyTorch on the same numbers, and the fallback without them."""

import dataclasses

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.engine import cpu_kernels
from pdserve.engine.attention import gather_kv
from pdserve.engine.gguf_dequant import dequantize
from pdserve.kv.slots import slot_mapping

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="C++ kernels could not be built here")


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 37])
def test_gguf_matmul_matches_dequantized_weights(qtype, rows):
    """Below 8 rows the kernel decodes blocks in registers; from 8 on it expands weight
    rows to fp32 and multiplies 2 x 4 tiles (37: a remainder in both directions)."""
    n, k = 97, 256
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)  # [n, row_bytes] uint8, the on-disk layout
    dense = dequantize(raw.reshape(-1), qtype, n * k).view(n, k)
    x = torch.randn(rows, k)
    got = kernels.gguf_matmul(x, torch.from_numpy(raw), int(t), k)
    torch.testing.assert_close(got, x @ dense.T, rtol=1e-5, atol=1e-4)


def _int8_reference(x: torch.Tensor, raw: np.ndarray, qtype: str) -> torch.Tensor:
    """q8_matmul's arithmetic in PyTorch: activations rounded per 32 values to int8
    (scale max|x| / 127), integer block dot products, d * dx and the block constant
    times the exact block sum of x."""
    n = raw.shape[0]
    k = x.shape[1]
    nb = k // 32
    blocks = torch.from_numpy(raw.reshape(n, nb, -1).copy())
    d = blocks[..., 0:2].contiguous().view(torch.float16).float().view(n, nb)
    if qtype == "Q8_0":
        q = blocks[..., 2:34].contiguous().view(torch.int8).long()
        c = torch.zeros(n, nb)
    else:
        qs = blocks[..., 4:20] if qtype == "Q4_1" else blocks[..., 2:18]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).long()
        c = blocks[..., 2:4].contiguous().view(torch.float16).float().view(n, nb) if qtype == "Q4_1" else -8 * d
    xb = x.view(-1, nb, 32)
    dx = xb.abs().amax(-1) / 127
    xq = torch.round(xb / torch.where(dx > 0, dx, 1).unsqueeze(-1) * (dx > 0).unsqueeze(-1)).long()
    isum = torch.einsum("mjk,njk->mnj", xq, q).double()
    return ((isum * (dx.unsqueeze(1) * d.unsqueeze(0)).double()).sum(-1) + (xb.sum(-1).double() @ c.double().T)).float()


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,k", [(1, 256), (3, 256), (8, 288), (16, 64)])
def test_int8_activation_matmul_does_the_int8_arithmetic(qtype, rows, k):
    """The opt-in int8 kernel computes exactly the rounded-activation products (288: an odd
    number of blocks, the unpaired last block), and stays within ~3% of the fp32 product."""
    n = 37
    w = np.random.default_rng(2).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, 5] = 40.0  # an outlier, as in real hidden states: its block gets a coarse scale
    packed = kernels.q8_repack(torch.from_numpy(raw), int(t), k)
    assert packed.shape[0] == n
    got = kernels.q8_matmul(x, packed, int(t), k)
    torch.testing.assert_close(got, _int8_reference(x, raw, qtype), rtol=1e-4, atol=1e-3)
    exact = kernels.gguf_matmul(x, torch.from_numpy(raw), int(t), k)
    assert ((got - exact).norm() / exact.norm()).item() < 0.03
    with pytest.raises(RuntimeError, match="q8_repack"):
        kernels.q8_matmul(x, torch.from_numpy(raw), int(t), k) if qtype == "Q4_0" else kernels.q8_matmul(
            x, packed[:, :-1].contiguous(), int(t), k
        )


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,n,k", [(1, 37, 256), (4, 16, 64), (7, 33, 288), (37, 97, 64), (70, 40, 576)])
def test_int8_gemm_does_the_int8_arithmetic(qtype, rows, n, k):
    """The many-row int8 kernel computes the same rounded-activation products as the
    small-batch one (rows in tiles of 4 and a remainder, channels in tiles of 16 and a
    partial last tile that must not write past N), for any number of rows."""
    w = np.random.default_rng(5).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, t)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[0, 5] = 40.0
    packed = kernels.q8_gemm_pack(torch.from_numpy(raw), int(t), k)
    got = kernels.q8_gemm(x, packed, int(t), k, n)
    assert got.shape == (rows, n)
    torch.testing.assert_close(got, _int8_reference(x, raw, qtype), rtol=1e-4, atol=1e-3)
    small = kernels.q8_matmul(x, kernels.q8_repack(torch.from_numpy(raw), int(t), k), int(t), k)
    torch.testing.assert_close(got, small, rtol=1e-4, atol=1e-3)
    with pytest.raises(RuntimeError, match="q8_gemm_pack"):
        kernels.q8_gemm(x, packed[:-1].contiguous(), int(t), k, n)
    with pytest.raises(RuntimeError, match="q8_gemm_pack"):
        kernels.q8_gemm(x, packed, int(t), k, n + 16)
    assert kernels.q8_gemm(x[:0], packed, int(t), k, n).shape == (0, n)


@needs_kernels
@pytest.mark.parametrize("int8", [False, True])
def test_many_row_products_in_int8_mode_take_the_int8_gemm(int8):
    """In int8 mode a product of more rows than the block kernels take runs the int8
    GEMM (the same arithmetic, row by row, as a few rows); the exact mode keeps fp32."""
    from pdserve.engine.model import Linear

    k, n = 128, 48
    w = np.random.default_rng(6).standard_normal((n, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(w, t)
    lin = Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(dequantize(raw.reshape(-1), "Q4_1", w.size).view(n, k))
        lin.bias.normal_()
    assert lin.set_quantized([(int(t), torch.from_numpy(raw))], kernels, int8_activations=int8)
    assert (lin.gemm_weight is not None) == int8
    x = torch.randn(Linear.max_rows + 9, k)
    rows = torch.cat([lin(x[i : i + 3]) for i in range(0, x.shape[0], 3)])  # each call: few rows
    torch.testing.assert_close(lin(x), rows, rtol=1e-4, atol=1e-3)
    if not int8:
        torch.testing.assert_close(lin(x), x @ lin.weight.T + lin.bias, rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("mode", ["pool", "omp"])
@pytest.mark.parametrize("threads", [2, 4])
def test_parallel_loop_runs_every_index_once_before_returning(threads, mode):
    """pool.h under stress: chunk counts that change from loop to loop, more threads
    than cores (so helpers get descheduled mid-claim). A helper late from one loop
    once claimed a chunk of the next and the loop returned early (CI: a fused layer
    read half-written rows). Both places the loops run: the pool and OpenMP's team."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    old_mode = kernels.set_parallel_mode(mode)
    try:
        assert kernels.pool_check(4096, 256, 100_000 if mode == "pool" else 10_000, 0) == 0
        assert kernels.pool_check(4096, 256, 5_000, 5) == 0
    finally:
        kernels.set_parallel_mode(old_mode)
        torch.set_num_threads(old)


@needs_kernels
def test_a_prefill_step_runs_the_kernels_loops_on_openmps_team(tiny_model_dir):
    """Steps with GEMMs (here a prompt alone, no decode in the batch) put the kernels' loops on
    OpenMP's team: a prefill-only step once left them on the pool, whose helper then took
    turns on a core with OpenMP's spinning thread (a 512-token prefill 160 -> 200+ ms)."""
    llm = LLM(tiny_model_dir, dtype="bfloat16", block_size=4, num_gpu_blocks=64)
    assert llm.engine.runner.model.cpu_kernels is kernels
    kernels.set_parallel_mode("pool")
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=1))
    assert kernels.set_parallel_mode("pool") == "omp"


@needs_kernels
def test_parallel_mode_is_checked():
    with pytest.raises(RuntimeError, match="parallel mode"):
        kernels.set_parallel_mode("threads")


@needs_kernels
@pytest.mark.parametrize(
    "dtype,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]
)
@pytest.mark.parametrize("lens", [[1, 3, 4, 9, 17], [16, 31, 32, 48, 33], [256, 257, 700, 5, 1030]])
@pytest.mark.parametrize("d", [32, 64, 128, 20])
def test_paged_decode_attention_matches_sdpa(dtype, q_dtype, lens, d):
    """Contexts past 256 tokens are cut into pieces that run in parallel and are merged.
    bf16 caches (bf16 mode) take bf16 queries (layer-by-layer path; vdpbf16ps where the CPU
    has AVX512-BF16, 16 keys at a time, so lengths around 16s matter) or fp32 ones (the fused
    decode layer); d = 20 is not a multiple of 8: the scalar path."""
    g = torch.Generator().manual_seed(0)
    b, h, kvh, bs = 5, 6, 2, 4
    lens = torch.tensor(lens)
    nb = int((lens.max() + bs - 1) // bs)
    num_blocks = b * nb + 3
    kc = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: b * nb].view(b, nb)
    q = torch.randn(b, h, d, generator=g).to(q_dtype)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, kc, vc, tables, lens, d**-0.5)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(
        q.view(b, kvh, h // kvh, d).float(),
        gather_kv(kc, tables).float(),
        gather_kv(vc, tables).float(),
        attn_mask=mask,
    ).reshape(b, h, d)
    # the kernel widens bf16 exactly and accumulates in fp32: only a bf16 output is rounded
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_pure_pytorch_fallback_gives_the_same_tokens(tiny_model_dir, monkeypatch):
    prompts = ["hello world", "a longer prompt that spans several blocks"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with_kernels = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    without = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64)
    assert without.engine.runner.decode_kernel is None
    assert [o.outputs[0].token_ids for o in with_kernels.generate(prompts, params)] == [
        o.outputs[0].token_ids for o in without.generate(prompts, params)
    ]


@pytest.mark.integration
@needs_kernels
def test_embedded_model_uses_its_gguf_blocks(real_model_path):
    llm = LLM(dtype="float32")
    # 4 fused linears per layer x 30 layers + the tied Q8_0 output head
    assert llm.engine.runner.num_quantized_linears == 121


@pytest.mark.integration
@needs_kernels
def test_gguf_row_limit_follows_the_dense_gemm(real_model_path):
    """Beside a bf16 GEMM the block kernels keep only products of 1-2 rows (and decode steps
    of 1-2 sequences the fused layer); beside fp32, up to 16; the setting overrides both."""
    from pdserve.engine.attention import AttentionMetadata

    bf16 = LLM(dtype="bfloat16", num_gpu_blocks=64)
    model = bf16.engine.runner.model
    assert model.gguf_max_rows == 2 and model.layers[0].qkv_proj.max_rows == 2 and model.lm_head.max_rows == 2
    x = torch.zeros(3, 576, dtype=torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.zeros(3, dtype=torch.int64), num_decodes=3, decode_kernel=kernels)
    assert not model.use_fused(x, meta) and model.use_fused(x[:2], dataclasses.replace(meta, num_decodes=2))
    assert LLM(dtype="float32", num_gpu_blocks=64).engine.runner.model.gguf_max_rows == 16
    assert LLM(dtype="bfloat16", gguf_max_rows=8, num_gpu_blocks=64).engine.runner.model.lm_head.max_rows == 8
    with pytest.raises(ValueError, match="gguf_max_rows"):
        LLM(dtype="bfloat16", gguf_max_rows=65)


def _quantized_layer(qtype: str, bias: bool, int8: bool = False, intermediate_size: int = 96):
    from pdserve.config import ModelConfig
    from pdserve.engine.model import DecoderLayer

    cfg = ModelConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=intermediate_size,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=bias,
    )
    layer = DecoderLayer(cfg, 0)
    torch.manual_seed(1)  # the norms' weights and the bias below: the same layer every run
    rng = np.random.default_rng(1)
    t = gguf.GGMLQuantizationType[qtype]
    for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        w = rng.standard_normal(tuple(lin.weight.shape)).astype(np.float32) * 0.1
        raw = gguf.quants.quantize(w, t)
        with torch.no_grad():
            lin.weight.copy_(dequantize(raw.reshape(-1), qtype, w.size).view(lin.weight.shape))
            if lin.bias is not None:
                lin.bias.normal_()
        assert lin.set_quantized([(int(t), torch.from_numpy(raw))], kernels, int8_activations=int8)
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    layer.make_fused(kernels, cfg)
    return cfg, layer


def _decode_batch(cfg, batch: int, g):
    """Random caches (and a copy for the reference path), block tables, lengths, positions and
    slots for `batch` decode rows of 4-token blocks."""
    bs, nb = 4, 6
    kv_shape = (batch * nb + 2, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g))]
    ref_caches = [(caches[0][0].clone(), caches[0][1].clone())]
    tables = torch.randperm(kv_shape[0], generator=g)[: batch * nb].view(batch, nb)
    lens = torch.randint(1, nb * bs + 1, (batch,), generator=g)
    pos = lens - 1
    slots = torch.cat([slot_mapping(t, p, p + 1, bs) for t, p in zip(tables.tolist(), pos.tolist())])
    return caches, ref_caches, tables, lens, pos, slots


@needs_kernels
@pytest.mark.parametrize(
    "qtype,bias,int8",
    [
        ("Q4_1", False, False),
        ("Q4_0", True, False),
        ("Q8_0", False, False),
        ("Q4_1", False, True),
        ("Q8_0", True, True),
    ],
)
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fused_decode_layer_matches_the_python_layer(qtype, bias, int8, batch):
    """One C++ call per layer computes what the layer's Python forward computes, KV writes
    included; with int8 activations both paths use the int8 kernel."""
    from pdserve.engine.attention import AttentionMetadata
    from pdserve.engine.model import rope_inv_freq

    cfg, layer = _quantized_layer(qtype, bias, int8)
    assert layer.fused is not None
    g = torch.Generator().manual_seed(batch)
    caches, ref_caches, tables, lens, pos, slots = _decode_batch(cfg, batch, g)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=batch, decode_block_tables=tables, decode_seq_lens=lens, decode_kernel=kernels
    )
    inv = rope_inv_freq(cfg)
    emb = torch.cat((torch.outer(pos.float(), inv),) * 2, dim=-1)
    x = torch.randn(batch, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        ref = layer(x, emb.cos().unsqueeze(1), emb.sin().unsqueeze(1), ref_caches, meta)
        got = layer.fused.forward(x, emb.cos(), emb.sin(), caches[0][0], caches[0][1], slots, tables, lens)
    if int8:
        # the paths' ~1e-6 differences (RoPE's FMA, the SiLU's exp) can tip an activation
        # across an int8 rounding boundary (one step: ~1% of its block's largest value),
        # and a tipped value moves the products after it: compare as a whole
        for a, b in ((got, ref), (caches[0][0], ref_caches[0][0]), (caches[0][1], ref_caches[0][1])):
            assert ((a - b).norm() / b.norm()).item() < 1e-2
        return
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][0], ref_caches[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][1], ref_caches[0][1], rtol=1e-5, atol=1e-5)


@needs_kernels
@pytest.mark.parametrize("batch", [1, 4])
def test_fused_decode_layer_adds_lora_deltas_as_the_python_layer_does(batch):
    """LoRA groups (engine/lora.py) in the C++ layer: one adapter on some rows, another on
    others (products it leaves alone included), base rows beside them."""
    from pdserve.engine.attention import AttentionMetadata
    from pdserve.engine.lora import LoRAAdapter, LoRABatch, Product
    from pdserve.engine.model import rope_inv_freq

    cfg, layer = _quantized_layer("Q8_0", False, False)
    g = torch.Generator().manual_seed(7 + batch)
    hd, h, i = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    dims = {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * i), "down": (i, h)}

    def adapter(name, rank, products):
        mats = {
            p: Product(
                torch.randn(dims[p][0], rank, generator=g) * 0.1, torch.randn(rank, dims[p][1], generator=g) * 0.1
            )
            for p in products
        }
        return LoRAAdapter(name, "", rank, 0.5, name, [mats])

    a, b = adapter("a", 8, dims), adapter("b", 4, ("qkv", "down"))
    rows_a = torch.tensor([r for r in range(batch) if r % 2 == 0])
    groups = [(a, rows_a)] + ([(b, torch.tensor([1]))] if batch > 1 else [])
    if batch == 1:
        groups = [(a, None)]  # every row: the no-index path
    caches, ref_caches, tables, lens, pos, slots = _decode_batch(cfg, batch, g)
    lora = LoRABatch(groups)
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=batch, decode_block_tables=tables, decode_seq_lens=lens, decode_kernel=kernels
    )
    meta.lora = lora
    emb = torch.cat((torch.outer(pos.float(), rope_inv_freq(cfg)),) * 2, dim=-1)
    x = torch.randn(batch, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        ref = layer(x, emb.cos().unsqueeze(1), emb.sin().unsqueeze(1), ref_caches, meta)
        plain = layer(
            x,
            emb.cos().unsqueeze(1),
            emb.sin().unsqueeze(1),
            [(c.clone(), v.clone()) for c, v in ref_caches],
            AttentionMetadata(
                slot_mapping=slots,
                num_decodes=batch,
                decode_block_tables=tables,
                decode_seq_lens=lens,
                decode_kernel=kernels,
            ),
        )
        got = layer.fused.forward(
            x, emb.cos(), emb.sin(), caches[0][0], caches[0][1], slots, tables, lens, lora.fused_args(0)
        )
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][0], ref_caches[0][0], rtol=1e-5, atol=1e-5)
    changed = (ref - plain).abs().amax(dim=1) > 1e-3
    assert changed.tolist() == [r % 2 == 0 or r == 1 for r in range(batch)]  # base rows untouched


@needs_kernels
@pytest.mark.parametrize("batch", [1, 5])
def test_fused_decode_layer_over_a_bf16_cache(batch):
    """bf16 mode: the fused layer keeps fp32 activations, rounds the new K/V to bf16 (as
    `.to(torch.bfloat16)` does) and attends over the bf16 cache with fp32 queries. Against
    the fp32 layer on the same cache contents: the written rows are its K/V rounded, the
    output differs only by that rounding."""
    from pdserve.engine.attention import AttentionMetadata
    from pdserve.engine.model import rope_inv_freq

    cfg, layer = _quantized_layer("Q4_1", False)
    g = torch.Generator().manual_seed(batch)
    bs, nb = 4, 6
    kv_shape = (batch * nb + 2, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.randn(kv_shape, generator=g).bfloat16(), torch.randn(kv_shape, generator=g).bfloat16())]
    ref_caches = [(caches[0][0].float(), caches[0][1].float())]
    tables = torch.randperm(kv_shape[0], generator=g)[: batch * nb].view(batch, nb)
    lens = torch.randint(2, nb * bs + 1, (batch,), generator=g)
    pos = lens - 1
    slots = torch.cat([slot_mapping(t, p, p + 1, bs) for t, p in zip(tables.tolist(), pos.tolist())])
    meta = AttentionMetadata(
        slot_mapping=slots, num_decodes=batch, decode_block_tables=tables, decode_seq_lens=lens, decode_kernel=kernels
    )
    emb = torch.cat((torch.outer(pos.float(), rope_inv_freq(cfg)),) * 2, dim=-1)
    x = torch.randn(batch, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        ref = layer(x, emb.cos().unsqueeze(1), emb.sin().unsqueeze(1), ref_caches, meta)
        got = layer.fused.forward(x, emb.cos(), emb.sin(), caches[0][0], caches[0][1], slots, tables, lens)
    assert caches[0][0].dtype == torch.bfloat16
    for c, r in zip(caches[0], ref_caches[0]):
        torch.testing.assert_close(c, r.to(torch.bfloat16), rtol=0, atol=0)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2


@needs_kernels
def test_int8_mode_keeps_products_wider_than_its_kernel_on_fp32_activations():
    """A big model's down_proj (K > 8192: Llama-2-7B's is 11008) cannot take the int8
    kernel: int8 mode keeps that product on the fp32-activation kernel instead of failing
    at load, and the layer then runs layer by layer (the fused layer takes one mode)."""
    from pdserve.engine.model import Q8_MAX_K, Linear

    k = Q8_MAX_K + 32
    w = np.random.default_rng(3).standard_normal((8, k)).astype(np.float32)
    t = gguf.GGMLQuantizationType.Q4_1
    raw = gguf.quants.quantize(w, t)
    wide, narrow = Linear(k, 8, bias=False), Linear(Q8_MAX_K, 8, bias=False)
    assert wide.set_quantized([(int(t), torch.from_numpy(raw))], kernels, int8_activations=True)
    assert not wide.int8_activations
    x = torch.randn(2, k)
    torch.testing.assert_close(wide(x), kernels.gguf_matmul(x, torch.from_numpy(raw), int(t), k))
    raw_n = gguf.quants.quantize(w[:, :Q8_MAX_K].copy(), t)
    assert narrow.set_quantized([(int(t), torch.from_numpy(raw_n))], kernels, int8_activations=True)
    assert narrow.int8_activations  # the widest the kernel takes still gets it

    cfg, layer = _quantized_layer("Q4_1", False, int8=True, intermediate_size=k)
    assert layer.fused is None and not layer.down_proj.int8_activations and layer.gate_up_proj.int8_activations
    h = torch.randn(3, k)
    torch.testing.assert_close(layer.down_proj(h), h @ layer.down_proj.weight.T, rtol=1e-4, atol=1e-3)


@pytest.mark.integration
@needs_kernels
def test_fused_decode_gives_the_same_tokens_as_layer_by_layer(real_model_path):
    llm = LLM(dtype="float32")
    model = llm.engine.runner.model
    assert model.fused_ready
    prompts = ["What is the capital of France? Answer in one sentence.", "1, 2, 3, 4,", "Write a haiku."]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    model.fused_ready = False
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == fused


@pytest.mark.integration
@needs_kernels
def test_greedy_tokens_do_not_depend_on_the_thread_count(real_model_path):
    """The kernels split rows, heads and context pieces over the pool's threads; each
    output is still summed in one order, so greedy tokens must not change with the
    thread count (3 on this 2-core CI: helpers get descheduled mid-loop). The long
    prompt runs the dense path and attention split into context pieces."""
    prompts = [
        "What is the capital of France? Answer in one sentence.",
        "1, 2, 3, 4,",
        "Summarise: " + "the quick brown fox jumps over the lazy dog. " * 40,
    ]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    old = torch.get_num_threads()
    try:
        outs = {}
        for threads in (1, 2, 3):
            llm = LLM(dtype="float32", threads=threads)
            outs[threads] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert outs[2] == outs[1] and outs[3] == outs[1]
    finally:
        torch.set_num_threads(old)


@needs_kernels
def test_a_build_killed_midway_does_not_block_later_starts(tmp_path):
    """torch's builder leaves its `lock` file behind when killed mid-build; without the
    fcntl guard every later load waited for that file forever."""
    import os
    import shutil
    import subprocess
    import sys

    csrc = os.path.join(os.path.dirname(cpu_kernels.__file__), "csrc")
    built = cpu_kernels._default_cache_dir([os.path.join(csrc, f) for f in cpu_kernels._SOURCES])
    cache = tmp_path / "kernels"
    shutil.copytree(built, cache, ignore=shutil.ignore_patterns("lock", "pdserve-build.lock"))
    (cache / "lock").write_text("")  # as a killed build leaves it
    code = "import sys; from pdserve.engine import cpu_kernels; sys.exit(cpu_kernels.load() is None)"
    r = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PDSERVE_KERNEL_CACHE": str(cache)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "left by a kernel build that did not finish" in r.stderr
    assert not (cache / "lock").exists()


@pytest.mark.parametrize("rows", [17, 64, 300])
def test_packed_bf16_linear_matches_the_plain_gemm(rows):
    """bf16 weights kept in oneDNN's blocked layout (`Linear.pack_dense`) give the plain
    GEMM's product, up to the summation order of a bf16 result."""
    from pdserve.engine.model import Linear

    g = torch.Generator().manual_seed(rows)
    lin = Linear(576, 960, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(960, 576, generator=g) / 24)
        lin.bias.copy_(torch.randn(960, generator=g))
    x = torch.randn(rows, 576, generator=g).to(torch.bfloat16)
    plain = lin(x)
    if not lin.pack_dense():
        pytest.skip("this torch build has no oneDNN packed linear")
    packed = lin(x)
    assert packed.dtype == torch.bfloat16 and packed.shape == plain.shape
    torch.testing.assert_close(packed.float(), plain.float(), rtol=1e-2, atol=1e-2)
