"""Tool calls with tool_choice "required" or a named function, through the real `openai`
client against the tiny-model server: the arguments are generated under the tools' JSON
schemas (structured outputs), so every call parses, whatever the weights."""

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "what is the weather in Paris, and what is 2 + 3?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NO_SPACE = {"structured_outputs": None}


def check_args(name: str, arguments: str) -> None:
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F") and len(args["city"]) <= 10
    else:
        assert set(args) == {"a", "b"} and all(isinstance(v, int) for v in args.values())


def test_a_named_function_is_called(client):
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=400,
        tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    msg = r.choices[0].message
    assert msg.content is None and len(msg.tool_calls) == 1 and r.choices[0].finish_reason == "stop"
    call = msg.tool_calls[0]
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("chatcmpl-tool-")
    check_args("add", call.function.arguments)


def test_required_calls_at_least_one_tool(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=800, temperature=0.8, seed=2, n=2, tools=[WEATHER, ADD],
        tool_choice="required",
    )  # fmt: skip
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert calls and choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in calls:
            assert call.function.name in ("get_weather", "add")
            check_args(call.function.name, call.function.arguments)
        assert len({c.id for c in calls}) == len(calls)


def test_required_without_parallel_calls_makes_one_call(client):
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=800, temperature=0.8, seed=2, n=3, tools=[WEATHER, ADD],
        tool_choice="required", parallel_tool_calls=False,
    )  # fmt: skip
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        check_args(call.function.name, call.function.arguments)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_assemble_into_valid_calls(client, choice):
    stream = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=800, tools=[WEATHER, ADD], tool_choice=choice, stream=True
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            assert not c.delta.content
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name:
                    call["name"] = d.function.name
                call["arguments"] += d.function.arguments or ""
            finish = c.finish_reason or finish
    assert calls and finish == ("tool_calls" if choice == "required" else "stop")
    for call in calls.values():
        check_args(call["name"], call["arguments"])


def test_a_conversation_with_earlier_calls_is_accepted(client):
    """The assistant's earlier call and the tool's answer go back in the messages (OpenAI's
    shape); they reach the chat template."""
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "5"},
    ]  # fmt: skip
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, tools=[ADD], tool_choice="none")
    assert r.choices[0].message.content is not None and not r.choices[0].message.tool_calls


def test_tool_choice_with_another_constraint_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=5, tools=[ADD], tool_choice="required",
            response_format={"type": "json_object"},
        )  # fmt: skip
    assert e.value.body["param"] == "tool_choice"


def test_tool_schemas_as_clients_send_them(client):
    """Pydantic-made tools keep nested models in `$defs` (moved to the root of the "required"
    list's schema, where their references point); `parameters: {}` is a function without
    arguments; a malformed tool_choice or x-guidance is a 400, not a 500."""
    point = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Point"}},
                "required": ["to"],
                "additionalProperties": False,
                "$defs": {
                    "Point": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"],
                        "additionalProperties": False,
                    }
                },
            },
        },
    }
    ping = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    r = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=400, tools=[point, ping], tool_choice="required"
    )
    for call in r.choices[0].message.tool_calls:
        args = json.loads(call.function.arguments)
        assert args == {} if call.function.name == "ping" else set(args["to"]) == {"x", "y"}
    r = client.chat.completions.create(
        model="tiny",
        messages=USER,
        max_tokens=50,
        tools=[ping],
        tool_choice={"type": "function", "function": {"name": "ping"}},
    )
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {}
    for bad in ({"type": "function", "function": "ping"}, {"type": "function", "function": None}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=USER, max_tokens=5, tools=[ping], tool_choice=bad)
        assert e.value.body["param"] == "tool_choice"
    odd = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "x-guidance": "a"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=USER,
            max_tokens=5,
            tools=[odd],
            tool_choice={"type": "function", "function": {"name": "odd"}},
        )
    assert e.value.body["param"] == "tools"


def test_earlier_calls_reach_the_template_with_their_arguments_as_a_mapping():
    from pdserve.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}]},
            {"role": "assistant", "content": "x", "tool_calls": []}]}
    )  # fmt: skip
    first, second = req.conversation()
    assert first["tool_calls"][0]["function"]["arguments"] == {"a": 2} and "tool_calls" not in second
