"""The CPU kernels against plain PyTorch on the same numbers, and the fallback without them."""
import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.engine import cpu_kernels
from pdserve.engine.attention import gather_kv
from pdserve.engine.gguf_dequant import dequantize

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


@needs_kernels
@pytest.mark.parametrize("threads", [2, 4])
def test_parallel_loop_runs_every_index_once_before_returning(threads):
    """pool.h under stress: chunk counts that change from loop to loop, more threads
    than cores (so helpers get descheduled mid-claim). A helper late from one loop
    once claimed a chunk of the next and the loop returned early (CI: a fused layer
    read half-written rows)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert kernels.pool_check(4096, 256, 100_000, 0) == 0
        assert kernels.pool_check(4096, 256, 5_000, 5) == 0
    finally:
        torch.set_num_threads(old)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_sdpa(dtype):
    g = torch.Generator().manual_seed(0)
    b, h, kvh, d, bs = 5, 6, 2, 32, 4
    lens = torch.tensor([1, 3, 4, 9, 17])
    nb = int((lens.max() + bs - 1) // bs)
    num_blocks = b * nb + 3
    kc = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, kvh, d, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[:b * nb].view(b, nb)
    q = torch.randn(b, h, d, generator=g).to(dtype)
    out = torch.empty_like(q)
    kernels.paged_decode_attention(out, q, kc, vc, tables, lens, d ** -0.5)
    mask = (torch.arange(nb * bs)[None, :] < lens[:, None])[:, None, None, :]
    ref = F.scaled_dot_product_attention(q.view(b, kvh, h // kvh, d).float(), gather_kv(kc, tables).float(),
                                         gather_kv(vc, tables).float(), attn_mask=mask).reshape(b, h, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)


def test_pure_pytorch_fallback_gives_the_same_tokens(tiny_model_dir, monkeypatch):
    prompts = ["hello world", "a longer prompt that spans several blocks"]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    with_kernels = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    without = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64)
    assert without.engine.runner.decode_kernel is None
    assert [o.outputs[0].token_ids for o in with_kernels.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in without.generate(prompts, params)]


@needs_kernels
def test_embedded_model_uses_its_gguf_blocks(real_model_path):
    llm = LLM(dtype="float32")
    # 4 fused linears per layer x 30 layers + the tied Q8_0 output head
    assert llm.engine.runner.num_quantized_linears == 121


def _quantized_layer(qtype: str, bias: bool):
    from pdserve.config import ModelConfig
    from pdserve.engine.model import DecoderLayer

    cfg = ModelConfig(vocab_size=64, hidden_size=128, intermediate_size=96, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=bias)
    layer = DecoderLayer(cfg, 0)
    rng = np.random.default_rng(1)
    t = gguf.GGMLQuantizationType[qtype]
    for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        w = rng.standard_normal(tuple(lin.weight.shape)).astype(np.float32) * 0.1
        raw = gguf.quants.quantize(w, t)
        with torch.no_grad():
            lin.weight.copy_(dequantize(raw.reshape(-1), qtype, w.size).view(lin.weight.shape))
            if lin.bias is not None:
                lin.bias.normal_()
        assert lin.set_quantized([(int(t), torch.from_numpy(raw))], kernels)
    with torch.no_grad():
        layer.input_layernorm.weight.uniform_(0.5, 1.5)
        layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    assert layer.make_fused(kernels, cfg)
    return cfg, layer


@needs_kernels
@pytest.mark.parametrize("qtype,bias", [("Q4_1", False), ("Q4_0", True), ("Q8_0", False)])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_fused_decode_layer_matches_the_python_layer(qtype, bias, batch):
    """One C++ call per layer computes what the layer's Python forward computes, KV writes included."""
    from pdserve.engine.attention import AttentionMetadata
    from pdserve.engine.model import rope_inv_freq

    cfg, layer = _quantized_layer(qtype, bias)
    g = torch.Generator().manual_seed(batch)
    bs, nb = 4, 6
    kv_shape = (batch * nb + 2, bs, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.randn(kv_shape, generator=g), torch.randn(kv_shape, generator=g))]
    ref_caches = [(caches[0][0].clone(), caches[0][1].clone())]
    tables = torch.randperm(kv_shape[0], generator=g)[:batch * nb].view(batch, nb)
    lens = torch.randint(1, nb * bs + 1, (batch,), generator=g)
    pos = lens - 1
    slots = tables[torch.arange(batch), pos // bs] * bs + pos % bs
    meta = AttentionMetadata(slot_mapping=slots, num_decodes=batch, decode_block_tables=tables,
                             decode_seq_lens=lens, decode_kernel=kernels)
    inv = rope_inv_freq(cfg)
    emb = torch.cat((torch.outer(pos.float(), inv),) * 2, dim=-1)
    x = torch.randn(batch, cfg.hidden_size, generator=g)
    with torch.inference_mode():
        ref = layer(x, emb.cos().unsqueeze(1), emb.sin().unsqueeze(1), ref_caches, meta)
        got = layer.fused.forward(x, emb.cos(), emb.sin(), caches[0][0], caches[0][1], slots, tables, lens)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][0], ref_caches[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[0][1], ref_caches[0][1], rtol=1e-5, atol=1e-5)


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
