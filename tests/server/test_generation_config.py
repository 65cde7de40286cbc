"""The model's generation_config.json gives requests their default sampling parameters, as in
vLLM: fields a request sets win, max_new_tokens caps max_tokens; --generation-config vllm and
--override-generation-config change where they come from."""

import json
import os

import pytest

from pdserve import LLM, SamplingParams
from pdserve.config import ConfigError
from pdserve.engine.generation_config import sampling_defaults
from tests.server.conftest import TINY_ENGINE, engine_flags
from tests.server.serverproc import ServerProcess

GEN = {"temperature": 0.0, "top_k": 5, "max_new_tokens": 4, "do_sample": True, "bos_token_id": 1}
USER = [{"role": "user", "content": "what is 2 + 2?"}]


@pytest.fixture(scope="module")
def gen_model(tmp_path_factory):
    from tests.tiny import write_tiny_model

    d = write_tiny_model(str(tmp_path_factory.mktemp("gen")))
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(GEN, f)
    return d


def test_the_defaults_read_and_checked(gen_model, tmp_path):
    assert sampling_defaults(gen_model) == {"temperature": 0.0, "top_k": 5, "max_tokens": 4}
    assert sampling_defaults(gen_model, "vllm") == {}
    assert sampling_defaults(gen_model, overrides='{"temperature": 0.7}')["temperature"] == 0.7
    assert sampling_defaults(None) == {}  # the embedded GGUF has no such file
    for source, overrides, match in [
        (gen_model, '{"temprature": 1}', "unknown"),
        (gen_model, "{not json", "not JSON"),
        (gen_model, '{"top_p": 7}', "top_p"),
        (str(tmp_path), None, "no generation_config.json"),
    ]:
        with pytest.raises(ConfigError, match=match):
            sampling_defaults(gen_model, source if source != gen_model else "auto", overrides)


def test_offline_defaults(gen_model):
    llm = LLM(gen_model, **TINY_ENGINE)
    assert llm.get_default_sampling_params().max_tokens == 4
    out = llm.generate([[5, 6, 7]])[0].outputs[0]
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0]
    assert out.token_ids == greedy.token_ids
    plain = LLM(gen_model, generation_config="vllm", **TINY_ENGINE)
    assert plain.get_default_sampling_params() == SamplingParams()
    # a max_new_tokens past the context is the context, not a refusal of every request
    big = LLM(gen_model, override_generation_config={"max_new_tokens": 10**6}, **TINY_ENGINE)
    assert big.get_default_sampling_params().max_tokens == big.engine.max_model_len
    assert big.generate([[5, 6, 7]], SamplingParams(**{**big._defaults, "max_tokens": 3}))[0].outputs[0].token_ids


@pytest.mark.integration
def test_the_server_applies_them(gen_model):
    openai = pytest.importorskip("openai")
    offline = LLM(gen_model, **TINY_ENGINE)
    prompt = offline.tokenizer.apply_chat_template(USER)
    greedy = offline.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))[0].outputs[0].text
    with (
        ServerProcess("--model", gen_model, "--served-model-name", "tiny", *engine_flags(**TINY_ENGINE)) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        r = client.chat.completions.create(model="tiny", messages=USER)  # no temperature, no max_tokens
        assert r.usage.completion_tokens == 4 and r.choices[0].message.content == greedy
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=50)  # capped, as vLLM
        assert r.usage.completion_tokens == 4
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, temperature=1.0, seed=3)
        assert r.usage.completion_tokens == 2  # what the request sets wins
        assert "generation config" in server.log()
    flags = ("--override-generation-config", '{"max_new_tokens": 1000000}', *engine_flags(**TINY_ENGINE))
    with (
        ServerProcess("--model", gen_model, "--served-model-name", "tiny", *flags) as server,
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client,
    ):
        r = client.completions.create(model="tiny", prompt="hi", extra_body={"max_tokens": None})
        assert r.usage.completion_tokens >= 1  # served up to the context, not refused
