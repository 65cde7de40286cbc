"""The tool-call parsers besides hermes (server/tool_parsers.py): llama3_json, pythonic and
mistral, whole and streamed in every split, and text that only looks like calls."""

import json
import random

import pytest

from pdserve.server.tool_parsers import PARSERS, parse, reader
from pdserve.settings import FrontendConfig

CALLS = [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Paris"}')]
SAMPLES = {
    "llama3_json": [
        ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", "parameters": {"city": "Paris"}}',
         None, CALLS),
        ('<|python_tag|>{"name": "add", "arguments": {"a": 1, "b": 2}}\n', None, CALLS[:1]),
        ("The answer is 3.", "The answer is 3.", []),
        ('{"answer": 3}', '{"answer": 3}', []),  # JSON, but not a call: the text as written
        ('{"name": "add", "parameters": {"a": 1}} and then some', '{"name": "add", "parameters": {"a": 1}} and then some', []),
    ],
    "pythonic": [
        ('[add(a=1, b=2), get_weather(city="Paris")]', None, CALLS),
        ('<|python_start|>[add(a=1, b=2)]<|python_end|>', None, CALLS[:1]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("[add(a=__import__('os').getcwd())]", "[add(a=__import__('os').getcwd())]", []),  # never evaluated
        ("[add(1, 2)]", "[add(1, 2)]", []),  # positional arguments have no names
        ("Sure: 3", "Sure: 3", []),
    ],
    "mistral": [
        ('Let me check.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
         '{"name": "get_weather", "arguments": {"city": "Paris"}}]', "Let me check.", CALLS),
        ('[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]get_weather{"city": "Paris"}', None, CALLS),
        ("no calls [TOOL here", "no calls [TOOL here", []),
        ("[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
    ],
}  # fmt: skip


def test_every_parser_is_a_choice_of_the_flag():
    from pdserve.flags import Section, settings

    (flag,) = [s for s in settings(Section(FrontendConfig)) if s.name == "tool_call_parser"]
    assert flag.meta["choices"] == PARSERS


@pytest.mark.parametrize("parser, text, content, calls", [(p, *s) for p, ss in SAMPLES.items() for s in ss])
def test_whole_outputs(parser, text, content, calls):
    assert parse(text, parser) == (content, calls)


@pytest.mark.parametrize("parser, text, content, calls", [(p, *s) for p, ss in SAMPLES.items() for s in ss])
@pytest.mark.parametrize("seed", range(8))
def test_streamed_in_any_split_gives_the_same(parser, text, content, calls, seed):
    r = random.Random(seed)
    cuts = sorted(r.sample(range(1, len(text)), min(len(text) - 1, r.randint(1, 30))))
    rd, got, found, prev = reader(parser), "", [], 0
    for cut in [*cuts, len(text)]:
        c, k = rd.feed(text[prev:cut])
        got, found, prev = got + c, found + k, cut
        if calls:
            assert "TOOL_CALLS" not in c and not c.lstrip().startswith(("{", "["))  # nothing of a call as text
    c, k = rd.finish()
    assert found + k == calls and (got + c).strip() == (content or "")
    assert rd.seen_call == bool(calls)


def test_unknown_parser():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        reader("nope")


@pytest.mark.parametrize("parser, opener", [("llama3_json", "{"), ("pythonic", "["), ("mistral", "[TOOL_CALLS][")])
def test_nesting_past_the_parsers_is_text_not_an_error(parser, opener):
    deep = opener + "[" * 100_000
    assert parse(deep, parser) == (deep, [])


def test_a_long_call_in_many_pieces():
    args = {"s": "ab" * 50_000}
    text = '[f(s="' + args["s"] + '")]'
    rd, calls = reader("pythonic"), []
    for i in range(0, len(text), 3):
        calls += rd.feed(text[i : i + 3])[1]
    assert calls + rd.finish()[1] == [("f", json.dumps(args))]


@pytest.mark.parametrize(
    "parser, text",
    [
        ("pythonic", "[" + "a." * 400 + "f(x=1)]"),  # a dotted name deep enough to exhaust a printer
        ("pythonic", "[f().g(a=1)]"),  # not a plain name
        ("llama3_json", '{"name": "f", "parameters": ' + "[" * 990 + "]" * 990 + "}"),
        ("llama3_json", '{"name": "Alice", "city": "Paris", "age": 31}'),  # a JSON answer, no arguments
        ("pythonic", "[f(a=1e999)]"),  # infinity is not JSON
        ("mistral", '[TOOL_CALLS]f{"a": 1e999}'),
        ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1e999}}</tool_call>'),
    ],
)
def test_what_only_looks_like_calls_is_text_and_never_an_error(parser, text):
    assert parse(text, parser) == (text, [])
    rd = reader(parser)
    got = rd.feed(text)[0] + rd.finish()[0]
    assert got == text


def test_mistral_reads_in_linear_time_and_as_vllm_does():
    import time

    blank = "[TOOL_CALLS]a" + " " * 40_000 + "x"
    t0 = time.perf_counter()
    assert parse(blank, "mistral") == (blank, [])
    assert time.perf_counter() - t0 < 0.5  # was 5 s: two adjacent \s* in the name pattern
    # text after a list of calls is ignored, segments without a call are skipped
    assert parse('[TOOL_CALLS][{"name": "f", "arguments": {}}] trailing', "mistral") == (None, [("f", "{}")])
    assert parse('a[TOOL_CALLS] b [TOOL_CALLS]f [ARGS] {"a": 1}', "mistral") == ("a", [("f", '{"a": 1}')])


def test_wrapper_tags_go_only_from_the_ends():
    text = '<|python_tag|>{"name": "f", "parameters": {"s": "x<|python_tag|>y"}}'
    assert parse(text, "llama3_json") == (None, [("f", '{"s": "x<|python_tag|>y"}')])
    assert parse('[f(x="<|python_end|>")]', "pythonic") == (None, [("f", '{"x": "<|python_end|>"}')])
