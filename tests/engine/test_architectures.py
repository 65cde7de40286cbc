"""Each architecture the engine runs, from a Hugging Face directory and from a GGUF file, against
transformers on the same weights; and the models it must refuse rather than answer garbage for."""

import json
import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.engine.loader import ModelLoadError, load_model, load_model_info
from tests.tiny import TINY_GREEDY as GREEDY
from tests.tiny import TINY_PROMPTS as PROMPTS
from tests.tiny import llama3_rope_divisors, write_tiny_gguf, write_tiny_model

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# name -> write_tiny_model's arguments; head_dim 16 puts Llama 3's RoPE divisors in all three bands
SHAPES = {
    "qwen3": dict(arch="qwen3", head_dim=32),  # head_dim != hidden / heads, as in Qwen3's releases
    "qwen3-tied": dict(arch="qwen3", head_dim=16, tie=True),
    "llama3-rope": dict(arch="llama", heads=4, kv_heads=1, rope_scaling=LLAMA3_ROPE),
}


def hf_greedy(model_dir, prompt_ids, n=12):
    ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in prompt_ids:
        x = torch.tensor([ids])
        r = ref.generate(x, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(r[0, x.shape[1] :].tolist())
    return out


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("shape", list(SHAPES))
def test_hf_directory_matches_transformers(tmp_path, shape):
    d = write_tiny_model(str(tmp_path / "m"), seed=3, logit_scale=3.0, **SHAPES[shape])
    llm = LLM(d, dtype="float32", block_size=4, num_gpu_blocks=128)
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == hf_greedy(d, [o.prompt_token_ids for o in outs])
    # the same through chunked prefill and prefix-cache hits
    chunked = LLM(d, dtype="float32", block_size=4, num_gpu_blocks=128, max_num_batched_tokens=16)
    chunked.generate(PROMPTS, GREEDY)
    again = chunked.generate(PROMPTS, GREEDY)
    assert chunked.engine.block_manager.stats.hits_tokens > 0
    assert tokens(again) == tokens(outs)


@pytest.mark.parametrize("shape", ["qwen3", "llama3-rope"])
def test_gguf_file_matches_transformers(tmp_path, shape):
    """A GGUF file of the architecture (Q8_0 blocks: the decode steps run the fused C++ layer on
    them) against transformers on its dequantized weights (`pdserve convert`'s directory)."""
    from pdserve.engine.convert import convert

    kw = SHAPES[shape]
    d = write_tiny_model(str(tmp_path / "m"), seed=5, logit_scale=3.0, **kw)
    divisors = llama3_rope_divisors(16, 10000.0, LLAMA3_ROPE) if kw.get("rope_scaling") else None
    assert divisors is None or 1.0 < min(d for d in divisors if d != 1.0) < max(divisors) == 8.0
    gguf = write_tiny_gguf(d, str(tmp_path / "m.gguf"), rope_freqs=divisors)
    llm = LLM(gguf, dtype="float32", block_size=4, num_gpu_blocks=128)
    assert llm.engine.runner.model.fused_ready  # every linear on the GGUF blocks, decode fused
    loaded = load_model(gguf)
    assert loaded.config.qk_norm == (kw["arch"] == "qwen3")
    assert loaded.config.rope_scaling == kw.get("rope_scaling")
    outs = llm.generate(PROMPTS, GREEDY)
    ref_dir = convert(gguf, str(tmp_path / "converted"))
    assert json.load(open(os.path.join(ref_dir, "config.json")))["model_type"] == kw["arch"]
    assert tokens(outs) == hf_greedy(ref_dir, [o.prompt_token_ids for o in outs])


def test_qwen3_bf16_fused_elementwise_path_normalises_q_and_k(tmp_path):
    """bf16 mode's fused elementwise path (norms, RoPE and SiLU in C++, or Triton on a GPU) gives
    what the layer-by-layer PyTorch path gives, q/k norms included."""
    d = write_tiny_model(str(tmp_path / "m"), seed=3, logit_scale=3.0, **SHAPES["qwen3"])
    fused = LLM(d, dtype="bfloat16", block_size=4, num_gpu_blocks=128)
    assert fused.engine.runner.model.elementwise_kernels(torch.zeros(1, 8, dtype=torch.bfloat16)) is not None
    plain = LLM(d, dtype="bfloat16", block_size=4, num_gpu_blocks=128)
    plain.engine.runner.model.fused_elementwise = False
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    for prompt in PROMPTS:
        a = fused.generate(prompt, params)[0].prompt_logprobs[1:]
        b = plain.generate(prompt, params)[0].prompt_logprobs[1:]
        diffs = [abs(next(iter(x.values())).logprob - next(iter(y.values())).logprob) for x, y in zip(a, b)]
        assert max(diffs, default=0) < 0.05, diffs  # without the norms: whole nats off (the test below)


def test_qwen3_without_its_norms_differs(tmp_path):
    """The q/k norms change the output (the parity above would not notice a model that skips them
    only if they did nothing)."""
    d = write_tiny_model(str(tmp_path / "m"), seed=3, logit_scale=3.0, **SHAPES["qwen3"])
    with_norms = tokens(LLM(d, dtype="float32", block_size=4, num_gpu_blocks=64).generate(PROMPTS, GREEDY))
    llm = LLM(d, dtype="float32", block_size=4, num_gpu_blocks=64)
    for layer in llm.engine.runner.model.layers:
        layer.q_norm.weight.data.fill_(1.0)
        layer.k_norm.weight.data.fill_(1.0)
    assert tokens(llm.generate(PROMPTS, GREEDY)) != with_norms


def _edit_config(d, **changes):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"architectures": ["GemmaForCausalLM"]}, "unsupported architecture 'GemmaForCausalLM'"),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "unsupported architecture"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"use_sliding_window": True}, "sliding-window"),
        ({"num_local_experts": 8}, "mixture-of-experts"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling 'yarn'"),
    ],
)
def test_unsupported_models_are_refused(tmp_path, changes, message):
    d = write_tiny_model(str(tmp_path / "m"))
    _edit_config(d, **changes)
    with pytest.raises(ModelLoadError, match=message):
        LLM(d, dtype="float32", block_size=4, num_gpu_blocks=16)
    with pytest.raises(ModelLoadError, match=message):
        load_model_info(d)  # the router's look at the model refuses it too


def test_weights_the_engine_would_ignore_are_refused(tmp_path):
    """A Qwen3 checkpoint labelled Llama: loaded, its q/k norms would be dropped without a word."""
    d = write_tiny_model(str(tmp_path / "m"), **SHAPES["qwen3"])
    _edit_config(d, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(ModelLoadError, match="does not compute: model.layers.0.self_attn.k_norm.weight"):
        load_model(d)
    d2 = write_tiny_model(str(tmp_path / "m2"), arch="qwen3", head_dim=32)
    from safetensors.torch import load_file, save_file

    state = load_file(os.path.join(d2, "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, os.path.join(d2, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="missing weights: model.layers.1.mlp.up_proj.weight"):
        load_model(d2)


def test_gguf_rope_divisors_of_another_scaling_are_refused(tmp_path):
    d = write_tiny_model(str(tmp_path / "m"), arch="llama")
    gguf = write_tiny_gguf(d, str(tmp_path / "m.gguf"), rope_freqs=[1.0, 2.0, 3.0, 1.5, 1.0, 1.0, 1.0, 1.0])
    with pytest.raises(ModelLoadError, match="unknown scaling"):
        load_model(gguf)


def test_mistral_sliding_window_bounds_the_context(tmp_path):
    """Mistral 7B v0.1 attends to its last 4,096 tokens; this engine attends to all, the same
    computation only while the context fits the window, so the window bounds the context."""
    d = write_tiny_model(str(tmp_path / "m"))
    _edit_config(d, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=128)
    assert load_model_info(d).config.max_position_embeddings == 128
    _edit_config(d, sliding_window=None)
    assert load_model_info(d).config.max_position_embeddings == 512


def test_transformers_5_config_reads_rope_parameters(tmp_path):
    """transformers 5 saves RoPE's theta and scaling under `rope_parameters`; read with the old
    names only, a Llama 3 fine-tune saved today would run with theta 10,000 and no scaling."""
    d = write_tiny_model(str(tmp_path / "m"), seed=3, logit_scale=3.0, rope_scaling=LLAMA3_ROPE)
    ref = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    saved = str(tmp_path / "saved")
    ref.save_pretrained(saved)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.link(os.path.join(d, f), os.path.join(saved, f))
    cfg = json.load(open(os.path.join(saved, "config.json")))
    assert "rope_scaling" not in cfg and cfg["rope_parameters"]["rope_type"] == "llama3"
    _edit_config(saved, rope_parameters={**cfg["rope_parameters"], "rope_theta": 50000.0})
    config = load_model_info(saved).config
    assert config.rope_theta == 50000.0 and config.rope_scaling == LLAMA3_ROPE
    llm = LLM(saved, dtype="float32", block_size=4, num_gpu_blocks=128)
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens(outs) == hf_greedy(saved, [o.prompt_token_ids for o in outs])
