"""The internal control API's messages (pdserve/control_api.py): what they accept, what travels,
and how a worker answers a body that is not one of them."""

import asyncio
import dataclasses
import json
import math
import types
import typing

import httpx
import pytest
from pydantic import ValidationError

from pdserve import auth, control_api
from pdserve.control_api import (
    KVDestinationBody,
    OutputEvent,
    PoolPollRequest,
    RegisterRequest,
    ReserveRequest,
    SavedEvent,
    event_line,
    parse_event,
)
from pdserve.router.registry import ROLES
from pdserve.transfer.connector import KVDestination

SECRET = b"0123456789abcdef-test-secret"


def test_mirrored_types_match_their_originals():
    """KVDestinationBody and Role copy a dataclass and a tuple that control_api must not import."""

    def default(f):  # None: required
        if f.default is not dataclasses.MISSING:
            return f.default
        return f.default_factory() if f.default_factory is not dataclasses.MISSING else None

    want = {f.name: default(f) for f in dataclasses.fields(KVDestination)}
    got = {
        name: None if f.is_required() else f.get_default(call_default_factory=True)
        for name, f in KVDestinationBody.model_fields.items()
    }
    assert got == want
    assert typing.get_args(control_api.Role) == ROLES


def test_callers_send_only_what_they_set():
    """A default lives with the receiver: a router that does not ask for a wait sends no wait_s."""
    body = ReserveRequest(request_id="r", prompt_token_ids=[1, 2], deadline_s=120.0).wire()
    assert body == {"request_id": "r", "prompt_token_ids": [1, 2], "deadline_s": 120.0}


def test_stream_events_round_trip_and_unknown_ones_are_skipped():
    ev = OutputEvent(
        token_ids=[5],
        text="a",
        finished=True,
        finish_reason="length",
        stop_reason=None,
        logprobs=[{"5": -0.5, "7": -math.inf}],
        num_prompt_tokens=3,
    )
    line = event_line(ev)
    assert line.endswith(b"\n") and json.loads(line)["event"] == "output"
    assert parse_event(line) == ev
    assert parse_event(event_line(SavedEvent(ok=False, error="cut"))) == SavedEvent(ok=False, error="cut")
    assert parse_event(b'{"event": "from_a_newer_worker", "x": 1}') is None
    for bad in (b"[1]", b"not json", b'{"event": "output", "token_ids": "abc"}'):
        with pytest.raises(ValueError):
            parse_event(bad)


def test_router_side_bounds_on_registrations_and_pool_polls():
    ok = {"worker_id": "d0", "url": "http://127.0.0.1:8101", "role": "decode"}
    assert RegisterRequest.model_validate(ok).restarts == 0
    for bad in (
        {"url": "tcp://127.0.0.1:1"},
        {"url": "http://"},
        {"role": "judge"},
        {"restarts": -1},
        {"restarts": 1 << 31},
        {"worker_id": "x" * 513},
        {"host": 5},
    ):
        with pytest.raises(ValidationError):
            RegisterRequest.model_validate({**ok, **bad})
    assert PoolPollRequest.model_validate({"running": {"decode": 1024}}).running == {"decode": 1024}
    for running in ({"decode": 1025}, {"decode": -1}, {"decode": True}, [1]):
        with pytest.raises(ValidationError):
            PoolPollRequest.model_validate({"running": running})


def _worker_answers(posts: list[tuple[str, bytes]]) -> list[httpx.Response]:
    """What a worker's control API answers to these raw bodies (its engine is never reached)."""
    from pdserve.worker.app import WorkerApi, build_worker_app

    app = build_worker_app(WorkerApi(types.SimpleNamespace(), "decode"), SECRET)

    async def run():
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://w", auth=auth.http_auth(SECRET)
        ) as c:
            return [
                await c.post(path, content=body, headers={"content-type": "application/json"}) for path, body in posts
            ]

    return asyncio.run(run())


def test_a_worker_answers_a_bad_body_with_a_400_naming_the_field():
    reserve = b'{"request_id": "r", "prompt_token_ids": [1], '
    cases = [
        ("/internal/reserve", reserve + b'"deadline_s": 1e999}', "deadline_s"),  # infinity
        ("/internal/reserve", reserve + b'"deadline_s": -1}', "deadline_s"),
        ("/internal/reserve", reserve + b'"deadline_s": "soon"}', "deadline_s"),
        ("/internal/reserve", reserve + b'"wait_s": true}', "wait_s"),
        ("/internal/reserve", reserve + b'"params": {"temperature": "hot"}}', "params"),
        ("/internal/reserve", b'{"request_id": "r"}', "prompt_token_ids"),
        ("/internal/generate", b'{"request_id": 5, "prompt_token_ids": [1]}', "request_id"),
        ("/internal/decode", b'{"request_id": "r", "timeout_s": -5}', "timeout_s"),
        ("/internal/pull", b'{"request_id": "r", "address": "http://elsewhere"}', "address"),
        ("/internal/pull", b'{"request_id": "r", "address": "tcp://' + b"h" * 300 + b'"}', "address"),
        ("/internal/abort", b"{}", "request_id"),
        ("/internal/abort", b"[1, 2]", None),
        ("/internal/abort", b"{not json", None),
    ]
    for (path, body, param), r in zip(cases, _worker_answers([(p, b) for p, b, _ in cases])):
        assert r.status_code == 400, (path, body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, (path, body, err)


def test_fields_an_older_worker_would_drop_are_features_the_router_places_by():
    from pdserve.control_api import features_needed
    from pdserve.engine.sampling_params import SamplingParams

    assert features_needed(SamplingParams()) == frozenset()
    p = SamplingParams(cache_salt="t", bad_words=["x"], reasoning_token_ids=[5, 6])
    assert features_needed(p) == {"cache_salt", "bad_words", "reasoning_token_ids"}
    assert features_needed(control_api.params_to_json(p)) == features_needed(p)
