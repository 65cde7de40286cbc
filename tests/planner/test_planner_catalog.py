"""The catalogs: shapes agree with published parameter counts, every figure
has a source, names resolve, and a Hugging Face config.json loads."""

import json

import pytest

from pdserve.planner.hardware import GPU_ALIASES, GPUS, resolve_gpu
from pdserve.planner.models import (
    MODEL_ALIASES,
    MODELS,
    load_hf_config,
    model_from_hf_config,
    param_count,
    resolve_model,
)

REQUIRED_MODELS = [
    "llama-2-7b",
    "llama-2-13b",
    "llama-2-70b",
    "llama-3-8b",
    "llama-3-70b",
    "llama-3-405b",
    "qwen2.5-7b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-32b",
    "mistral-7b",
    "deepseek-v2",
    "deepseek-v3",
    "smollm2-135m",
]
REQUIRED_GPUS = [
    "h100-sxm",
    "h800",
    "h20",
    "h200",
    "a100-40gb",
    "a100-80gb",
    "l40s",
    "rtx-4090",
    "l4",
    "ascend-910b",
    "cpu-local",
]


def test_catalogs_hold_every_required_entry_with_a_source():
    assert set(REQUIRED_MODELS) <= set(MODELS)
    assert set(REQUIRED_GPUS) <= set(GPUS)
    for entry in [*MODELS.values(), *GPUS.values()]:
        assert entry.source, entry.name


@pytest.mark.parametrize("name", REQUIRED_MODELS)
def test_derived_params_match_published(name):
    m = MODELS[name]
    assert param_count(m) == pytest.approx(m.published_params, rel=0.005)


@pytest.mark.parametrize("name, active", [("deepseek-v2", 21e9), ("deepseek-v3", 37e9)])
def test_moe_active_params_match_published(name, active):
    assert param_count(MODELS[name], active=True) == pytest.approx(active, rel=0.03)


def test_names_resolve_case_and_dash_insensitively():
    assert resolve_model("Llama-3.1-70B") is MODELS["llama-3-70b"]
    assert resolve_model("LLAMA_3_70B") is MODELS["llama-3-70b"]
    assert resolve_gpu("H100") is GPUS["h100-sxm"]
    assert resolve_gpu("4090") is GPUS["rtx-4090"]
    for alias, name in {**MODEL_ALIASES}.items():
        assert resolve_model(alias) is MODELS[name]
    for alias, name in GPU_ALIASES.items():
        assert resolve_gpu(alias) is GPUS[name]


def test_unknown_names_list_the_known_ones():
    with pytest.raises(ValueError, match="llama-3-70b.*smollm2-135m"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="h100-sxm.*ascend-910b"):
        resolve_gpu("b200")


SMOLLM2_CONFIG = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def test_hf_config_path_loads_like_the_catalog_row(tmp_path):
    model_dir = tmp_path / "SmolLM2-135M-Instruct"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    for path in (model_dir, model_dir / "config.json"):
        m = resolve_model(str(path))
        assert m.name == "SmolLM2-135M-Instruct"
        assert param_count(m) == param_count(MODELS["smollm2-135m"])
        assert (m.layers, m.kv_heads, m.head_dim) == (30, 3, 64)
    assert load_hf_config(str(model_dir)).tied_embeddings


def test_hf_config_deepseek_fields_give_mla_and_moe():
    cfg = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
    }
    m = model_from_hf_config(cfg, name="dsv3")
    assert m.is_mla and m.is_moe and m.attention_kind == "MLA"
    assert param_count(m) == param_count(MODELS["deepseek-v3"])


def test_hf_config_missing_field_is_a_clear_error():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        model_from_hf_config({"hidden_size": 8, "num_attention_heads": 1})
