"""Structured outputs (pdserve/engine/structured_outputs.py) on the tiny random-weight model:
whatever the weights, every output is in the constraint's language and ends when it is
complete. The tiny model's vocabulary is its 256 bytes, so the mask decides every character."""

import json
import re

import pytest

from pdserve import SamplingParams
from pdserve.control_api import params_from_json, params_to_json
from pdserve.engine.sampling_params import InvalidRequest, StructuredOutputsParams
from pdserve.transfer.bridge import PrefillBridge
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import TcpKVSender

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"enum": ["red", "green"]},
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["n", "ok", "tag", "name"],
    "additionalProperties": False,
}
PROMPTS = ["hello", "x y z", "a longer prompt about nothing at all"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-structured")), max_pos=2048)


@pytest.fixture
def llm(model_dir):
    from pdserve import LLM

    return LLM(model_dir, dtype="float32", block_size=4, num_gpu_blocks=4096, max_num_batched_tokens=64)


def check_schema(text: str) -> None:
    obj = json.loads(text)
    assert set(obj) == {"n", "ok", "tag", "name"}, obj
    assert isinstance(obj["n"], int) and 0 <= obj["n"] <= 999 and isinstance(obj["ok"], bool)
    assert obj["tag"] in ("red", "green") and isinstance(obj["name"], str) and len(obj["name"]) <= 6


def run(llm, so, **kw):
    params = SamplingParams(max_tokens=kw.pop("max_tokens", 400), structured_outputs=so, **kw)
    return [o.outputs for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=5, n=2)])
@pytest.mark.parametrize("compact", [False, True])
def test_json_schema_outputs_parse_and_follow_the_schema(llm, sampling, compact):
    # the tiny model fills every gap between tokens with the 32 whitespace characters allowed
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact)
    for outs in run(llm, so, max_tokens=1200, **sampling):
        for o in outs:
            assert o.finish_reason == "stop", o.text
            check_schema(o.text)
            if compact:
                assert not re.search(r"\s", o.text.replace(json.loads(o.text)["name"], "")), o.text


def test_regex_choice_and_grammars(llm):
    for outs in run(llm, StructuredOutputsParams(regex=r"[a-c]{2,5}-[0-9]{3}"), temperature=0.8, seed=1):
        assert re.fullmatch(r"[a-c]{2,5}-[0-9]{3}", outs[0].text) and outs[0].finish_reason == "stop"
    for outs in run(llm, StructuredOutputsParams(choice=["alpha", "beta", "gamma"])):
        assert outs[0].text in ("alpha", "beta", "gamma")
    lark = 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "(" num ("," num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?'
    for grammar in (lark, gbnf):
        for outs in run(llm, StructuredOutputsParams(grammar=grammar), max_tokens=60):
            assert re.fullmatch(r"\((\d{1,3})(,\d{1,3})*\)", outs[0].text) or outs[0].finish_reason == "length"


def test_json_object_is_any_object(llm):
    for outs in run(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True)):
        assert isinstance(json.loads(outs[0].text), dict)


def test_unconstrained_rows_of_the_same_batch_are_untouched(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, greedy)
    so = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    mixed = llm.generate(PROMPTS * 2, [greedy] * 3 + [so] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == [o.outputs[0].token_ids for o in alone]
    assert all(re.fullmatch("[0-9]+", o.outputs[0].text) for o in mixed[3:])


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(regex="[a-"), "invalid regex"),
        (dict(json={"type": "bogus"}), "bogus"),
        (dict(json="{not json"), "not JSON"),
        (dict(grammar="start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_when_added(llm, kw, message):
    with pytest.raises(InvalidRequest, match=message) as e:
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(**kw)))
    assert e.value.param == "structured_outputs"
    engine = llm.engine
    assert (
        not engine.has_unfinished_requests() and engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    )


def test_a_long_chain_of_rules_is_compiled_not_a_crash(llm):
    """The library builds a grammar recursively: a schema whose 1,200 definitions refer each to
    the next (52 KB, under the size limit) overflows a normal 8 MB thread stack and kills the
    process (checked: exit 139). It is compiled on a thread with a large stack, and works."""
    defs = {str(i): {"items": {"$ref": f"#/$defs/{i + 1}"}} for i in range(1200)}
    defs["1200"] = {"type": "integer"}
    chain = {"$defs": defs, "$ref": "#/$defs/0"}
    so = StructuredOutputsParams(json=chain, disable_any_whitespace=True)
    compiled = llm.engine.structured.compile(so)
    m = compiled.template.deep_copy()
    assert m.consume_tokens(llm.tokenizer.encode("[" * 1200 + "7" + "]" * 1200, add_special_tokens=False))
    assert m.is_accepting()
    lark = "\n".join(f'r{i}: "x" r{i + 1}' for i in range(1000)) + '\nr1000: "y"\nstart: r0'
    out = llm.generate("x", SamplingParams(max_tokens=1100, structured_outputs=StructuredOutputsParams(grammar=lark)))
    assert out[0].outputs[0].text == "x" * 1000 + "y"


def test_a_deeply_nested_schema_is_refused_not_an_error():
    deep = "[" * 2000 + "]" * 2000
    with pytest.raises(InvalidRequest, match="nested too deeply|not a JSON schema"):
        nested: dict = {}
        cur = nested
        for _ in range(3000):
            cur["anyOf"] = [{}]
            cur = cur["anyOf"][0]
        StructuredOutputsParams(json=nested)
    assert deep  # a deep string is refused at compile time (the library parses text with a depth limit)


def test_the_compiled_grammar_follows_the_content_not_the_object(llm):
    so = StructuredOutputsParams(regex="[0-9]{3}")
    assert re.fullmatch("[0-9]{3}", llm.generate("x", SamplingParams(structured_outputs=so))[0].outputs[0].text)
    so.regex = "[a-z]{3}"  # the same object, changed: compiled anew
    assert re.fullmatch("[a-z]{3}", llm.generate("x", SamplingParams(structured_outputs=so))[0].outputs[0].text)


def test_disable_any_whitespace_wins_over_the_schemas_own_options(llm):
    schema = {"type": "object", "x-guidance": {"whitespace_pattern": "[ ]{1,8}"}}
    compiled = llm.engine.structured.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    m = compiled.template.deep_copy()
    assert not m.consume_tokens(llm.tokenizer.encode("{ }", add_special_tokens=False))
    widened = llm.engine.structured.compile(StructuredOutputsParams(json=schema))
    assert widened.template.deep_copy().consume_tokens(llm.tokenizer.encode("{ }", add_special_tokens=False))


def test_a_parser_limit_mid_output_ends_it_and_says_so(model_dir, caplog, monkeypatch):
    """A regex that compiles but whose lexer outgrows its state limit after a few tokens: the
    output ends there (only EOS is allowed) and the log says why, in one line."""
    from pdserve import LLM
    from pdserve.engine import structured_outputs

    monkeypatch.setitem(structured_outputs._LIMITS, "max_lexer_states", 300)  # what the byte vocabulary reaches
    llm = LLM(model_dir, dtype="float32", block_size=4, num_gpu_blocks=256, max_num_batched_tokens=64)
    so = StructuredOutputsParams(regex="(([^a]{0,30}a)|([^b]{0,29}b)|([^c]{0,28}c)|([^d]{0,27}d)){1,50}")
    with caplog.at_level("WARNING", logger="pdserve.engine.structured_outputs"):
        out = llm.generate("x", SamplingParams(temperature=1.0, seed=0, max_tokens=200, structured_outputs=so))
    assert out[0].outputs[0].finish_reason == "stop" and len(out[0].outputs[0].token_ids) < 200
    lines = [r.getMessage() for r in caplog.records if "structured output ends here" in r.getMessage()]
    assert len(lines) == 1 and "too many states" in lines[0] and len(lines[0]) < 400, lines


@pytest.mark.parametrize(
    "kw",
    [
        {},  # none
        dict(regex="a", choice=["a"]),  # two
        dict(choice=[]),
        dict(choice=["a", ""]),
        dict(choice=["x"] * 1025),
        dict(regex="a" * (64 * 1024 + 1)),
        dict(grammar="start: " + '"a"' * 6000),  # Lark/GBNF: 16 KiB
        dict(json={"description": "x" * (64 * 1024)}),
    ],
)
def test_bad_or_oversized_constraints_are_refused(kw):
    with pytest.raises(InvalidRequest) as e:
        StructuredOutputsParams(**kw)
    assert e.value.param == "structured_outputs"


def test_the_constraint_travels_between_workers_as_json():
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sent = SamplingParams(structured_outputs=so, reasoning_token_ids=[5, 6])
    back = params_from_json(json.loads(json.dumps(params_to_json(sent))))
    assert back.structured_outputs == so and back.needs_penalties and back.reasoning_token_ids == [5, 6]


def test_resumed_output_is_continued_within_the_grammar(llm):
    """A request replayed after its worker died arrives with output already made: the matcher
    consumes it, then holds the rest to the grammar."""
    engine = llm.engine
    tok = llm.tokenizer
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    engine.add_request("r", "hello", SamplingParams(temperature=0, max_tokens=200, structured_outputs=so),
                       resume_token_ids=tok.encode('{"n":12', add_special_tokens=False))  # fmt: skip
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.outputs[0].text.startswith('{"n":12') and final.outputs[0].finish_reason == "stop"
    check_schema(final.outputs[0].text)


def test_output_outside_the_grammar_ends_the_request(llm):
    """Resumed tokens the grammar refuses (a client's own, or from an older worker): the output
    cannot be made valid, so it ends at once (stop) rather than running on unconstrained."""
    engine = llm.engine
    so = StructuredOutputsParams(regex="[0-9]+")
    bad = llm.tokenizer.encode("abc", add_special_tokens=False)
    engine.add_request("r", "hello", SamplingParams(temperature=0, max_tokens=50, structured_outputs=so),
                       resume_token_ids=bad)  # fmt: skip
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].text == "abc"
    assert not engine.structured._guides  # forgotten with the sequence


def test_disaggregated_the_decode_worker_continues_what_prefill_sampled(model_dir):
    """The prefill worker samples the first token under the mask; the decode worker's matcher
    starts from it (and the KV it was sent), so the whole output is valid."""
    from pdserve import LLM

    kw = dict(dtype="float32", block_size=4, num_gpu_blocks=128, max_num_batched_tokens=64)
    secret = b"structured-outputs-test-secret"
    p = LLM(model_dir, **kw).engine
    d = LLM(model_dir, **kw).engine
    rx = KVReceiverServer(d.runner.kv_caches, secret=secret)
    p.bridge = PrefillBridge(TcpKVSender(secret=secret), p.model_config.num_hidden_layers, True)
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    ids = p.tokenizer.encode("hello there")
    try:
        params = SamplingParams(temperature=0, max_tokens=300, structured_outputs=so)
        dest = d.reserve_for_transfer("r", ids, params, rx, deadline_s=60)
        p.add_request("r", ids, SamplingParams(temperature=0, max_tokens=1, structured_outputs=so), kv_destination=dest)
        first = None
        while p.has_unfinished_requests():
            for o in p.step():
                first = o.outputs[0].token_ids[0]
        p.bridge.sender.wait_for_save("r", 60)
        rx.wait_for_all("r", 60)
        rx.cancel("r")
        out = d.activate_transferred("r", first, kv_complete=True)
        while d.has_unfinished_requests():
            out = next((o for o in d.step() if o.finished), out)
        assert out.outputs[0].text.startswith("{") and out.outputs[0].finish_reason == "stop"
        check_schema(out.outputs[0].text)
    finally:
        rx.close()
        p.bridge.sender.close()


@pytest.fixture(scope="module")
def think_llm(tmp_path_factory):
    """A tiny model whose tokenizer has a reasoning model's <think> and </think> tokens."""
    from pdserve import LLM
    from tests.tiny import write_tiny_model

    d = write_tiny_model(str(tmp_path_factory.mktemp("tiny-think")), max_pos=2048, added_tokens=("<think>", "</think>"))
    llm = LLM(d, dtype="float32", block_size=4, num_gpu_blocks=2048, max_num_batched_tokens=64)
    start, end = (llm.tokenizer.encode(t, add_special_tokens=False) for t in ("<think>", "</think>"))
    assert len(start) == len(end) == 1
    return llm, start[0], end[0]


def test_with_reasoning_tokens_the_grammar_holds_after_the_thinking(think_llm):
    """vLLM's way with a reasoning parser: the model thinks freely, and the structured output
    holds from the token after </think> (or from the first where the prompt closed the thinking)."""
    llm, start, end = think_llm
    so = StructuredOutputsParams(json=SCHEMA)
    prompt = llm.tokenizer.encode("hello")
    think = dict(temperature=0, max_tokens=300, structured_outputs=so, reasoning_token_ids=[start, end])
    # </think> pushed to the top: taken at once (the grammar does not hold yet), then the JSON
    bias = {end: 100.0}
    out = llm.generate([prompt], SamplingParams(**think, logit_bias=bias))[0].outputs[0]
    assert out.token_ids[0] == end and out.finish_reason == "stop"
    check_schema(llm.tokenizer.decode(out.token_ids[1:]))
    # without the reasoning tokens the grammar holds from the first token: no </think> there
    held = dict(think, reasoning_token_ids=None)
    out = llm.generate([prompt], SamplingParams(**held, logit_bias=bias))[0].outputs[0]
    assert end not in out.token_ids
    check_schema(out.text)
    # a prompt that closed the thinking (a template with thinking off): held from the first token
    closed = prompt + [start, end]
    out = llm.generate([closed], SamplingParams(**think, logit_bias=bias))[0].outputs[0]
    assert end not in out.token_ids
    check_schema(out.text)
    # ... but not one that opened it again after an earlier turn's </think>
    reopened = prompt + [start, end] + prompt + [start]
    out = llm.generate([reopened], SamplingParams(**think, logit_bias=bias))[0].outputs[0]
    assert out.token_ids[0] == end
    check_schema(llm.tokenizer.decode(out.token_ids[1:]))
    # while it thinks nothing holds it: a token the grammar would refuse, 20 times over
    x = llm.tokenizer.encode("x", add_special_tokens=False)[0]
    out = llm.generate([prompt], SamplingParams(**dict(think, max_tokens=20), logit_bias={x: 100.0}))[0].outputs[0]
    assert out.token_ids == [x] * 20 and out.finish_reason == "length"
    with pytest.raises(InvalidRequest, match="reasoning"):
        llm.generate([prompt], SamplingParams(**dict(think, reasoning_token_ids=[start, 10**6])))
    with pytest.raises(InvalidRequest, match="reasoning"):
        SamplingParams(reasoning_token_ids=[1])
