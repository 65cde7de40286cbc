"""Model shapes as a table of named configs, plus a reader for Hugging Face
``config.json`` files.

One flat dataclass describes every model; MLA (DeepSeek) and MoE fields are
zero for models that do not use them. Parameter counts are derived from the
shapes (``param_count``), and each catalog row carries the published count so
the tests can check the derivation against it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from pdserve.planner.units import catalog_lookup

HF = "huggingface.co/{} config.json"


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (SwiGLU: gate, up, down)
    vocab: int
    max_context_tokens: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    # MLA: the cache holds a latent of kv_lora_rank plus a
    # decoupled RoPE key of qk_rope_head_dim per layer, instead of K and V.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE: the first `dense_layers` layers keep a dense MLP.
    routed_experts: int = 0
    shared_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    dense_layers: int = 0
    published_params: float = 0.0  # total, as the model card states it
    source: str = ""

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.routed_experts > 0

    @property
    def qk_dim(self) -> int:
        """Per-head width of the query-key dot product."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head_dim if self.is_mla else self.head_dim

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        return "MHA" if self.kv_heads == self.heads else "GQA"


def _llama(name, layers, hidden, heads, kv_heads, inter, vocab, ctx, params, src, head_dim=None, **kw):
    return ModelShape(
        name,
        layers,
        hidden,
        heads,
        kv_heads,
        head_dim or hidden // heads,
        inter,
        vocab,
        ctx,
        published_params=params,
        source=src,
        **kw,
    )


def _deepseek(name, layers, hidden, inter, vocab, routed, shared, top_k, moe_inter, dense, params, src):
    return ModelShape(
        name,
        layers,
        hidden,
        128,
        128,
        128,
        inter,
        vocab,
        131072,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        routed_experts=routed,
        shared_experts=shared,
        experts_per_token=top_k,
        moe_intermediate=moe_inter,
        dense_layers=dense,
        published_params=params,
        source=src,
    )


_L31 = "; Llama 3.1 keeps these shapes and raises max_position_embeddings 8,192 -> 131,072"
MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _llama(
            "llama-2-7b",
            32,
            4096,
            32,
            32,
            11008,
            32000,
            4096,
            6.74e9,
            HF.format("meta-llama/Llama-2-7b-hf") + "; params: Llama 2 paper",
        ),
        _llama(
            "llama-2-13b",
            40,
            5120,
            40,
            40,
            13824,
            32000,
            4096,
            13.0e9,
            HF.format("meta-llama/Llama-2-13b-hf") + "; params: Llama 2 paper",
        ),
        _llama(
            "llama-2-70b",
            80,
            8192,
            64,
            8,
            28672,
            32000,
            4096,
            68.98e9,
            HF.format("meta-llama/Llama-2-70b-hf") + "; params: model card (69.0B)",
        ),
        _llama(
            "llama-3-8b", 32, 4096, 32, 8, 14336, 128256, 131072, 8.03e9, HF.format("meta-llama/Meta-Llama-3-8B") + _L31
        ),
        _llama(
            "llama-3-70b",
            80,
            8192,
            64,
            8,
            28672,
            128256,
            131072,
            70.55e9,
            HF.format("meta-llama/Meta-Llama-3-70B") + _L31,
        ),
        _llama(
            "llama-3-405b",
            126,
            16384,
            128,
            8,
            53248,
            128256,
            131072,
            405.85e9,
            HF.format("meta-llama/Llama-3.1-405B") + " (405B exists only as 3.1)",
        ),
        _llama(
            "qwen2.5-7b",
            28,
            3584,
            28,
            4,
            18944,
            152064,
            32768,
            7.61e9,
            HF.format("Qwen/Qwen2.5-7B-Instruct") + "; 32K native, 128K with YaRN",
            qkv_bias=True,
        ),
        _llama(
            "qwen2.5-72b",
            80,
            8192,
            64,
            8,
            29568,
            152064,
            32768,
            72.7e9,
            HF.format("Qwen/Qwen2.5-72B-Instruct") + "; 32K native, 128K with YaRN",
            qkv_bias=True,
        ),
        _llama(
            "qwen3-8b",
            36,
            4096,
            32,
            8,
            12288,
            151936,
            32768,
            8.19e9,
            HF.format("Qwen/Qwen3-8B") + "; 32K native, 128K with YaRN (q/k norms' 9K weights not counted)",
        ),
        _llama(
            "qwen3-32b",
            64,
            5120,
            64,
            8,
            25600,
            151936,
            32768,
            32.8e9,
            HF.format("Qwen/Qwen3-32B") + "; head_dim 128 (not hidden / heads); 32K native, 128K with YaRN",
            head_dim=128,
        ),
        _llama(
            "mistral-7b",
            32,
            4096,
            32,
            8,
            14336,
            32000,
            32768,
            7.24e9,
            HF.format("mistralai/Mistral-7B-v0.1") + " (4,096-token sliding window ignored)",
        ),
        _deepseek(
            "deepseek-v2",
            60,
            5120,
            12288,
            102400,
            160,
            2,
            6,
            1536,
            1,
            236e9,
            HF.format("deepseek-ai/DeepSeek-V2") + "; 236B total / 21B active, 128K context: DeepSeek-V2 paper",
        ),
        _deepseek(
            "deepseek-v3",
            61,
            7168,
            18432,
            129280,
            256,
            1,
            8,
            2048,
            3,
            671e9,
            HF.format("deepseek-ai/DeepSeek-V3") + "; 671B total / 37B active "
            "(MTP module excluded), 128K context: DeepSeek-V3 report",
        ),
        ModelShape(
            "smollm2-135m",
            30,
            576,
            9,
            3,
            64,
            1536,
            49152,
            8192,
            tied_embeddings=True,
            published_params=134.5e6,
            source=HF.format("HuggingFaceTB/SmolLM2-135M-Instruct") + "; shapes re-read from its GGUF file",
        ),
    )
}

MODEL_ALIASES = {
    "llama-3.1-8b": "llama-3-8b",
    "llama-3.1-70b": "llama-3-70b",
    "llama-3.1-405b": "llama-3-405b",
    "smollm2": "smollm2-135m",
    "mistral-7b-v0.1": "mistral-7b",
}


def _attention_params(m: ModelShape) -> int:
    h, nh = m.hidden, m.heads
    if m.is_mla:
        q = h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * nh * m.qk_dim if m.q_lora_rank else h * nh * m.qk_dim
        kv_a = h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
        kv_b = m.kv_lora_rank * nh * (m.qk_nope_head_dim + m.v_head_dim)
        return q + kv_a + kv_b + nh * m.v_head_dim * h
    q_out = nh * m.head_dim
    kv_out = 2 * m.kv_heads * m.head_dim
    bias = q_out + kv_out if m.qkv_bias else 0
    return h * q_out + h * kv_out + bias + q_out * h


def _expert_params(m: ModelShape) -> int:
    return 3 * m.hidden * m.moe_intermediate  # SwiGLU: gate, up, down


def param_count(m: ModelShape, active: bool = False) -> int:
    """Parameters derived from the shapes; ``active=True`` counts only the
    experts a token is routed to (plus the shared ones)."""
    h = m.hidden
    per_layer = _attention_params(m) + 2 * h  # two RMSNorms
    dense_mlp = 3 * h * m.intermediate
    if m.is_moe:
        experts = m.experts_per_token if active else m.routed_experts
        moe_mlp = (experts + m.shared_experts) * _expert_params(m) + h * m.routed_experts
        mlp = m.dense_layers * dense_mlp + (m.layers - m.dense_layers) * moe_mlp
    else:
        mlp = m.layers * dense_mlp
    embeddings = m.vocab * h * (1 if m.tied_embeddings else 2)
    return m.layers * per_layer + mlp + embeddings + h


def model_from_hf_config(cfg: dict, name: str = "", source: str = "Hugging Face config.json") -> ModelShape:
    """A ModelShape from a parsed Hugging Face ``config.json`` (Llama, Qwen2,
    Mistral, Mixtral, DeepSeek-V2/V3 field names)."""

    def get(key, default=None):
        value = cfg.get(key, default)
        if value is None:
            raise ValueError(f"config.json has no {key!r}")
        return value

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    routed = cfg.get("n_routed_experts") or cfg.get("num_local_experts") or 0
    return ModelShape(
        name=name or cfg.get("_name_or_path") or cfg.get("model_type", "hf-model"),
        layers=get("num_hidden_layers"),
        hidden=hidden,
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or hidden // heads,
        intermediate=get("intermediate_size"),
        vocab=get("vocab_size"),
        max_context_tokens=cfg.get("max_position_embeddings", 0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=cfg.get("model_type") == "qwen2" or bool(cfg.get("attention_bias")),
        kv_lora_rank=cfg.get("kv_lora_rank") or 0,
        q_lora_rank=cfg.get("q_lora_rank") or 0,
        qk_rope_head_dim=cfg.get("qk_rope_head_dim") or 0,
        qk_nope_head_dim=cfg.get("qk_nope_head_dim") or 0,
        v_head_dim=cfg.get("v_head_dim") or 0,
        routed_experts=routed,
        shared_experts=cfg.get("n_shared_experts") or 0,
        experts_per_token=cfg.get("num_experts_per_tok") or 0,
        # Mixtral's experts are as wide as its intermediate_size.
        moe_intermediate=(cfg.get("moe_intermediate_size") or (get("intermediate_size") if routed else 0)),
        dense_layers=cfg.get("first_k_dense_replace") or 0,
        source=source,
    )


def load_hf_config(path: str) -> ModelShape:
    """Read a ``config.json`` file, or the one inside a model directory."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    return model_from_hf_config(cfg, name=name, source=path)


def resolve_model(name_or_path: str) -> ModelShape:
    """A catalog model by name or alias, or the config.json at a path."""
    if os.path.exists(name_or_path):
        return load_hf_config(name_or_path)
    found = catalog_lookup(name_or_path, MODELS, MODEL_ALIASES)
    if found is not None:
        return found
    raise ValueError(
        f"unknown model {name_or_path!r}; known models: {', '.join(MODELS)} "
        "(or the path of a Hugging Face config.json or model directory)"
    )
