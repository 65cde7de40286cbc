"""In-process checks of the pieces the router will reuse: parsing, admission, formatting, app states."""

import asyncio
import json
import threading

import httpx
import pytest

from pdserve.server import protocol as P
from pdserve.server.admission import RateMeter, admit, retry_after_s
from pdserve.server.errors import APIError
from pdserve.server.format import TokenText
from pdserve.server.streaming import sse


def parse(cls, raw: bytes):
    try:
        return P.parse_body(raw, cls)
    except APIError as e:
        return e


def parse_params(req):
    try:
        req.prompts()
        return req.sampling_params(req.max_tokens, req.logprobs)
    except APIError as e:
        return e


def test_nulls_mean_the_defaults_but_max_tokens_on_completions_means_no_limit():
    req = parse(P.CompletionRequest, b'{"prompt": "x", "n": null, "stop": null, "echo": null, "max_tokens": null}')
    assert (req.n, req.stop, req.echo, req.max_tokens) == (1, None, False, None)
    assert parse(P.CompletionRequest, b'{"prompt": "x"}').max_tokens == 16
    chat = parse(P.ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "logprobs": null}')
    assert chat.logprobs is False and chat.max_tokens is None


def test_parse_accepts_openai_shapes_and_ignores_unknown_fields():
    req = parse(P.CompletionRequest, b'{"prompt": [[1, 2], "text"], "n": 2, "future_field": {"x": 1}}')
    assert req.prompts() == [[1, 2], "text"] and req.max_tokens == 16
    chat = parse(
        P.ChatCompletionRequest,
        b'{"messages": [{"role": "user", "content": [{"type": "text", '
        b'"text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 3}',
    )
    assert chat.conversation() == [{"role": "user", "content": "a\nb"}]
    params = chat.sampling_params(3, chat.engine_logprobs())
    assert params.max_tokens == 3 and params.logprobs is None and params.temperature == 1.0


@pytest.mark.parametrize(
    "raw,param",
    [
        (b'{"prompt": "x", "temperature": 1e999}', "temperature"),  # parses as inf: never reaches the sampler
        (b'{"prompt": "x", "top_p": 1.5}', "top_p"),
        (b'{"prompt": "x", "echo": "yes"}', "echo"),
        (b'{"prompt": "x", "best_of": 3}', "best_of"),
        (b'{"prompt": []}', "prompt"),
    ],
)
def test_parse_refuses(raw, param):
    err = parse(P.CompletionRequest, raw)
    if not isinstance(err, APIError):  # ranges are SamplingParams' to check
        err = parse_params(err)
    assert isinstance(err, APIError) and err.status == 400 and err.param == param


def test_admission_and_retry_after():
    assert admit(0, 1) and not admit(1, 1) and not admit(0, 0)
    assert retry_after_s(10, 0.0) == 1  # no history: do not guess high
    assert retry_after_s(10, 2.0) == 5
    assert retry_after_s(10_000, 1.0) == 60
    m = RateMeter(window_s=10)
    for t in range(20):
        m.add(float(t))
    assert m.rate_per_s(19.5) == pytest.approx(1.0)
    assert m.rate_per_s(100.0) == 0.0


def test_token_bytes_survive_split_utf8(tiny_offline):
    tok = tiny_offline.tokenizer
    text = TokenText(tok)
    ids = tok.encode("é€", add_special_tokens=False)  # byte-level tiny vocab: one token per byte
    assert len(ids) == 5 and all(text(i) == "\ufffd" for i in ids)
    assert bytes(b for i in ids for b in text.bytes_of(i)).decode() == "é€"


def test_sse_framing():
    assert sse({"a": "é"}) == 'data: {"a":"é"}\n\n'


def test_loading_engine_answers_503_then_reports_the_load_failure():
    from pdserve.server.app import ServerSettings, build_app
    from pdserve.server.async_engine import AsyncEngine
    from pdserve.server.metrics import ServerMetrics

    release = threading.Event()

    def slow_failing_load():
        release.wait(10)
        raise RuntimeError("no such model")

    async def main():
        engine = AsyncEngine(slow_failing_load, ServerMetrics)
        app = build_app(engine, ServerSettings())
        engine.start()  # the ASGI transport does not run the lifespan
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            h = await c.get("/health")
            r = await c.post("/v1/completions", json={"prompt": "hi"})
            release.set()
            await asyncio.wait_for(engine.ready.wait(), 10)
            failed = await c.get("/health")
        await engine.shutdown()
        return h, r, failed

    h, r, failed = asyncio.run(main())
    assert h.status_code == 503 and h.json()["status"] == "loading"
    assert r.status_code == 503 and r.headers["Retry-After"] == "1"
    assert failed.status_code == 503 and "no such model" in failed.json()["reason"]


@pytest.mark.parametrize("cls", ["CompletionFormatter", "ChatFormatter"])
def test_templated_chunk_equals_the_dict_chunk(cls):
    from pdserve.server import format as F
    from pdserve.server.engine_client import ChoiceOutput

    fmt = getattr(F, cls)("cmpl-1", 'model "x"', None, 2, None)
    out = ChoiceOutput(new_token_ids=[1], new_text='a"é\n\\')
    for include_usage in (False, True):
        want = fmt.chunk(1, out) | ({"usage": None} if include_usage else {})
        assert json.loads(fmt.chunk_json(1, out, include_usage)) == want


@pytest.mark.parametrize(
    "raw,param",
    [
        (rb'{"prompt": "\ud800"}', "prompt"),
        (rb'{"prompt": ["fine", "a\udfffb"]}', "prompt.1"),
        (rb'{"prompt": "x", "user": "\udc00"}', "user"),  # ignored or not, it is not Unicode
        (rb'{"prompt": "x", "extra": {"\ud800": 1}}', "extra"),  # the key itself cannot be sent back
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
        (b'{"prompt": "\xed\xa0\x80"}', None),  # a surrogate encoded as UTF-8 bytes: invalid UTF-8
        (b'{"prompt": "x", "stop": ' + json.dumps(["s"] * 100_000).encode() + b"}", "stop"),
        (b'{"prompt": "x", "stop": "' + b"x" * 500_000 + b'"}', "stop"),
        (b'{"prompt": "x", "priority": 9223372036854775808}', "priority"),
        (b'{"prompt": "x", "seed": 18446744073709551615, "n": 2}', "seed"),
    ],
)
def test_parse_refuses_what_is_not_unicode_too_deep_or_too_big(raw, param):
    err = parse(P.CompletionRequest, raw)
    if not isinstance(err, APIError):
        err = parse_params(err)
    assert isinstance(err, APIError) and err.status == 400 and err.param == param, err
    json.dumps(err.body(), ensure_ascii=False).encode()  # the error itself can be sent


@pytest.mark.parametrize(
    "raw,prompt",
    [
        (rb'{"prompt": "\ud83d\ude00"}', "\U0001f600"),  # a surrogate pair is one character
        (rb'{"prompt": "\\ud800"}', "\\ud800"),  # an escaped backslash, then text
        (b'\xef\xbb\xbf{"prompt": "x"}', "x"),  # a UTF-8 byte order mark
    ],
)
def test_parse_accepts_valid_unicode(raw, prompt):
    assert parse(P.CompletionRequest, raw).prompt == prompt


def test_chat_messages_are_checked_for_surrogates_and_depth():
    err = parse(
        P.ChatCompletionRequest,
        rb'{"messages": [{"role": "user", "content": [{"type": "text", '
        rb'"text": "ok"}, {"type": "text", "text": "\ud800"}]}]}',
    )
    assert err.status == 400 and err.param == "messages.0.content.1.text"
    nested = b'{"messages": [{"role": "user", "content": ' + b"[" * 5000 + b"]" * 5000 + b"}]}"
    err = parse(P.ChatCompletionRequest, nested)
    assert err.status == 400 and err.code == "invalid_json"


def test_openapi_describes_the_request_bodies():
    from pdserve.server.app import ServerSettings, build_app

    doc = build_app(None, ServerSettings()).openapi()
    schemas = doc["components"]["schemas"]
    for path, model in [
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
        ("/tokenize", "TokenizeRequest"),
    ]:
        body = doc["paths"][path]["post"]["requestBody"]
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
        assert model in schemas
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == P.MAX_N
    assert "get" in doc["paths"]["/v1/models"]
    refs = {v for v in _walk(doc) if isinstance(v, str) and v.startswith("#/")}
    assert all(r.removeprefix("#/components/schemas/") in schemas for r in refs), refs


def _walk(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)
    else:
        yield node


def test_continuous_usage_counts_each_choice_on_from_a_resume():
    from pdserve.server import format as F
    from pdserve.server.engine_client import ChoiceOutput
    from pdserve.server.streaming import sse_events

    class Group:  # two steps of the one choice still running (client index 1)
        def __init__(self):
            self.batches = [[(0, ChoiceOutput([5], "x"))], [(0, ChoiceOutput([6, 7], "yz"))]]

        async def next_batch(self):
            return self.batches.pop(0) if self.batches else None

        def abort(self):
            pass

    async def run():
        fmt = F.CompletionFormatter("cmpl-1", "m", None, 2, None)
        events = sse_events(
            Group(),
            fmt,
            True,
            10,
            indices=[1],
            preamble=False,
            choice_prompt_tokens=[5, 5],
            choice_tokens_before={0: 4, 1: 3},
        )
        return [e async for e in events]

    chunks = [json.loads(e[6:]) for e in asyncio.run(run()) if e.startswith("data: {")]
    assert [c["usage"]["completion_tokens"] for c in chunks[:2]] == [4, 6]  # 3 streamed before the resume
    assert all(c["usage"]["prompt_tokens"] == 5 for c in chunks[:2])
