"""The front's bookkeeping of a stream it may have to resume (pdserve/server/front.py)."""

import json

from pdserve.control_api import ResumeRequest, tokens_comment
from pdserve.server.front import _Stream


def test_stream_forwards_whole_events_without_comments_and_counts_their_tokens():
    s = _Stream("cmpl-1")
    head = b": pd-stream 1700000000\n\n"
    ev1 = (tokens_comment(0, [5, 6], False) + 'data: {"a":1}\n\n').encode()
    ev2 = (tokens_comment(1, [7], True) + "\n").encode()  # tokens without text yet (half a character)
    data = head + ev1 + ev2 + b"data: [DONE]\n\n"
    cut = len(head) + len(ev1) + 10
    assert s.feed(data[:cut]) == b'data: {"a":1}\n\n'  # the half event waits for its end
    assert s.created == 1700000000 and s.choices[0].token_ids == [5, 6] and 1 not in s.choices
    assert not s.done
    assert s.feed(data[cut:]) == b"data: [DONE]\n\n"
    assert s.done and s.choices[1].token_ids == [7] and s.choices[1].finished
    r = ResumeRequest.model_validate(json.loads(s.resume_body(b'{"prompt":"hi"}')))
    assert (r.request_id, r.created, r.body) == ("cmpl-1", 1700000000, '{"prompt":"hi"}')
    assert [(c.index, c.token_ids, c.finished) for c in r.choices] == [(0, [5, 6], False), (1, [7], True)]


def test_a_stream_cut_inside_an_event_counts_none_of_its_tokens():
    s = _Stream("x")
    ev = (tokens_comment(0, [1, 2, 3], False) + 'data: {"t":"abc"}\n\n').encode()
    assert s.feed(ev[:-1]) == b""
    assert s.choices == {}  # the client did not get these: a resume must produce them again


def test_a_responses_stream_ends_with_its_last_named_event():
    """The Responses API has no data: [DONE]: its stream is done once response.completed (or
    incomplete, failed, error) reached the client; the events count its sequence numbers."""
    s = _Stream("resp-1", responses=True)
    created = b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n'
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta"}\n\n'
    assert s.feed(created + delta) == created + delta
    assert not s.done and s.events == 2
    done = b'event: response.completed\ndata: {"type":"response.completed"}\n\n'
    assert s.feed(done) == done and s.done and s.events == 3
    chat = _Stream("cmpl-2")  # a chat stream's named-looking line is not an end
    assert not chat.feed(done) or not chat.done


def test_a_cut_responses_stream_ends_with_a_typed_error_event():
    import asyncio
    from types import SimpleNamespace

    from pdserve.server.front import Front

    sent = []

    async def send(msg):
        sent.append(msg)

    s = _Stream("resp-2", responses=True)
    s.feed(b'event: response.created\ndata: {"type":"response.created","sequence_number":0}\n\n')
    front = SimpleNamespace(counters={"failed": 0})
    asyncio.run(Front._give_up(front, send, s, ConnectionError("router gone")))
    (body,) = [m["body"].decode() for m in sent]
    event, data = body.strip().split("\n")
    e = json.loads(data[len("data: ") :])
    assert event == "event: error" and "[DONE]" not in body and front.counters["failed"] == 1
    assert (e["type"], e["sequence_number"]) == ("error", 1) and "did not come back" in e["message"]
