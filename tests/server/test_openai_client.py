"""The official `openai` client against a real server process: greedy text equals the offline LLM."""

import asyncio

import pytest

from pdserve import SamplingParams
from tests.server.conftest import API_KEY

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai")

PROMPTS = ["hello world", "the quick brown fox jumps over the lazy dog", "x"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 2?"}]
MAX = 12
EXTRA = {"ignore_eos": True}  # vLLM's extension: the random tiny model may emit EOS at any point


def offline_text(llm, prompt, max_tokens=MAX, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw))[0]


def offline_chat(llm, messages, max_tokens=MAX):
    return llm.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]


def test_models_lists_the_served_model(client, model_id):
    assert model_id == "tiny"
    assert client.models.retrieve(model_id).id == model_id


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_matches_offline(client, model_id, tiny_offline, prompt):
    ref = offline_text(tiny_offline, prompt)
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=MAX, temperature=0, extra_body=EXTRA)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == MAX


def test_completion_stream_matches_offline_with_usage(client, model_id, tiny_offline):
    ref = offline_text(tiny_offline, PROMPTS[1], max_tokens=20)
    chunks = list(
        client.completions.create(
            model=model_id,
            prompt=PROMPTS[1],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=EXTRA,
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_matches_offline(client, model_id, tiny_offline):
    ref = offline_chat(tiny_offline, CHAT)
    r = client.chat.completions.create(
        model=model_id, messages=CHAT, max_completion_tokens=MAX, temperature=0, extra_body=EXTRA
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_chat_stream_matches_offline(client, model_id, tiny_offline):
    ref = offline_chat(tiny_offline, CHAT, max_tokens=20)
    stream = client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=20, temperature=0, stream=True, extra_body=EXTRA
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_concurrent_streams_and_whole(tiny_server, tiny_offline):
    """Concurrent requests share engine steps; each still gets its own greedy text."""

    async def main():
        async with openai.AsyncOpenAI(base_url=tiny_server.url + "/v1", api_key=API_KEY, max_retries=0) as c:
            model = (await c.models.list()).data[0].id

            async def chat_stream(msgs):
                s = await c.chat.completions.create(
                    model=model, messages=msgs, max_tokens=MAX, temperature=0, stream=True, extra_body=EXTRA
                )
                return "".join([ch.choices[0].delta.content or "" async for ch in s if ch.choices])

            async def completion(prompt):
                r = await c.completions.create(
                    model=model, prompt=prompt, max_tokens=MAX, temperature=0, extra_body=EXTRA
                )
                return r.choices[0].text

            convs = [[{"role": "user", "content": p}] for p in PROMPTS]
            return await asyncio.gather(*(chat_stream(m) for m in convs), *(completion(p) for p in PROMPTS))

    got = asyncio.run(main())
    want = [offline_chat(tiny_offline, [{"role": "user", "content": p}]).outputs[0].text for p in PROMPTS]
    want += [offline_text(tiny_offline, p).outputs[0].text for p in PROMPTS]
    assert got == want


def test_token_id_prompts_and_batches(client, model_id, tiny_offline):
    ids = tiny_offline.tokenizer.encode(PROMPTS[0])
    r = client.completions.create(
        model=model_id, prompt=[ids, PROMPTS[1]], max_tokens=MAX, temperature=0, extra_body=EXTRA
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == offline_text(tiny_offline, ids).outputs[0].text
    assert r.choices[1].text == offline_text(tiny_offline, PROMPTS[1]).outputs[0].text


def test_n_with_seed_is_reproducible(client, model_id):
    kw = dict(model=model_id, prompt=PROMPTS[0], max_tokens=8, temperature=1.0, n=3, seed=7, extra_body=EXTRA)
    a = [c.text for c in client.completions.create(**kw).choices]
    b = [c.text for c in client.completions.create(**kw).choices]
    assert a == b and len(a) == 3 and len(set(a)) > 1  # choice j samples with seed + j


def test_stop_string_and_stop_token(client, model_id, tiny_offline):
    ref = offline_text(tiny_offline, PROMPTS[1], max_tokens=20).outputs[0]
    stop = ref.text[5:7]
    r = client.completions.create(
        model=model_id, prompt=PROMPTS[1], max_tokens=20, temperature=0, stop=[stop], extra_body=EXTRA
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ref.text[: ref.text.find(stop)]
    r = client.completions.create(
        model=model_id,
        prompt=PROMPTS[1],
        max_tokens=20,
        temperature=0,
        extra_body={**EXTRA, "stop_token_ids": [ref.token_ids[3]]},
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens <= 4


def test_logprobs(client, model_id, tiny_offline):
    ref = offline_text(tiny_offline, PROMPTS[0], max_tokens=4, logprobs=2).outputs[0]
    r = client.completions.create(
        model=model_id, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2, extra_body=EXTRA
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs) == 4
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(ref.token_ids, ref.logprobs)], abs=1e-4)
    # the legacy format keys by token text, so tokens that all print as U+FFFD share one key
    assert all(len(d) >= 2 for d, t in zip(lp.top_logprobs, lp.tokens) if "\ufffd" not in t)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    c = client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3, extra_body=EXTRA
    )
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    for t in content:  # a token holding part of a UTF-8 character shows as U+FFFD but keeps its bytes
        assert t.bytes and ("\ufffd" in t.token or bytes(t.bytes) == t.token.encode())


def test_chat_stream_with_n_choices(client, model_id, tiny_offline):
    ref = offline_chat(tiny_offline, CHAT).outputs[0].text
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(
        model=model_id, messages=CHAT, max_tokens=MAX, temperature=0, n=2, stream=True, extra_body=EXTRA
    ):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == {0: ref, 1: ref}


def test_echo_and_tokenize(client, model_id, tiny_server, tiny_offline):
    import httpx

    r = client.completions.create(
        model=model_id, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, extra_body=EXTRA
    )
    assert r.choices[0].text == PROMPTS[0] + offline_text(tiny_offline, PROMPTS[0], max_tokens=4).outputs[0].text
    auth = {"Authorization": f"Bearer {API_KEY}"}
    tok = httpx.post(tiny_server.url + "/tokenize", json={"prompt": PROMPTS[0]}, headers=auth).json()
    assert tok["tokens"] == tiny_offline.tokenizer.encode(PROMPTS[0]) and tok["count"] == r.usage.prompt_tokens
    chat = httpx.post(tiny_server.url + "/tokenize", json={"messages": CHAT}, headers=auth).json()
    assert chat["count"] == len(offline_chat(tiny_offline, CHAT).prompt_token_ids)


def test_echo_with_logprobs_lists_the_prompt_first(client, model_id, tiny_offline):
    ref = tiny_offline.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, logprobs=1, prompt_logprobs=1, ignore_eos=True)
    )[0]
    r = client.completions.create(
        model=model_id, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=1, extra_body=EXTRA
    )
    c = r.choices[0]
    lp = c.logprobs
    n_prompt = len(ref.prompt_token_ids)
    assert c.text == PROMPTS[1] + ref.outputs[0].text
    assert len(lp.tokens) == n_prompt + 3
    # the first prompt token has no logprob (nothing predicts it); the others are the engine's
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    want += [e[t].logprob for t, e in zip(ref.outputs[0].token_ids, ref.outputs[0].logprobs)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    # offsets index the returned text, echo included
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == c.text
    # streamed: the echo and the prompt's logprobs come in the first chunk, the rest after
    tokens, offsets, text = [], [], ""
    for chunk in client.completions.create(
        model=model_id, prompt=PROMPTS[1], max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True,
        extra_body=EXTRA,
    ):  # fmt: skip
        ch = chunk.choices[0]
        text += ch.text
        if ch.logprobs:
            tokens += ch.logprobs.tokens
            offsets += ch.logprobs.text_offset
    assert (text, tokens, offsets) == (c.text, lp.tokens, lp.text_offset)


def test_echo_with_max_tokens_0_scores_the_prompt(client, model_id, tiny_offline):
    # what evaluation harnesses send to score a text: the prompt back with its logprobs
    r = client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=0)
    c = r.choices[0]
    ref = tiny_offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    assert c.text == PROMPTS[1] and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    want = [e[t].logprob for t, e in zip(ref.prompt_token_ids[1:], ref.prompt_logprobs[1:])]
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    chunks = list(
        client.completions.create(model=model_id, prompt=PROMPTS[1], max_tokens=0, echo=True, logprobs=0, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in chunks) == PROMPTS[1]
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo_logprob_offsets_run_through_every_token_of_a_non_ascii_prompt(client, model_id):
    # bytes of one character are tokens of their own here, each printing as U+FFFD: the offsets
    # still count on from token to token, generated ones after the prompt's (as vLLM does)
    prompt = "h\u00e9llo \U0001f600 w\u00f6rld"
    r = client.completions.create(
        model=model_id, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0, extra_body=EXTRA
    )
    lp = r.choices[0].logprobs
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert r.choices[0].text.startswith(prompt)
