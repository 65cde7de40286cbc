"""OpenAI's Responses API for text (/v1/responses) with the real openai client: the same text as
the chat route, whole and streamed as typed events, JSON schema output, and what is refused."""

import json

import pytest

from pdserve.server.engine_client import ChoiceOutput, Completion
from pdserve.server.responses import ResponsesFormatter, ResponsesRequest

openai = pytest.importorskip("openai")
USER = [{"role": "user", "content": "what is 2 + 2?"}]


def test_the_same_text_as_chat_whole_and_streamed(client):
    chat = client.chat.completions.create(model="tiny", messages=USER, max_tokens=6, temperature=0)
    r = client.responses.create(model="tiny", input="what is 2 + 2?", max_output_tokens=6, temperature=0)
    assert r.output_text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(client.responses.create(model="tiny", input=USER, max_output_tokens=6, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text


def test_instructions_and_text_parts_make_the_chat_prompt(client):
    a = client.responses.create(
        model="tiny",
        instructions="be brief",
        input=[
            {"role": "developer", "content": "x"},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        ],
        max_output_tokens=3,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "system", "content": "x"},
            {"role": "user", "content": "hi"},
        ],
        max_tokens=3,
        temperature=0,
    )
    assert a.output_text == chat.choices[0].message.content and a.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_output(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="tiny",
        input="a number as JSON",
        max_output_tokens=400,
        text={"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}},
    )
    assert isinstance(json.loads(r.output_text)["n"], int)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "web_search"}]}, "tools"),  # function tools only
        ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice"),  # "auto" needs a tool-call parser
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),  # no call_id
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),  # nothing is stored
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"background": True}, "background"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": "tiny", "input": "hi", **body})
    assert e.value.body["param"] == param


def test_a_reasoning_item_before_the_message():
    """With a reasoning parser the thinking is an output item of its own, whole and streamed."""
    req = ResponsesRequest.model_validate({"input": "hi"})
    pieces = ["<think>I th", "ink</th", "ink>It is", " 4."]
    text = "".join(pieces)

    def fmt():
        return ResponsesFormatter("resp_x", "tiny", None, req, prompt_tokens=3, reasoning="qwen3")

    whole = fmt().full(
        [ChoiceOutput([], "", final=Completion(text, [1, 2, 3, 4], None, "stop"))], {"completion_tokens": 4}
    )
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "I think"
    assert whole["output"][1]["content"][0]["text"] == "It is 4."
    f, events = fmt(), []
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        out = ChoiceOutput([k], p, final=Completion(text, [0, 1, 2, 3], None, "stop") if last else None)
        events += [json.loads(e) for e in f.chunk_json(0, out, False) or []]
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, answer) == ("I think", "It is 4.")
    assert events[-1]["type"] == "response.completed" and events[-1]["response"]["output"] == [
        {**whole["output"][0], "id": events[-1]["response"]["output"][0]["id"]},
        {**whole["output"][1], "id": events[-1]["response"]["output"][1]["id"]},
    ]


@pytest.mark.integration
def test_through_a_disaggregated_deployment(tiny_model_dir):
    """`pdserve serve`: the front relays the events as they come (as chat streams), the router
    runs the request on the prefill and decode workers."""
    from tests.server.deployment import Deployment

    dep = Deployment(tiny_model_dir, "--served-model-name", "tiny")
    try:
        with openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            whole = c.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0)
            events = list(
                c.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0, stream=True)
            )
        assert events[-1].type in ("response.completed", "response.incomplete")
        assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    finally:
        assert dep.stop() == 0


def test_an_earlier_response_sent_back_with_its_reasoning():
    """Clients send the next turn as the history plus the last response's output items: the
    reasoning item is read into the assistant message after it (templates read it there)."""
    req = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "user", "content": "2 + 2?"},
                {
                    "type": "reasoning",
                    "id": "rs_1",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "add"}],
                },
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
                {"role": "user", "content": "and 3 + 3?"},
            ]
        }
    )
    assert req.messages() == [
        {"role": "user", "content": "2 + 2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "and 3 + 3?"},
    ]


ADD = {
    "type": "function",
    "name": "add",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}},
        "required": ["a"],
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_named_and_required(client, stream):
    for choice in ({"type": "function", "name": "add"}, "required"):
        kw = dict(model="tiny", input="add one", tools=[ADD], tool_choice=choice, max_output_tokens=200)
        if stream:
            events = list(client.responses.create(stream=True, **kw))
            assert any(e.type == "response.function_call_arguments.done" for e in events)
            r = events[-1].response
        else:
            r = client.responses.create(**kw)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and all(c.name == "add" and isinstance(json.loads(c.arguments)["a"], int) for c in calls)
        assert len({c.call_id for c in calls}) == len(calls)


def test_the_calls_and_their_outputs_go_back_in_input(client):
    r = client.responses.create(
        model="tiny",
        tools=[ADD],
        tool_choice="none",
        max_output_tokens=3,
        input=[
            {"role": "user", "content": "add one"},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 1}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 2}'},
            {"type": "function_call_output", "call_id": "c1", "output": "2"},
            {"type": "function_call_output", "call_id": "c2", "output": "3"},
        ],
    )
    assert r.output[0].type == "message"
    req = ResponsesRequest.model_validate(
        {"input": [{"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                   {"type": "function_call", "call_id": "c2", "name": "add", "arguments": "{}"},
                   {"type": "function_call_output", "call_id": "c1", "output": "2"}]}
    )  # fmt: skip
    (assistant, tool) = req.messages()
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"] and tool == {
        "role": "tool",
        "tool_call_id": "c1",
        "content": "2",
    }


def test_the_stream_names_each_event_as_openai_does(tiny_server):
    """Each event of a streamed response comes with an `event:` line naming its type (OpenAI's
    wire format; SSE clients dispatch on it), then its data."""
    import httpx

    from tests.server.conftest import API_KEY

    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", tiny_server.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ) as r:
        text = "".join(r.iter_text())
    assert "[DONE]" not in text  # OpenAI's Responses streams end with their last event
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert len(blocks) >= 4 and blocks[-1].startswith("event: response.incomplete\n")  # max_output_tokens
    for b in blocks:
        event, data = b.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: ") :])["type"] == event[len("event: ") :]


def test_a_failure_mid_stream_is_a_named_error_event():
    """A stream that fails after it began (the engine went away) ends with OpenAI's typed
    `error` event, named like every other; events survive a copy with their names."""
    import asyncio
    import copy

    from pdserve.server.errors import APIError
    from pdserve.server.streaming import sse_events

    class Failing:  # a request group whose engine fails at once
        async def next_batch(self):
            raise APIError(503, "the engine is not available")

        def abort(self):
            pass

    req = ResponsesRequest.model_validate({"input": "hi"})
    fmt = ResponsesFormatter("resp_x", "tiny", None, req, prompt_tokens=3)

    async def body():
        return [part async for part in sse_events(Failing(), fmt, False, 3)]

    parts = "".join(asyncio.run(body())).split("\n\n")
    error = next(p for p in parts if p.startswith("event: error"))
    data = json.loads(error.split("\n")[1][len("data: ") :])
    assert data["type"] == "error" and "not available" in data["message"] and data["sequence_number"] == 2
    e = fmt.error_event(APIError(400, "x"))
    assert copy.copy(e).kind == "error" and copy.deepcopy(e) == e


@pytest.mark.integration
def test_through_the_front_and_router_the_stream_ends_with_its_last_event(tiny_model_dir):
    """Under `pdserve serve` the front relays the stream: it must see the Responses stream's
    end in its final event (there is no data: [DONE]) and add nothing after it."""
    import httpx

    from tests.server.deployment import Deployment, metric

    dep = Deployment(tiny_model_dir, "--served-model-name", "tiny")
    try:
        body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "temperature": 0, "stream": True}
        with httpx.stream("POST", dep.url + "/v1/responses", json=body, timeout=60) as r:
            text = "".join(r.iter_text())
        blocks = [b for b in text.split("\n\n") if b.strip()]
        kinds = [b.split("\n")[0][len("event: ") :] for b in blocks]
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        assert "error" not in kinds and "[DONE]" not in text
        seqs = [json.loads(b.split("\n")[1][len("data: ") :])["sequence_number"] for b in blocks]
        assert seqs == list(range(len(blocks)))
        metrics = httpx.get(dep.url + "/metrics", timeout=5).text
        assert "pdserve:front_requests_failed_total" in metrics
        assert metric(metrics, "pdserve:front_requests_failed_total") == 0
    finally:
        assert dep.stop() == 0
