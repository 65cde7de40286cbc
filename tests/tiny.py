"""A tiny random-weight Llama written as a Hugging Face directory, for fast unit tests."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pdserve import SamplingParams

SPECIAL = ["<|im_start|>", "<|im_end|>", "<unk>"]
# what the engine tests run on the tiny models: a few lengths, greedy, a fixed number of tokens
TINY_PROMPTS = [
    "hello world",
    "a much longer prompt that spans several kv blocks of four tokens",
    "x",
    "the quick brown fox jumps over the lazy dog " * 3,
]
TINY_GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_model(
    path: str,
    *,
    layers=2,
    hidden=64,
    heads=4,
    kv_heads=2,
    inter=128,
    max_pos=512,
    qkv_bias=False,
    seed=0,
    logit_scale=1.0,
    added_tokens=(),
    arch=None,
    head_dim=None,
    rope_scaling=None,
    tie=False,
) -> str:
    """`arch`: "llama" (default), "qwen2" (as qkv_bias=True: q, k, v biases) or "qwen3" (a norm
    over each head of q and k, `head_dim` free of hidden / heads as in Qwen3's releases).
    `logit_scale` > 1 sharpens the output distribution: fewer near-ties, so greedy
    choices survive the tiny numeric differences between a decode and a recompute.
    `added_tokens`: single tokens after the special ones that, unlike those, stay in decoded
    text (a reasoning model's "<think>", "</think>", as DeepSeek-R1's and Qwen3's tokenizers have them)."""
    os.makedirs(path, exist_ok=True)
    # byte-level vocabulary: the 256 byte symbols, then the special tokens
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for s in SPECIAL + list(added_tokens):
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.add_tokens(list(added_tokens))
    tok.save(os.path.join(path, "tokenizer.json"))
    vocab_size = len(vocab)
    eos = vocab["<|im_end|>"]
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}, f)
    arch = arch or ("qwen2" if qkv_bias else "llama")
    qkv_bias = arch == "qwen2"
    hd = head_dim or hidden // heads
    cfg = {
        "architectures": [
            {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
        ],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "head_dim": hd,
        "tie_word_embeddings": tie,
        "eos_token_id": eos,
        "bos_token_id": vocab["<|im_start|>"],
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.08):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    state = {
        "model.embed_tokens.weight": rnd(vocab_size, hidden, scale=0.5),
        "model.norm.weight": 1 + rnd(hidden),
    }
    if not tie:
        state["lm_head.weight"] = rnd(vocab_size, hidden, scale=0.5 * logit_scale)
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": 1 + rnd(hidden),
                p + "post_attention_layernorm.weight": 1 + rnd(hidden),
                p + "self_attn.q_proj.weight": rnd(heads * hd, hidden),
                p + "self_attn.k_proj.weight": rnd(kv_heads * hd, hidden),
                p + "self_attn.v_proj.weight": rnd(kv_heads * hd, hidden),
                p + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
                p + "mlp.gate_proj.weight": rnd(inter, hidden),
                p + "mlp.up_proj.weight": rnd(inter, hidden),
                p + "mlp.down_proj.weight": rnd(hidden, inter),
            }
        )
        if qkv_bias:
            for n, size in (("q", heads * hd), ("k", kv_heads * hd), ("v", kv_heads * hd)):
                state[p + f"self_attn.{n}_proj.bias"] = rnd(size)
        if arch == "qwen3":
            state[p + "self_attn.q_norm.weight"] = 1 + rnd(hd, scale=0.3)
            state[p + "self_attn.k_norm.weight"] = 1 + rnd(hd, scale=0.3)
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_tiny_lora(model_dir: str, path: str, *, r=8, alpha=16, targets=LORA_TARGETS, seed=1, scale=0.3, **cfg) -> str:
    """A PEFT LoRA adapter of the model in `model_dir`, saved as PEFT saves one (adapter_config.json,
    adapter_model.safetensors), with random A and B (PEFT starts B at zero: no change to learn from)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), **cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(path)
    return path


def peft_model(model_dir: str, adapter_dir: str):
    """transformers' model with the adapter applied by PEFT: the reference for pdserve's LoRA."""
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(base, adapter_dir).eval()


def llama3_rope_divisors(head_dim: int, theta: float, scaling: dict) -> list[float]:
    """The per-frequency RoPE divisors llama.cpp's converter writes as `rope_freqs.weight` for a
    Llama 3.x model (computed its way, from the Hugging Face `rope_scaling`)."""
    import math

    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old_len / high:
            out.append(1.0)
        elif wavelen > old_len / low:
            out.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_tiny_gguf(model_dir: str, path: str, *, qtype: str = "Q8_0", rope_freqs: list[float] | None = None) -> str:
    """The tiny model in `model_dir` (write_tiny_model's) as llama.cpp's converter writes a GGUF file:
    its architecture's metadata, the byte-level BPE vocabulary, q/k rows permuted for llama, the
    matrices in the block format `qtype` (Q8_0, Q4_0, Q4_1 or F32) and the norms in F32.
    `rope_freqs`: a Llama 3.x file's RoPE divisors (`llama3_rope_divisors`)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    arch = cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    added = {a["content"]: a for a in tok.get("added_tokens", [])}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    types = [gguf.TokenType.CONTROL if added.get(t, {}).get("special") else gguf.TokenType.NORMAL for t, _ in vocab]
    w.add_token_types([int(t) for t in types])
    w.add_token_merges([])  # the tiny vocabulary has no merges
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(json.load(open(os.path.join(model_dir, "tokenizer_config.json")))["chat_template"])

    def permute(x, n):  # llama.cpp's q/k row order for llama (interleaved RoPE pairs)
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    names = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = "output.weight"
    block_type = gguf.GGMLQuantizationType[qtype]
    for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items():
        x = t.float().numpy()
        if name in top:
            out = top[name]
        else:
            _, _, layer, *rest = name.split(".")
            out = f"blk.{layer}.{names['.'.join(rest[:-1])]}.{rest[-1]}"
        if arch == "llama" and ".attn_q." in out:
            x = permute(x, heads)
        elif arch == "llama" and ".attn_k." in out:
            x = permute(x, kv_heads)
        if x.ndim == 2 and out != "token_embd.weight" and block_type != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(np.ascontiguousarray(x), block_type), raw_dtype=block_type)
        else:
            w.add_tensor(out, np.ascontiguousarray(x, dtype=np.float32))
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
