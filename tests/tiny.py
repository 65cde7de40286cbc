"""A tiny random-weight Llama written as a Hugging Face directory, for fast unit tests."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIAL = ["<|im_start|>", "<|im_end|>", "<unk>"]
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
) -> str:
    """`logit_scale` > 1 sharpens the output distribution: fewer near-ties, so greedy
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
    cfg = {
        "architectures": ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"],
        "model_type": "qwen2" if qkv_bias else "llama",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_pos,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
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

    hd = hidden // heads
    state = {
        "model.embed_tokens.weight": rnd(vocab_size, hidden, scale=0.5),
        "model.norm.weight": 1 + rnd(hidden),
        "lm_head.weight": rnd(vocab_size, hidden, scale=0.5 * logit_scale),
    }
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
