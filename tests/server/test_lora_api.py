"""LoRA adapters through the OpenAI API: a request names an adapter as its model, collocated
and through a router with prefill and decode workers, and gets what the offline engine gives
with that adapter; /v1/models lists the adapters under their base model."""

import pytest

from pdserve import LLM, LoRARequest, SamplingParams
from tests.server.conftest import TINY_ENGINE, tiny_openai
from tests.server.deployment import Deployment

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

PROMPTS = ["hello world, this is", "the quick brown fox jumps over the lazy dog and"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(server_model_dir, tmp_path_factory):
    from tests.tiny import write_tiny_lora

    d = tmp_path_factory.mktemp("api-adapters")
    return {
        "sql": write_tiny_lora(server_model_dir, str(d / "sql"), seed=11),
        "chat": write_tiny_lora(server_model_dir, str(d / "chat"), r=4, targets=("q_proj", "v_proj"), seed=12),
    }


@pytest.fixture(scope="module")
def expected(server_model_dir, adapters):
    """Greedy completions of PROMPTS offline: base model and each adapter."""
    llm = LLM(server_model_dir, enable_lora=True, max_loras=2, **TINY_ENGINE)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = {"tiny": [o.outputs[0].text for o in llm.generate(PROMPTS, greedy)]}
    for i, (name, path) in enumerate(adapters.items()):
        outs = llm.generate(PROMPTS, greedy, lora_request=LoRARequest(name, i + 1, path))
        out[name] = [o.outputs[0].text for o in outs]
    assert len({tuple(v) for v in out.values()}) == 3  # each adapter changes the text
    llm.close()
    return out


def _lora_flags(adapters):
    return ["--enable-lora", "--max-loras", "2", "--lora-modules", *(f"{n}={p}" for n, p in adapters.items())]


def _check(client, expected):
    args = dict(max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True})
    for model in ("tiny", "sql", "chat"):
        for prompt, text in zip(PROMPTS, expected[model]):
            r = client.completions.create(model=model, prompt=prompt, **args)
            assert (r.choices[0].text, r.model) == (text, model)
        stream = client.completions.create(model=model, prompt=PROMPTS[0], stream=True, **args)
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == expected[model][0]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x", max_tokens=2)


def test_adapters_by_model_name_collocated(server_model_dir, adapters, expected):
    with tiny_openai(server_model_dir, *_lora_flags(adapters)) as client:
        cards = {m.id: m for m in client.models.list().data}
        assert list(cards) == ["tiny", "sql", "chat"]
        assert cards["sql"].parent == "tiny" and cards["chat"].root == "chat"
        assert client.models.retrieve("sql").id == "sql"
        _check(client, expected)


@pytest.mark.integration
def test_adapters_through_router_prefill_and_decode(server_model_dir, adapters, expected):
    """The prefill worker computes the prompt with the adapter, the decode worker continues
    with it; the router lists what the workers registered."""
    dep = Deployment(server_model_dir, "--served-model-name", "tiny", *_lora_flags(adapters), num_gpu_blocks=512)
    try:
        with openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
            assert [m.id for m in client.models.list().data] == ["tiny", "chat", "sql"]
            _check(client, expected)
        features = {w: sorted(info["features"]) for w, info in dep.workers().items()}
        assert all(sum(f.startswith("lora:") for f in fs) == 2 for fs in features.values()), features
    finally:
        assert dep.stop() == 0
