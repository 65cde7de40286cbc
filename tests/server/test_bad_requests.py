"""Bad requests get the right status and OpenAI's error shape, and the server keeps serving."""

import json

import httpx
import pytest

from pdserve import SamplingParams
from tests.server.conftest import API_KEY

pytestmark = pytest.mark.integration

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def body(**kw):
    return json.dumps({"model": "tiny", **kw}).encode()


def deep(depth: int) -> bytes:
    return b'{"model": "tiny", "prompt": ' + b"[" * depth + b"]" * depth + b"}"


LONE_SURROGATE = r'"\ud800"'  # the JSON escape: valid JSON, not valid Unicode


# (name, method, path, raw body, headers, status, param)
CASES = [
    ("invalid_json", "POST", CMPL, b'{"prompt": "hi",', AUTH, 400, None),
    ("body_not_an_object", "POST", CMPL, b"[1, 2]", AUTH, 400, None),
    ("invalid_utf8", "POST", CMPL, b'{"prompt": "\xff\xfe"}', AUTH, 400, None),
    ("nan_is_not_json", "POST", CMPL, b'{"prompt": "hi", "temperature": NaN}', AUTH, 400, None),
    ("missing_prompt", "POST", CMPL, body(), AUTH, 400, "prompt"),
    ("missing_messages", "POST", CHAT, body(), AUTH, 400, "messages"),
    ("empty_messages", "POST", CHAT, body(messages=[]), AUTH, 400, "messages"),
    ("empty_role", "POST", CHAT, body(messages=[{"role": "", "content": "x"}]), AUTH, 400, "messages.0.role"),
    (
        "structured_outputs_two_kinds",
        "POST",
        CHAT,
        body(messages=USER, structured_outputs={"choice": ["a"], "regex": "a"}),
        AUTH,
        400,
        "structured_outputs",
    ),
    (
        "two_constraints",
        "POST",
        CMPL,
        body(prompt="hi", guided_choice=["a", "b"], guided_regex="a"),
        AUTH,
        400,
        "guided_choice",
    ),
    ("bad_regex", "POST", CMPL, body(prompt="hi", guided_regex="[a-"), AUTH, 400, "structured_outputs"),
    ("prompt_logprobs_all", "POST", CMPL, body(prompt="hi", prompt_logprobs=-1), AUTH, 400, "prompt_logprobs"),
    (
        "prompt_logprobs_stream",
        "POST",
        CHAT,
        body(messages=USER, prompt_logprobs=2, stream=True),
        AUTH,
        400,
        "prompt_logprobs",
    ),
    ("truncation_side", "POST", CMPL, body(prompt="hi", truncation_side="middle"), AUTH, 400, "truncation_side"),
    ("documents_not_strings", "POST", CHAT, body(messages=USER, documents=[{"a": 1}]), AUTH, 400, "documents.0.a"),
    ("blank_bad_word", "POST", CMPL, body(prompt="hi", bad_words=["a", " "]), AUTH, 400, "bad_words.1"),
    ("empty_cache_salt", "POST", CMPL, body(prompt="hi", cache_salt=""), AUTH, 400, "cache_salt"),
    ("long_cache_salt", "POST", CHAT, body(messages=USER, cache_salt="s" * 1025), AUTH, 400, "cache_salt"),
    ("chat_echo", "POST", CHAT, body(messages=USER, echo=True), AUTH, 400, "echo"),
    (
        "continue_and_generation_prompt",
        "POST",
        CHAT,
        body(messages=USER, continue_final_message=True),
        AUTH,
        400,
        "continue_final_message",
    ),
    (
        "truncate_past_context",
        "POST",
        CMPL,
        body(prompt="hi", truncate_prompt_tokens=10**6),
        AUTH,
        400,
        "truncate_prompt_tokens",
    ),
    (
        "truncate_below_minus_one",
        "POST",
        CMPL,
        body(prompt="hi", truncate_prompt_tokens=-2),
        AUTH,
        400,
        "truncate_prompt_tokens",
    ),
    (
        "image_content",
        "POST",
        CHAT,
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}]),
        AUTH,
        400,
        "messages.0.content",
    ),
    ("negative_temperature", "POST", CMPL, body(prompt="hi", temperature=-1), AUTH, 400, "temperature"),
    ("bool_temperature", "POST", CMPL, body(prompt="hi", temperature=True), AUTH, 400, "temperature"),
    ("top_p_zero", "POST", CMPL, body(prompt="hi", top_p=0), AUTH, 400, "top_p"),
    ("top_k_negative", "POST", CMPL, body(prompt="hi", top_k=-5), AUTH, 400, "top_k"),
    ("presence_penalty_range", "POST", CHAT, body(messages=USER, presence_penalty=3), AUTH, 400, "presence_penalty"),
    ("max_tokens_zero", "POST", CMPL, body(prompt="hi", max_tokens=0), AUTH, 400, "max_tokens"),
    ("max_tokens_string", "POST", CMPL, body(prompt="hi", max_tokens="5"), AUTH, 400, "max_tokens"),
    ("n_zero", "POST", CMPL, body(prompt="hi", n=0), AUTH, 400, "n"),
    ("n_too_large", "POST", CHAT, body(messages=USER, n=1000), AUTH, 400, "n"),
    ("seed_out_of_range", "POST", CMPL, body(prompt="hi", seed=2**70), AUTH, 400, "seed"),
    ("stop_wrong_type", "POST", CMPL, body(prompt="hi", stop=5), AUTH, 400, "stop"),
    ("logprobs_too_many", "POST", CMPL, body(prompt="hi", logprobs=50), AUTH, 400, "logprobs"),
    ("top_logprobs_without_logprobs", "POST", CHAT, body(messages=USER, top_logprobs=2), AUTH, 400, "top_logprobs"),
    (
        "stream_options_without_stream",
        "POST",
        CHAT,
        body(messages=USER, stream_options={"include_usage": True}),
        AUTH,
        400,
        "stream_options",
    ),
    (
        "tool_without_function",
        "POST",
        CHAT,
        body(messages=USER, tools=[{"type": "function"}], tool_choice="required"),
        AUTH,
        400,
        "tools.0.function",
    ),  # fmt: skip
    ("tool_choice_auto", "POST", CHAT, body(messages=USER, tools=TOOLS), AUTH, 400, "tool_choice"),
    (
        "tool_choice_unknown_name",
        "POST",
        CHAT,
        body(messages=USER, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
        AUTH,
        400,
        "tool_choice",
    ),  # fmt: skip
    ("logit_bias_out_of_vocab", "POST", CMPL, body(prompt="hi", logit_bias={"1000000": 5}), AUTH, 400, "logit_bias"),
    ("logit_bias_not_an_id", "POST", CMPL, body(prompt="hi", logit_bias={"abc": 5}), AUTH, 400, "logit_bias"),
    ("logit_bias_too_big", "POST", CMPL, body(prompt="hi", logit_bias={"1": 101}), AUTH, 400, "logit_bias"),
    ("empty_prompt", "POST", CMPL, body(prompt=""), AUTH, 400, "prompt"),
    ("token_id_out_of_vocab", "POST", CMPL, body(prompt=[1, 10**6]), AUTH, 400, "prompt"),
    ("prompt_longer_than_context", "POST", CMPL, body(prompt="a" * 2100), AUTH, 400, "prompt"),
    (
        "prompt_plus_max_tokens_over_context",
        "POST",
        CMPL,
        body(prompt="hi", max_tokens=10_000),
        AUTH,
        400,
        "max_tokens",
    ),
    (
        "streamed_request_over_context",
        "POST",
        CHAT,
        body(messages=USER, max_tokens=10_000, stream=True),
        AUTH,
        400,
        "max_tokens",
    ),
    ("tokenize_needs_input", "POST", "/tokenize", body(), AUTH, 400, "prompt"),
    ("unknown_model", "POST", CMPL, json.dumps({"model": "gpt-9", "prompt": "hi"}).encode(), AUTH, 404, "model"),
    ("unknown_model_card", "GET", "/v1/models/gpt-9", None, AUTH, 404, "model"),
    ("unknown_route", "POST", "/v1/nope", body(prompt="hi"), AUTH, 404, None),
    ("wrong_method", "GET", CMPL, None, AUTH, 405, None),
    ("missing_api_key", "POST", CMPL, body(prompt="hi"), {}, 401, None),
    ("wrong_api_key", "POST", CHAT, body(messages=USER), {"Authorization": "Bearer nope"}, 401, None),
    ("body_too_large", "POST", CMPL, body(prompt="a" * 70_000), AUTH, 413, None),
    # these used to answer 500 ...
    ("lone_surrogate_prompt", "POST", CMPL, f'{{"prompt": {LONE_SURROGATE}}}'.encode(), AUTH, 400, "prompt"),
    (
        "lone_surrogate_in_chat",
        "POST",
        CHAT,
        f'{{"messages": [{{"role": "user", "content": {LONE_SURROGATE}}}]}}'.encode(),
        AUTH,
        400,
        "messages.0.content",
    ),
    (
        "lone_surrogate_in_tokenize",
        "POST",
        "/tokenize",
        f'{{"prompt": {LONE_SURROGATE}}}'.encode(),
        AUTH,
        400,
        "prompt",
    ),
    ("nested_32000_deep", "POST", CMPL, deep(32_000), AUTH, 400, None),
    ("echo_of_unknown_token_id", "POST", CMPL, body(prompt=[1, 300], echo=True), AUTH, 400, "prompt"),
    # ... or were accepted: a silent no-op, a request that can never finish as asked,
    (
        "min_tokens_over_max_tokens",
        "POST",
        CMPL,
        body(prompt="hi", min_tokens=5, max_tokens=2),
        AUTH,
        400,
        "min_tokens",
    ),
    ("negative_stop_token_id", "POST", CMPL, body(prompt="hi", stop_token_ids=[-1]), AUTH, 400, "stop_token_ids"),
    (
        "stop_token_id_out_of_vocab",
        "POST",
        CHAT,
        body(messages=USER, stop_token_ids=[5, 10**6]),
        AUTH,
        400,
        "stop_token_ids",
    ),
    ("priority_out_of_range", "POST", CMPL, body(prompt="hi", priority=2**80), AUTH, 400, "priority"),
    ("too_many_stop_strings", "POST", CMPL, body(prompt="hi", stop=[f"s{i}" for i in range(1000)]), AUTH, 400, "stop"),
    ("stop_string_too_long", "POST", CHAT, body(messages=USER, stop="x" * 5000), AUTH, 400, "stop"),
    ("too_many_sequences_by_n", "POST", CMPL, body(prompt=["hi"] * 3, n=100), AUTH, 400, "n"),
    ("too_many_sequences_by_prompts", "POST", CMPL, body(prompt=["hi"] * 300), AUTH, 400, "prompt"),
    # ... or stopped the engine for everyone (the batch's step failed on an int64 overflow)
    ("top_k_beyond_int64", "POST", CMPL, body(prompt="hi", top_k=2**80), AUTH, 400, "top_k"),
    ("seed_of_choice_1_beyond_range", "POST", CMPL, body(prompt="hi", seed=2**64 - 1, n=2), AUTH, 400, "seed"),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("name,method,path,raw,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(http, name, method, path, raw, headers, status, param):
    r = http.request(method, path, content=raw, headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert (
        err["type"]
        == {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            405: "invalid_request_error",
            413: "invalid_request_error",
        }[status]
    )
    assert err["param"] == param


def test_still_serves_correctly_after_bad_requests(http, tiny_server, tiny_offline):
    for _, method, path, raw, headers, _, _ in CASES:
        http.request(method, path, content=raw, headers=headers)
    r = http.post(
        "/v1/completions",
        headers=AUTH,
        json={"model": "tiny", "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200
    ref = tiny_offline.generate("hello world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert r.json()["choices"][0]["text"] == ref[0].outputs[0].text
    h = tiny_server.wait_idle()
    assert h["status"] == "ok" and h["num_free_blocks"] == h["num_blocks"]
    assert "Traceback" not in tiny_server.log()
