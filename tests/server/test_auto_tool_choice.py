"""tool_choice "auto" with a tool-call parser (server/tool_parsers.py): the model's own
`<tool_call>` blocks become OpenAI's tool_calls. The parser on its own (whole and streamed in
every split), then a real server (`--enable-auto-tool-choice --tool-call-parser hermes`) and
the `openai` client, the tiny model's output held by a regex to text with a call in it."""

import json
import random

import pytest

from pdserve.server.tool_parsers import HermesStream, parse
from tests.server.conftest import tiny_openai

TEXT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
CALLS = [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Paris"}')]


def test_whole_outputs():
    assert parse(TEXT) == ("Let me check.", CALLS)
    assert parse("just an answer, with <tool in it") == ("just an answer, with <tool in it", [])
    # not a call: the model's text as it wrote it
    assert parse("<tool_call>{not json}</tool_call> x") == ("<tool_call>{not json}</tool_call> x", [])
    assert parse('<tool_call>{"name": "add", "arguments": {}}') == (None, [("add", "{}")])  # no closing tag
    assert parse('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == (None, [("add", '{"a": 1}')])


@pytest.mark.parametrize("seed", range(40))
def test_streamed_in_any_split_gives_the_same_calls(seed):
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, len(TEXT)), r.randint(1, 40)))
    reader, content, calls, prev = HermesStream(), "", [], 0
    for cut in [*cuts, len(TEXT)]:
        c, k = reader.feed(TEXT[prev:cut])
        content, calls, prev = content + c, calls + k, cut
        assert "<" not in c  # nothing of a tag ever goes out as content
    c, k = reader.finish()
    assert calls + k == CALLS and (content + c).strip() == "Let me check."


openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
]
USER = [{"role": "user", "content": "2 + 3?"}]
# what a Hermes-style model writes when it calls a tool (the tiny model is held to it)
CALL_REGEX = r'Let me see\.\n<tool_call>\n\{"name": "add", "arguments": \{"a": [0-9], "b": [0-9]\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def auto_client(server_model_dir):
    with tiny_openai(server_model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as client:
        yield client


@pytest.mark.integration
def test_auto_returns_the_calls_the_model_wrote(auto_client):
    r = auto_client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=200, extra_body={"guided_regex": CALL_REGEX}
    )
    choice = r.choices[0]
    assert choice.message.content == "Let me see." and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}


@pytest.mark.integration
def test_auto_streamed(auto_client):
    stream = auto_client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, tool_choice="auto", max_tokens=200, stream=True,
        extra_body={"guided_regex": CALL_REGEX},
    )  # fmt: skip
    content, calls, finish = "", [], None
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert content.strip() == "Let me see." and finish == "tool_calls"
    assert [c.function.name for c in calls] == ["add"] and calls[0].index == 0
    assert set(json.loads(calls[0].function.arguments)) == {"a", "b"}


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_auto_without_parallel_calls_returns_the_first(auto_client, stream):
    two = CALL_REGEX + r'\n<tool_call>\n\{"name": "get_weather", "arguments": \{\}\}\n</tool_call>'
    kw = dict(model="tiny", messages=USER, tools=TOOLS, max_tokens=300, parallel_tool_calls=False)
    r = auto_client.chat.completions.create(stream=stream, extra_body={"guided_regex": two}, **kw)
    if not stream:
        assert [c.function.name for c in r.choices[0].message.tool_calls] == ["add"]
        return
    calls = [t for chunk in r for c in chunk.choices for t in c.delta.tool_calls or []]
    assert [c.function.name for c in calls] == ["add"] and calls[0].index == 0


@pytest.mark.integration
def test_auto_without_a_call_is_an_answer(auto_client):
    r = auto_client.chat.completions.create(
        model="tiny", messages=USER, tools=TOOLS, max_tokens=20, extra_body={"guided_regex": "It is 5\\."}
    )
    assert r.choices[0].message.content == "It is 5." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_blank_text_between_answer_pieces_survives_a_call_streamed():
    pieces = ["Hi", "<tool_call>", '{"name":"add","arguments":{}}', "</tool_call>", "Line1", "\n\n", "Line2", " ", "x"]
    reader, content = HermesStream(), ""
    for p in pieces:
        content += reader.feed(p)[0]
    content += reader.finish()[0]
    assert content == "HiLine1\n\nLine2 x" == parse("".join(pieces))[0]


def test_what_is_not_a_call_stays_text():
    deep = "<tool_call>" + "[" * 100_000 + "</tool_call>"
    assert parse(deep) == (deep, [])  # nested past the JSON parser: text, not a 500
    nan = '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'
    assert parse(nan) == (nan, [])  # NaN is not JSON (a JavaScript client would refuse it)


def test_a_long_call_in_many_pieces():
    body = '{"name": "f", "arguments": {"s": "' + "ab" * 20_000 + '"}}'
    reader, calls = HermesStream(), []
    for i in range(0, len(body), 3):
        calls += reader.feed(("<tool_call>" if i == 0 else "") + body[i : i + 3])[1]
    calls += reader.feed("</tool_call>")[1]
    assert calls == [("f", json.dumps({"s": "ab" * 20_000}))]


@pytest.mark.integration
def test_auto_with_the_pythonic_parser_whole_and_streamed(server_model_dir):
    """Another syntax through the same server path: `--tool-call-parser pythonic`."""
    with tiny_openai(server_model_dir, "--enable-auto-tool-choice", "--tool-call-parser", "pythonic") as client:
        kw = dict(model="tiny", messages=USER, tools=TOOLS, max_tokens=60)
        extra = {"guided_regex": r"\[add\(a=[0-9], b=[0-9]\)\]"}
        r = client.chat.completions.create(extra_body=extra, **kw)
        assert r.choices[0].message.content is None and r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
        calls, content, finish = [], "", None
        for chunk in client.chat.completions.create(stream=True, extra_body=extra, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                calls += c.delta.tool_calls or []
                finish = c.finish_reason or finish
        assert content == "" and finish == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in calls] == [("add", call.function.arguments)]
        # an answer that is not a call is content, streamed as it comes
        r = client.chat.completions.create(extra_body={"guided_regex": "It is 5\\."}, **kw)
        assert r.choices[0].message.content == "It is 5." and r.choices[0].finish_reason == "stop"
