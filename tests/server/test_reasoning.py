"""--reasoning-parser (server/reasoning.py): a reasoning model's <think>...</think> returned apart
from its answer, whole and streamed in any split; then a real server, the tiny model held by a
regex to such text, with the openai client, alone and with tool_choice auto."""

import json
import random

import pytest

from pdserve.server.reasoning import PARSERS, ReasoningStream, split
from pdserve.settings import FrontendConfig
from tests.server.conftest import tiny_openai

CASES = [
    # parser, output, thinking, answer
    ("deepseek_r1", "Let me add.</think>\n\nIt is 4.", "Let me add.", "\n\nIt is 4."),
    ("deepseek_r1", "<think>Let me add.</think>It is 4.", "Let me add.", "It is 4."),
    ("deepseek_r1", "still thinking when max_tokens came", "still thinking when max_tokens came", None),
    ("qwen3", "<think>\nLet me add.\n</think>\n\nIt is 4.", "\nLet me add.\n", "\n\nIt is 4."),
    ("qwen3", "It is 4.", None, "It is 4."),  # thinking switched off: all answer
    ("qwen3", "  <thin", None, "  <thin"),  # not a tag after all
    ("qwen3", "<think>cut short", "cut short", None),
]
CONSTRAINED = [  # held to a grammar: thinking only after an opening tag, whatever the parser
    ("deepseek_r1", '{"a": 1}', None, '{"a": 1}'),
    ("deepseek_r1", "<think>first</think>{}", "first", "{}"),
]


@pytest.mark.parametrize("parser, text, thought, answer", CONSTRAINED)
def test_constrained_outputs(parser, text, thought, answer):
    assert split(text, parser, constrained=True) == (thought, answer)


def test_every_parser_is_a_choice_of_the_flag():
    from pdserve.flags import Section, settings

    (flag,) = [s for s in settings(Section(FrontendConfig)) if s.name == "reasoning_parser"]
    assert flag.meta["choices"] == PARSERS


@pytest.mark.parametrize("parser, text, thought, answer", CASES)
def test_whole(parser, text, thought, answer):
    assert split(text, parser) == (thought, answer)


@pytest.mark.parametrize("parser, text, thought, answer", CASES)
@pytest.mark.parametrize("seed", range(10))
def test_streamed_in_any_split_gives_the_same(parser, text, thought, answer, seed):
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(1, 20))))
    s, got_t, got_a, prev = ReasoningStream(parser), "", "", 0
    for cut in [*cuts, len(text)]:
        t, a = s.feed(text[prev:cut])
        got_t, got_a, prev = got_t + t, got_a + a, cut
        assert "<think>" not in t + a and "</think>" not in t + a
    t, a = s.finish()
    assert (got_t + t or None, got_a + a or None) == (thought, answer)


openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
USER = [{"role": "user", "content": "2 + 2?"}]
THINK = r"<think>I add two and two\.</think>It is 4\."


@pytest.fixture(scope="module")
def r1_client(server_model_dir):
    flags = ("--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with tiny_openai(server_model_dir, *flags) as client:
        yield client


@pytest.mark.integration
def test_the_thinking_comes_apart_whole_and_streamed(r1_client):
    kw = dict(model="tiny", messages=USER, max_tokens=80, extra_body={"guided_regex": THINK})
    m = r1_client.chat.completions.create(**kw).choices[0].message.model_dump()
    assert (m["reasoning"], m["reasoning_content"], m["content"]) == ("I add two and two.",) * 2 + ("It is 4.",)
    thought, answer = "", ""
    for chunk in r1_client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta.model_dump()
            thought += d.get("reasoning") or ""
            answer += d.get("content") or ""
    assert (thought, answer) == ("I add two and two.", "It is 4.")
    # vLLM's include_reasoning: false leaves it out
    kw["extra_body"] = {"guided_regex": THINK, "include_reasoning": False}
    m = r1_client.chat.completions.create(**kw).choices[0].message.model_dump()
    assert m.get("reasoning") is None and m["content"] == "It is 4."
    # the earlier thinking sent back is accepted (and reaches templates as reasoning_content)
    history = USER + [{"role": "assistant", "content": "It is 4.", "reasoning_content": "I add."}]
    r = r1_client.chat.completions.create(
        model="tiny", messages=history + USER, max_tokens=2, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 2


@pytest.mark.integration
def test_a_tool_call_after_the_thinking(r1_client):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    regex = r'<think>I need the tool\.</think><tool_call>\n\{"name": "add", "arguments": \{"a": 2\}\}\n</tool_call>'
    r = r1_client.chat.completions.create(
        model="tiny", messages=USER, tools=tools, max_tokens=120, extra_body={"guided_regex": regex}
    )
    m = r.choices[0].message
    assert m.model_dump()["reasoning"] == "I need the tool." and r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("add", {"a": 2})]
    # a named tool is a constrained output: no thinking in it, nothing is split off
    r = r1_client.chat.completions.create(
        model="tiny", messages=USER, tools=tools, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "add"}},
    )  # fmt: skip
    assert r.choices[0].message.tool_calls and r.choices[0].message.model_dump().get("reasoning") is None


@pytest.mark.integration
def test_a_structured_output_holds_once_the_thinking_is_closed(tmp_path):
    """A model whose tokenizer has <think> and </think>: with a reasoning parser the schema holds
    only after </think> (vLLM's way), and the reply splits as any reply."""
    from tests.tiny import TEMPLATE, write_tiny_model

    d = write_tiny_model(str(tmp_path / "m"), max_pos=2048, added_tokens=("<think>", "</think>"))
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["a"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    from tokenizers import Tokenizer

    end_id = Tokenizer.from_file(f"{d}/tokenizer.json").token_to_id("</think>")
    with tiny_openai(d, "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template") as client:
        kw = dict(model="tiny", messages=USER, max_tokens=200, temperature=0, response_format=fmt)
        r = client.chat.completions.create(**kw, logit_bias={str(end_id): 100})
        m = r.choices[0].message.model_dump()
        assert not m.get("reasoning") and isinstance(json.loads(m["content"])["a"], int)
        # thinking that never closes: all reasoning, no answer (max_tokens came first)
        r = client.chat.completions.create(**dict(kw, max_tokens=12))
        m = r.choices[0].message.model_dump()
        assert m.get("reasoning") and not m["content"] and r.choices[0].finish_reason == "length"
        # a named tool: the call comes after the thinking; thinking cut short by max_tokens is no call
        tools = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
        named = dict(
            kw, response_format=None, tools=tools, tool_choice={"type": "function", "function": {"name": "add"}}
        )
        r = client.chat.completions.create(**named, logit_bias={str(end_id): 100})
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "add" and isinstance(json.loads(call.function.arguments)["a"], int)
        r = client.chat.completions.create(**dict(named, max_tokens=12))
        m = r.choices[0].message
        assert m.model_dump().get("reasoning") and not m.tool_calls and not m.content
        deltas = [c.choices[0].delta for c in client.chat.completions.create(**dict(named, max_tokens=12), stream=True)]
        assert not any(d.tool_calls for d in deltas) and "".join(d.model_dump().get("reasoning") or "" for d in deltas)
        # a template that closes the thinking (Qwen3's with thinking off, served with deepseek_r1):
        # held from the first token, and read as all answer
        off = TEMPLATE.replace("assistant\n{% endif %}", "assistant\n<think>\n\n</think>\n\n{% endif %}")
        assert off != TEMPLATE
        r = client.chat.completions.create(**kw, extra_body={"chat_template": off})
        m = r.choices[0].message.model_dump()
        assert not m.get("reasoning") and isinstance(json.loads(m["content"])["a"], int)
        # /v1/completions too (vLLM's reasoner runs on every request): free text until </think>,
        # the schema after it; a prompt that closed the thinking is held from its first token
        comp = dict(model="tiny", max_tokens=200, temperature=0, extra_body={"response_format": fmt})
        r = client.completions.create(prompt="hi", **dict(comp, max_tokens=12))
        assert r.choices[0].finish_reason == "length" and "</think>" not in r.choices[0].text
        with pytest.raises(ValueError):  # thinking, not yet JSON
            json.loads(r.choices[0].text)
        r = client.completions.create(prompt="hi", logit_bias={str(end_id): 100}, **comp)
        thought, _, answer = r.choices[0].text.partition("</think>")
        assert isinstance(json.loads(answer)["a"], int), r.choices[0].text
        r = client.completions.create(prompt="hi <think>\n\n</think>\n\n", **comp)
        assert isinstance(json.loads(r.choices[0].text)["a"], int)
