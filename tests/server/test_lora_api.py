"""LoRA adapters through the OpenAI API: a request names an adapter as its model, collocated
and through a router with prefill and decode workers, and gets what the offline engine gives
with that adapter; /v1/models lists the adapters under their base model."""

import os
import time

import httpx
import pytest

from pdserve import LLM, LoRARequest, SamplingParams
from tests.server.conftest import TINY_ENGINE, engine_flags, tiny_openai
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
        metrics = httpx.get(str(client.base_url).removesuffix("/v1/") + "/metrics", timeout=10).text
        info = [line for line in metrics.splitlines() if line.startswith("pdserve:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info


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


def _load(client_or_url, name, path, **extra):
    return httpx.post(
        f"{client_or_url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra}, timeout=60
    )


def _unload(url, name):
    return httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def _complete(url, model):
    return httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )


def _runtime_updates(url, adapters, expected, tmp_path):
    assert _complete(url, "sql").status_code == 404
    r = _load(url, "sql", adapters["sql"])
    assert (r.status_code, r.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert _complete(url, "sql").json()["choices"][0]["text"] == expected["sql"][0]
    assert "sql" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    r = _load(url, "sql", adapters["chat"])
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert _load(url, "sql", adapters["chat"], load_inplace=True).status_code == 200
    assert _complete(url, "sql").json()["choices"][0]["text"] == expected["chat"][0]
    r = _load(url, "bad", str(tmp_path))  # no adapter there
    assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"], r.text
    assert _complete(url, "bad").status_code == 404
    assert _load(url, "tiny", adapters["sql"]).status_code == 400  # the base model's name
    assert _load(url, "a b", adapters["sql"]).status_code == 400
    assert _unload(url, "sql").status_code == 200
    assert _complete(url, "sql").status_code == 404
    assert _unload(url, "sql").status_code == 404
    assert _complete(url, "tiny").json()["choices"][0]["text"] == expected["tiny"][0]


def test_runtime_lora_updating_collocated(server_model_dir, adapters, expected, tmp_path):
    from tests.server.serverproc import ServerProcess

    flags = ["--served-model-name", "tiny", "--threads", "1", "--enable-lora", "--max-cpu-loras", "2"]
    with ServerProcess("--model", server_model_dir, *flags, *engine_flags(**TINY_ENGINE)) as server:
        assert _load(server.url, "sql", adapters["sql"]).status_code == 404  # off unless allowed
    with ServerProcess(
        "--model", server_model_dir, *flags, "--allow-runtime-lora-updating", *engine_flags(**TINY_ENGINE)
    ) as server:
        _runtime_updates(server.url, adapters, expected, tmp_path)


def _runtime_deployment(model_dir: str) -> Deployment:
    """pdserve serve (router, prefill and decode workers) with run-time adapter loading on."""
    flags = ["--served-model-name", "tiny", "--enable-lora", "--max-cpu-loras", "2", "--allow-runtime-lora-updating"]
    return Deployment(model_dir, *flags, num_gpu_blocks=512)


@pytest.mark.integration
def test_runtime_lora_updating_through_the_router(server_model_dir, adapters, expected, tmp_path):
    """The router loads the adapter on every worker (prefill and decode), then places requests
    for it; unloading stops them at once."""
    dep = _runtime_deployment(server_model_dir)
    try:
        _runtime_updates(dep.url, adapters, expected, tmp_path)
        assert not any(f.startswith("lora:") for w in dep.workers().values() for f in w["features"])
    finally:
        assert dep.stop() == 0


@pytest.mark.integration
def test_runtime_adapters_reach_a_restarted_worker(server_model_dir, adapters, expected):
    """A worker that restarts (or joins a pool later) starts with its start-up adapters only:
    the router loads on it the ones loaded at run time, so that their requests do not all fall
    on the workers that never restarted (nor, with one decode worker, on none)."""
    from tests.server.deployment import metric

    dep = _runtime_deployment(server_model_dir)
    try:
        assert _load(dep.url, "sql", adapters["sql"]).status_code == 200
        ws = dep.workers()
        (decode_id,) = [w for w in ws if w.startswith("decode")]
        (feature,) = [f for f in ws[decode_id]["features"] if f.startswith("lora:")]
        assert "lora" in ws[decode_id]["features"]  # it serves adapters (--enable-lora)
        old = dep.child(decode_id)
        old.kill()
        old.wait(10)
        deadline = time.monotonic() + 90
        while True:  # back, registered again, and given the adapter
            status = dep.http.get(dep.url + "/internal/workers").json()
            if status["counters"]["lora_synced"]:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        w = dep.workers()[decode_id]
        assert w["alive"] and feature in w["features"], w
        assert dep.child(decode_id).pid != old.pid
        listed = dep.http.get(w["url"] + "/internal/lora/list").json()["adapters"]
        assert [(a["name"], "lora:" + a["key"], a["pinned"]) for a in listed] == [("sql", feature, False)]
        assert os.path.realpath(listed[0]["path"]) == os.path.realpath(adapters["sql"])
        assert _complete(dep.url, "sql").json()["choices"][0]["text"] == expected["sql"][0]
        text = httpx.get(dep.url + "/metrics", timeout=5).text
        assert metric(text, "pdserve:lora_adapters_synced_total") == 1, text
        # unloaded: gone from the restarted worker too, and nothing brings it back
        assert _unload(dep.url, "sql").status_code == 200
        assert _complete(dep.url, "sql").status_code == 404
        assert not any(f.startswith("lora:") for w in dep.workers().values() for f in w["features"])
    finally:
        assert dep.stop() == 0
