"""Structured outputs through the OpenAI API (the real `openai` client against the tiny-model
server): OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields."""

import json
import re

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "a person, as JSON"}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def test_response_format_json_schema_on_chat(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=400,
        temperature=0.7,
        seed=3,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}},
    )
    for c in r.choices:
        obj = json.loads(c.message.content)
        assert set(obj) == {"name", "age"} and isinstance(obj["age"], int) and c.finish_reason == "stop"


def test_response_format_json_object_streamed(client):
    chunks = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=400,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
        extra_body={"structured_outputs": None},  # an explicit null beside it is no second constraint
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)


def test_vllm_fields_on_completions(client):
    r = client.completions.create(
        model="tiny", prompt="pick one:", max_tokens=20, extra_body={"guided_choice": ["left", "right"]}
    )
    assert r.choices[0].text in ("left", "right") and r.choices[0].finish_reason == "stop"
    r = client.completions.create(
        model="tiny",
        prompt="a code:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{2}"}, "guided_decoding_backend": "xgrammar"},
    )
    assert re.fullmatch("[A-Z]{3}-[0-9]{2}", r.choices[0].text)
    r = client.completions.create(
        model="tiny",
        prompt="json:",
        max_tokens=200,
        # the legacy API's client has no response_format argument; vLLM's server takes it there too
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}},
    )
    assert set(json.loads(r.choices[0].text)) == {"name", "age"}


@pytest.mark.parametrize(
    "kw, param, words",
    [
        (dict(extra_body={"guided_regex": "[a-"}), "structured_outputs", "invalid regex"),
        (dict(extra_body={"guided_json": {"type": "bogus"}}), "structured_outputs", "bogus"),
        (
            dict(response_format={"type": "json_object"}, extra_body={"guided_choice": ["a"]}),
            "guided_choice",
            "one output constraint",
        ),
        (
            dict(extra_body={"structured_outputs": {"json_object": True, "whitespace_pattern": " "}}),
            "structured_outputs",
            "whitespace_pattern",
        ),  # fmt: skip
    ],
)
def test_bad_constraints_are_400s_that_name_the_field(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, **kw)
    assert e.value.body["param"].startswith(param) and words in e.value.body["message"]
    # and the server goes on serving
    assert client.chat.completions.create(model="tiny", messages=USER, max_tokens=2).usage.completion_tokens == 2


def test_disaggregated_deployment_holds_the_output_to_its_schema(tiny_model_dir):
    """Router, prefill and decode workers as real processes: the prefill worker samples the
    first token under the mask, the decode worker the rest; a bad schema is the client's 400
    from the router, not a 5xx."""
    from tests.server.deployment import Deployment

    with Deployment(tiny_model_dir, "--served-model-name", "tiny") as dep:
        assert {w["role"] for w in dep.workers().values()} >= {"prefill", "decode"}
        with openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            r = c.chat.completions.create(
                model="tiny",
                messages=USER,
                max_tokens=300,
                extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
            )
            assert set(json.loads(r.choices[0].message.content)) == {"name", "age"}
            with pytest.raises(openai.BadRequestError) as e:
                c.chat.completions.create(model="tiny", messages=USER, max_tokens=5, extra_body={"guided_regex": "(("})
            assert e.value.body["param"] == "structured_outputs"
