"""Router + prefill worker + decode worker as real processes, driven by the openai client."""

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.sampler import bad_words_token_ids
from tests.transfer.cluster import Cluster

pytestmark = pytest.mark.integration

ENGINE = ["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "512"]
PROMPTS = ["hello world", "tell me a story about the sea and the ships that sail on it " * 3, "x"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir):
    with Cluster(tiny_model_dir, worker_args=ENGINE) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    llm = LLM(tiny_model_dir, dtype="float32", block_size=16, num_gpu_blocks=512)
    return {
        p: o.outputs[0].text
        for p, o in zip(PROMPTS, llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)))
    }


def test_greedy_text_equals_collocated(cluster, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        r = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].text == reference[prompt]
        stream = client.completions.create(
            model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == reference[prompt]
    states = cluster.wait_idle()
    for name, s in states.items():
        assert s["num_free_blocks"] == s["num_blocks"], name
    counters = cluster.status()["counters"]
    assert counters["kv_bytes"] > 0 and counters["kv_failed"] == 0


def test_sampling_options_travel_to_the_workers(cluster, tiny_model_dir):
    # logit_bias reaches the worker that samples the first token and the one that samples the
    # rest; a stop token's text is left out, as collocated
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    llm = LLM(tiny_model_dir, dtype="float32", block_size=16, num_gpu_blocks=512)
    r = client.completions.create(
        model=model,
        prompt=PROMPTS[0],
        max_tokens=4,
        temperature=0,
        logit_bias={"70": 100},
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].text == llm.tokenizer.decode([70]) * 4
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    stop = free.token_ids[3]
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop]))[0].outputs[0]
    r = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "stop"
    assert len(ref.token_ids) == free.token_ids.index(stop) + 1
    # bad_words: the first token (the prefill worker's) and the rest (the decode worker's)
    # avoid the words as collocated does; the words are single tokens of the free output
    tok = llm.tokenizer
    words = sorted({w for w in map(tok.decode, ([t] for t in free.token_ids)) if w.strip()})
    words = [w for w in words if len(bad_words_token_ids(tok, [w])[0]) == 1]
    assert words
    ref = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, bad_words=words))[0]
    r = client.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True, "bad_words": words, "return_token_ids": True},
    ).model_dump()  # fmt: skip
    assert r["choices"][0]["token_ids"] == ref.outputs[0].token_ids != free.token_ids


@pytest.mark.parametrize(
    "mode, transport, layerwise",
    [("push", "tcp", "--no-kv-layerwise"), ("pull", "tcp", "--kv-layerwise"), ("push", "nixl", "--kv-layerwise")],
)
def test_modes_between_processes(tiny_model_dir, reference, mode, transport, layerwise):
    if transport == "nixl":
        pytest.importorskip("nixl_cu12")
    with Cluster(
        tiny_model_dir,
        worker_args=ENGINE + ["--kv-transport", transport],
        prefill_args=[layerwise],
        router_args=["--kv-mode", mode],
    ) as c:
        _each_prompt_as_collocated(c.url, reference)
        counters = c.status()["counters"]
        assert counters["kv_bytes"] > 0 and counters["recomputed"] == 0


def test_short_prompts_are_prefilled_on_the_decode_worker(tiny_model_dir, reference):
    """--max-local-prefill-length: prompts short enough run whole on the decode worker (no prefill
    worker, no KV transfer), the others as before; the text is the same either way."""
    import httpx

    # the tiny model's tokenizer: 11, 180 and 1 tokens
    with Cluster(tiny_model_dir, worker_args=ENGINE, router_args=["--max-local-prefill-length", "16"]) as c:
        _each_prompt_as_collocated(c.url, reference)
        counters = c.status()["counters"]
        assert counters["local_prefill"] == 2  # "hello world" and "x"
        assert counters["kv_bytes"] > 0  # the long prompt went through the prefill worker
        for name, s in c.wait_idle().items():
            assert s["num_free_blocks"] == s["num_blocks"], name
        metrics = httpx.get(c.url + "/metrics").text
        assert "pdserve:request_local_prefill_total 2.0" in metrics


def _each_prompt_as_collocated(url: str, reference: dict) -> None:
    import httpx

    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    for prompt in PROMPTS:
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference[prompt]


def _sample(text: str, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_echo_logprobs_and_the_router_metrics(cluster, tiny_model_dir):
    import httpx

    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=cluster.url + "/v1", api_key="x", max_retries=0)
    model = client.models.list().data[0].id
    llm = LLM(tiny_model_dir, dtype="float32", block_size=16, num_gpu_blocks=512)
    ref = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, ignore_eos=True))[0]
    before = httpx.get(cluster.url + "/metrics").text
    # the prompt's logprobs come from the prefill worker, the rest from the decode worker
    r = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    n = len(ref.prompt_token_ids)
    assert r.choices[0].text == PROMPTS[1] + ref.outputs[0].text and len(lp.tokens) == n + 3
    want = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:n] == pytest.approx(want, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    # a request refused with a 400 is not a finished (aborted) request
    bad = httpx.post(cluster.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 10**6})
    assert bad.status_code == 400
    after = httpx.get(cluster.url + "/metrics").text
    key = "pdserve:request_success_total"
    assert _sample(after, key, finished_reason="abort") == _sample(before, key, finished_reason="abort")
    # the router splits TTFT into waiting and prefill with the prefill worker's own time
    for h in ("pdserve:request_queue_time_seconds_count", "pdserve:request_prefill_time_seconds_count"):
        assert _sample(after, h) == _sample(before, h) + 1, h
    # each transfer's time and the part of it the first token waited for (0 when the last layer
    # landed before the prefill ended), per request
    for h in ("pdserve:kv_transfer_duration_seconds", "pdserve:kv_transfer_exposed_duration_seconds"):
        assert _sample(after, h + "_count", model_name=model) == _sample(before, h + "_count", model_name=model) + 1
        assert _sample(after, h + "_sum", model_name=model) >= _sample(before, h + "_sum", model_name=model)
        assert _sample(after, h + "_bucket", le="+Inf", model_name=model) == _sample(after, h + "_count")
    d = "pdserve:kv_transfer_duration_seconds_sum"
    assert _sample(after, d, model_name=model) > _sample(before, d, model_name=model)
    assert (
        0
        < _sample(after, "pdserve:request_prefill_time_seconds_sum")
        - _sample(before, "pdserve:request_prefill_time_seconds_sum")
        <= _sample(after, "pdserve:time_to_first_token_seconds_sum")
        - _sample(before, "pdserve:time_to_first_token_seconds_sum")
    )
    # vLLM's prompt_logprobs: the prefill worker's ranks in the vocabulary cross to the router
    r = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=2, extra_body={"ignore_eos": True, "prompt_logprobs": 0}
    ).model_dump()
    got = r["choices"][0]["prompt_logprobs"]
    ranks = [None] + [e[t].rank for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert [None if e is None else e[str(t)]["rank"] for t, e in zip(ref.prompt_token_ids, got)] == ranks
    cluster.wait_idle()
