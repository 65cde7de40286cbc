"""vLLM's request options and leniencies that users switching from vLLM rely on, against a real
server with the official `openai` client: what is done as vLLM does it, and what is refused."""

import pytest

from pdserve import SamplingParams
from tests.server.conftest import API_KEY, CONTEXT, TINY_ENGINE, engine_flags
from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.integration

openai = pytest.importorskip("openai")

USER = [{"role": "user", "content": "what is 2 + 2?"}]
EXTRA = {"ignore_eos": True}


def test_explicit_nulls_mean_the_defaults(tiny_server):
    import httpx

    body = {"model": "tiny", "messages": USER, "max_tokens": 3, "n": None, "logprobs": None, "stream": None}
    body |= {"temperature": 0, "ignore_eos": True, "stop": None, "seed": None, "stream_options": None}
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 3


def test_any_role_the_template_renders_and_an_empty_model_name(client):
    messages = [{"role": "narrator", "content": "once upon a time"}, *USER]
    r = client.chat.completions.create(model="", messages=messages, max_tokens=2, extra_body=EXTRA)
    assert r.model == "tiny" and r.usage.completion_tokens == 2


def test_text_parts_are_joined_by_newlines(client, tiny_offline):
    parts = [{"type": "text", "text": "Name three"}, {"type": "text", "text": "colors."}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], max_tokens=1)
    whole = tiny_offline.tokenizer.apply_chat_template([{"role": "user", "content": "Name three\ncolors."}])
    assert r.usage.prompt_tokens == len(tiny_offline.tokenizer.encode(whole))


def test_continue_final_message_goes_on_from_the_assistant_text(client, tiny_offline):
    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    r = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_body={**EXTRA, "continue_final_message": True, "add_generation_prompt": False},
    )
    prompt = tiny_offline.tokenizer.apply_chat_template(messages, False, continue_final_message=True)
    assert prompt.endswith("The answer is")
    ref = tiny_offline.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_truncate_prompt_tokens_keeps_the_end_of_the_prompt(client, tiny_offline):
    ids = list(range(40, 90))
    r = client.completions.create(
        model="tiny", prompt=ids, max_tokens=3, temperature=0, extra_body={**EXTRA, "truncate_prompt_tokens": 10}
    )
    ref = tiny_offline.generate([ids[-10:]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert r.usage.prompt_tokens == 10 and r.choices[0].text == ref.outputs[0].text


def test_truncation_side_right_keeps_the_start(client, tiny_offline):
    ids = list(range(40, 90))
    extra = {**EXTRA, "truncate_prompt_tokens": 10, "truncation_side": "right", "return_token_ids": True}
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=3, temperature=0, extra_body=extra)
    ref = tiny_offline.generate([ids[:10]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert r.model_dump()["choices"][0]["prompt_token_ids"] == ids[:10]
    assert r.choices[0].text == ref.outputs[0].text


def test_documents_reach_the_chat_template(client, tiny_offline):
    docs = [{"title": "Moon", "text": "The moon is made of rock."}]
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, extra_body={**EXTRA, "documents": docs}
    )
    assert r.usage.completion_tokens == 2  # the tiny model's template has no use for them
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[0].content }}"
    text = tiny_offline.tokenizer.apply_chat_template(USER, chat_template=template, documents=docs)
    assert text == "[Moon: The moon is made of rock.]what is 2 + 2?"


def test_logit_bias_steers_sampling_and_leaves_logprobs_alone(client, tiny_offline):
    r = client.completions.create(
        model="tiny", prompt="hello", max_tokens=4, temperature=0, logit_bias={"70": 100}, logprobs=1, extra_body=EXTRA
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == tiny_offline.tokenizer.decode([70]) * 4
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0, extra_body=EXTRA)
    assert r.choices[0].text != plain.choices[0].text
    # the model's own logprob of the forced token: well below 0 for a random model's 259 tokens
    assert all(x < -1 for x in lp.token_logprobs)


def test_max_tokens_past_the_context_ends_at_it(client):
    ids = [65] * (CONTEXT - 3)
    r = client.completions.create(model="tiny", prompt=ids, temperature=0, extra_body=EXTRA)  # default 16
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_a_null_max_tokens_on_completions_asks_for_what_the_context_leaves(tiny_server):
    import httpx

    body = {"model": "tiny", "prompt": [65] * (CONTEXT - 5), "max_tokens": None, "ignore_eos": True, "temperature": 0}
    r = httpx.post(tiny_server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text


def test_tokenize_renders_messages_as_the_chat_does(client, tiny_server):
    import httpx

    messages = [*USER, {"role": "assistant", "content": "The answer is"}]
    how = {"continue_final_message": True, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1}}
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=how)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    t = httpx.post(tiny_server.url + "/tokenize", json={"messages": messages, **how}, headers=auth).json()
    assert t["count"] == r.usage.prompt_tokens


def test_continuous_usage_stats_on_every_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=5,
            temperature=0,  # the same tokens every run (sampled ones may all be pieces of characters)
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body=EXTRA,
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].delta.content]
    assert counts and counts == sorted(counts) and counts[-1] <= 5
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks if c.usage)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"structured_outputs": {"choice": ["yes", "no"], "structural_tag": "{}"}}, "structured_outputs"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"length_penalty": 2.0}, "length_penalty"),
    ],
)
def test_options_not_implemented_are_refused_not_ignored(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_body=extra)
    assert e.value.body["param"] == param


def test_options_at_vllm_defaults_pass(client):
    extra = {**EXTRA, "use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "structured_outputs": None}
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2, extra_body=extra)
    assert r.usage.completion_tokens == 2


def test_tools_reach_the_template_with_tool_choice_none(client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=2, tools=tools, tool_choice="none", extra_body=EXTRA
    )
    assert r.usage.completion_tokens == 2


def test_tokenize_detokenize_version_ping(tiny_server):
    import httpx

    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=tiny_server.url, headers=auth) as h:
        t = h.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True}).json()
        assert len(t["token_strs"]) == t["count"] and "".join(t["token_strs"]).replace("\u0120", " ") == "hello world"
        assert h.post("/detokenize", json={"tokens": t["tokens"]}).json() == {"prompt": "hello world"}
        bad = h.post("/detokenize", json={"tokens": [10**6]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert h.post("/detokenize", json={"tokens": [1]}, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert h.get("/version").json()["version"]
        assert h.get("/ping").status_code == 200 and h.post("/ping").json()["status"] == "ok"


def test_allowed_token_ids(client, tiny_server):
    import httpx

    ids = httpx.post(tiny_server.url + "/tokenize", json={"prompt": "ab"}, headers=tiny_server.headers).json()["tokens"]
    r = client.completions.create(
        model="tiny",
        prompt="x",
        max_tokens=8,
        temperature=1.0,
        extra_body={"allowed_token_ids": ids, "ignore_eos": True},
    )
    assert r.choices[0].text and set(r.choices[0].text) <= {"a", "b"}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"allowed_token_ids": [10**7]})
    assert e.value.body["param"] == "allowed_token_ids"


def test_return_token_ids_on_completions_whole_and_streamed(client, tiny_offline):
    prompt = "the token ids of"
    ids = tiny_offline.tokenizer.encode(prompt)
    extra = {**EXTRA, "return_token_ids": True}
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, n=2, temperature=0, extra_body=extra)
    for c in r.model_dump()["choices"]:
        assert c["prompt_token_ids"] == ids and len(c["token_ids"]) == 6
        assert tiny_offline.tokenizer.decode(c["token_ids"]) == c["text"]
    chunks = [
        c.model_dump()
        for c in client.completions.create(
            model="tiny", prompt=prompt, max_tokens=6, n=2, temperature=0, stream=True, extra_body=extra
        )
    ]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in c for c in mine[1:])
        assert sum((c["token_ids"] for c in mine), []) == r.model_dump()["choices"][index]["token_ids"]
    # without the option the response has neither field
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body=EXTRA).model_dump()
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain["choices"][0]


def test_return_token_ids_on_chat_whole_and_streamed(client, tiny_offline):
    whole = tiny_offline.tokenizer.apply_chat_template(USER)
    ids = tiny_offline.tokenizer.encode(whole)
    extra = {**EXTRA, "return_token_ids": True}
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, temperature=0, extra_body=extra)
    body = r.model_dump()
    assert body["prompt_token_ids"] == ids and len(body["choices"][0]["token_ids"]) == 5
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=5, temperature=0, stream=True, extra_body=extra
        )
    ]
    assert chunks[0]["prompt_token_ids"] == ids and all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert sum((c["choices"][0].get("token_ids") or [] for c in chunks), []) == body["choices"][0]["token_ids"]
    two = [
        c.model_dump()
        for c in client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=2, n=2, stream=True, extra_body=extra
        )
    ]
    firsts = [c for c in two if c.get("prompt_token_ids") is not None]
    assert sorted(c["choices"][0]["index"] for c in firsts) == [0, 1]  # each choice's first chunk, as vLLM


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(client):
    extra = {**EXTRA, "return_token_ids": True, "return_tokens_as_token_ids": True}
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=4, logprobs=True, top_logprobs=2, extra_body=extra
    ).model_dump()
    content = r["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [f"token_id:{t}" for t in r["choices"][0]["token_ids"]]
    assert all(t["token"].startswith("token_id:") for e in content for t in e["top_logprobs"])
    c = client.completions.create(model="tiny", prompt="hi", max_tokens=3, logprobs=1, extra_body=extra).model_dump()
    lp = c["choices"][0]["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in c["choices"][0]["token_ids"]]
    assert lp["text_offset"][0] == 0 and all(k.startswith("token_id:") for d in lp["top_logprobs"] for k in d)


def test_prompt_logprobs_as_vllm_gives_them(client, tiny_offline):
    """Each prompt token's logprob, rank in the vocabulary and text, with the top k, equal to
    the offline engine's; on completions per choice, on chat once at the top."""
    prompt = "scoring this prompt token by token"
    ids = tiny_offline.tokenizer.encode(prompt)
    ref = tiny_offline.generate([ids], SamplingParams(prompt_logprobs=2, max_tokens=1))[0].prompt_logprobs
    r = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=2, extra_body={**EXTRA, "prompt_logprobs": 2}
    ).model_dump()
    got = r["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None and ref[0] is None
    for pos, (mine, theirs) in enumerate(zip(got[1:], ref[1:]), 1):
        assert str(ids[pos]) in mine and 2 <= len(mine) <= 3
        assert set(mine) == {str(t) for t in theirs}
        for t, lp in theirs.items():
            m = mine[str(t)]
            assert m["logprob"] == pytest.approx(lp.logprob, abs=1e-4) and m["rank"] == lp.rank
            assert m["decoded_token"] == lp.decoded_token
    # with echo and logprobs too: both lists, each with its own k
    both = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=1, echo=True, logprobs=1, extra_body={**EXTRA, "prompt_logprobs": 3}
    ).model_dump()["choices"][0]
    assert all(len(e) <= 2 for e in both["logprobs"]["top_logprobs"][1:] if e)
    assert all(3 <= len(e) <= 4 for e in both["prompt_logprobs"][1:])
    chat = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=1, extra_body={**EXTRA, "prompt_logprobs": 0}
    ).model_dump()
    n = len(tiny_offline.tokenizer.encode(tiny_offline.tokenizer.apply_chat_template(USER)))
    assert len(chat["prompt_logprobs"]) == n and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])


def test_a_template_cannot_ask_for_gigabytes(tiny_offline):
    """Jinja's sandbox caps range() but not products: a (trusted) request's template asking for
    "x" * 10**10 must fail, not allocate."""
    tok = tiny_offline.tokenizer
    for template in ('{{ "x" * 10**10 }}', "{{ [0] * 10**9 }}", "{{ 10 ** 100000 }}"):
        with pytest.raises(Exception, match="template"):
            tok.apply_chat_template(USER, chat_template=template)
    assert tok.apply_chat_template(USER, chat_template='{{ "-" * 3 }}{{ 2 ** 8 }}') == "---256"


def test_a_request_chat_template_needs_the_servers_trust(client, server_model_dir):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=2, extra_body={"chat_template": template}
        )
    assert e.value.body["param"] == "chat_template" and "--trust-request-chat-template" in e.value.body["message"]
    with ServerProcess(
        "--model", server_model_dir, "--threads", "1", "--served-model-name", "tiny", "--trust-request-chat-template",
        *engine_flags(**TINY_ENGINE),
    ) as server:  # fmt: skip
        import httpx

        r = httpx.post(server.url + "/tokenize", json={"messages": USER, "chat_template": template})
        assert r.status_code == 200, r.text
        text = httpx.post(server.url + "/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == "<user>what is 2 + 2?"
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as c:
            out = c.chat.completions.create(
                model="tiny", messages=USER, max_tokens=2, extra_body={**EXTRA, "chat_template": template}
            )
            assert out.usage.prompt_tokens == r.json()["count"]
            with pytest.raises(openai.BadRequestError) as e:  # a template that does not compile: 400
                c.chat.completions.create(
                    model="tiny", messages=USER, max_tokens=2, extra_body={"chat_template": "{% if"}
                )
            assert e.value.body["param"] == "messages"


def test_prompt_logprobs_0_in_a_stream_and_with_token_ids(client, tiny_offline):
    # as vLLM: 0 is let through in a stream (there is no field to send them in), more is a 400
    chunks = list(
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, stream=True, extra_body={**EXTRA, "prompt_logprobs": 0}
        )
    )
    assert chunks
    # with return_tokens_as_token_ids, prompt logprobs still give each token's text
    extra = {**EXTRA, "prompt_logprobs": 1, "return_tokens_as_token_ids": True}
    r = client.completions.create(model="tiny", prompt="hi there", max_tokens=1, extra_body=extra).model_dump()
    for entry in r["choices"][0]["prompt_logprobs"][1:]:
        for t, v in entry.items():
            assert v["decoded_token"] == tiny_offline.tokenizer.decode([int(t)], skip_special_tokens=False)
