"""`pdserve convert` writes a Hugging Face directory that transformers and pdserve load as-is."""

import json
import os

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("hf") / "smollm2")
    assert main(["convert", "--out", out]) == 0
    return out


def test_files_written(converted):
    names = set(os.listdir(converted))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.load(open(os.path.join(converted, "config.json")))
    assert cfg["num_hidden_layers"] == 30 and cfg["num_key_value_heads"] == 3
    assert "chat_template" in json.load(open(os.path.join(converted, "tokenizer_config.json")))


def test_transformers_loads_it_and_agrees(converted):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(converted)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    msgs = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    if not isinstance(ids, torch.Tensor):
        ids = ids["input_ids"]
    out = model.generate(ids, max_new_tokens=10, do_sample=False, attention_mask=torch.ones_like(ids))
    ours = LLM(converted, dtype="float32")
    res = ours.chat(msgs, SamplingParams(temperature=0, max_tokens=10))[0]
    assert res.prompt_token_ids == ids[0].tolist()  # same tokenizer and template
    assert res.outputs[0].token_ids == out[0, ids.shape[1] :].tolist()[: len(res.outputs[0].token_ids)]
    assert "Paris" in res.outputs[0].text


def test_tokenizer_matches_transformers_on_tricky_text(converted, real_model_path):
    transformers = pytest.importorskip("transformers")
    from pdserve.engine.loader import load_model
    from pdserve.engine.tokenizer import Tokenizer

    ours = Tokenizer.from_loaded(load_model(real_model_path))
    d, f = os.path.split(real_model_path)
    ref = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    for text in [
        "Hello world 12345",
        "  spaces\tand\nnewlines\n\n",
        "naïve café 你好 🙂",
        "<|im_start|>user\nhi<|im_end|>",
        "x=3.14159; y = x**2 // 7",
    ]:
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
