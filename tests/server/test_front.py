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
