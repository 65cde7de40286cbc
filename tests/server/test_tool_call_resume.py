"""A streamed tool-call reply resumed after its router died (the front replays the request with
the tokens each choice streamed, `ChatFormatter.resume`): what went out is not sent again, and
what comes next completes the calls. The formatter with the tiny model's real tokenizer."""

import json

import pytest

from pdserve.engine.tokenizer import Tokenizer
from pdserve.server.engine_client import ChoiceOutput, Completion
from pdserve.server.format import ChatFormatter, TokenText
from pdserve.server.protocol import ChatCompletionRequest

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return Tokenizer.from_hf_dir(tiny_model_dir)


def formatter(tok, tool_choice, parser=None, reasoning=None):
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": tool_choice}
    )
    req._auto_tool_parser = parser
    calls = req.tool_calls()
    constrained = calls.parser is None  # named and required calls are generated under a grammar
    return ChatFormatter(
        "id", "tiny", TokenText(tok), 1, None, tool_calls=calls, reasoning=reasoning, constrained=constrained
    )


# a server with a reasoning parser resumes the same way (the calls are its answer)
REASONING = pytest.mark.parametrize("reasoning", [None, "deepseek_r1"])


def resumed(tok, fmt, before: str, after: str) -> list[dict]:
    """Deltas of the resumed stream: `before` had streamed, `after` comes now (then it ends)."""
    fmt.resume(0, tok.encode(before, add_special_tokens=False))
    ids = tok.encode(after, add_special_tokens=False)
    final = Completion(before + after, [], None, "stop")
    chunks = [
        fmt.chunk(0, ChoiceOutput(ids[:1], tok.decode(ids[:1]))),
        fmt.chunk(0, ChoiceOutput(ids[1:], tok.decode(ids[1:]), final=final)),
    ]
    return [c["choices"][0] for c in chunks if c is not None]


@REASONING
def test_a_named_call_resumed_sends_no_second_head(tok, reasoning):
    named = {"type": "function", "function": {"name": "add"}}
    out = resumed(tok, formatter(tok, named, reasoning=reasoning), '{"a": ', "1}")
    args = "".join(d["delta"]["tool_calls"][0]["function"]["arguments"] for d in out if d["delta"])
    assert args == "1}" and all("id" not in d["delta"].get("tool_calls", [{}])[0] for d in out)


@REASONING
def test_a_required_list_resumed_is_parsed_whole(tok, reasoning):
    out = resumed(tok, formatter(tok, "required", reasoning=reasoning), '[{"name": "add", ', '"parameters": {"a": 1}}]')
    (call,) = out[-1]["delta"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1}
    assert out[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("reasoning, before", [(None, "Hi"), ("deepseek_r1", "Hm.</think>Hi")])
def test_an_auto_stream_resumed_inside_a_call(tok, reasoning, before):
    out = resumed(
        tok,
        formatter(tok, "auto", "hermes", reasoning=reasoning),
        before + '<tool_call>{"name": "add", ',
        '"arguments": {}}</tool_call>',
    )
    deltas = [d["delta"] for d in out]
    assert not any(d.get("content") for d in deltas)  # "Hi" had gone out; nothing of the tags does
    (call,) = [c for d in deltas for c in d.get("tool_calls", [])]
    assert call["index"] == 0 and call["function"]["name"] == "add" and out[-1]["finish_reason"] == "tool_calls"
