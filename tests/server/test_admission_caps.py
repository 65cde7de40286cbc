"""Caps on what one request may fan out into and on how many sequences may wait.

Once, one 12 KB request (2,000 prompts x n=128) became 256,000 engine sequences;
its client left, and aborting them (quadratic in the queue) wedged the engine
for everyone else for more than ten minutes.
"""

import asyncio
import json

import httpx
import pytest

from pdserve.server.async_engine import AsyncEngine
from pdserve.server.engine_client import EngineInput
from pdserve.server.errors import APIError
from pdserve.server.metrics import ServerMetrics
from tests.server.conftest import API_KEY, TINY_ENGINE, engine_flags
from tests.server.serverproc import ServerProcess

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 1500, "ignore_eos": True, "stream": True}


@pytest.mark.integration
def test_the_12kb_request_that_wedged_the_engine_is_refused_at_once(tiny_server):
    raw = json.dumps({"model": "tiny", "prompt": ["hi"] * 2000, "n": 128}).encode()
    assert len(raw) < 13_000
    r = httpx.post(
        tiny_server.url + "/v1/completions",
        content=raw,
        timeout=30,
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and err["code"] == "too_many_sequences"
    assert "256000" in err["message"] and "max_seqs_per_request=256" in err["message"]
    h = tiny_server.health()
    assert h["num_waiting"] == 0 and h["num_waiting_requests"] == 0


def _idle_engine(max_waiting: int) -> AsyncEngine:
    """An AsyncEngine whose thread never runs: submit() only does its bookkeeping."""
    engine = AsyncEngine(lambda: None, ServerMetrics, max_waiting_requests=max_waiting)
    engine.engine = object()
    engine.metrics = ServerMetrics("m")
    return engine


def _submit(engine: AsyncEngine, num: int) -> APIError | None:
    try:
        engine.submit([EngineInput([1], None)] * num)
    except APIError as e:
        return e
    return None


def test_waiting_limit_counts_sequences_not_requests():
    async def main():
        engine = _idle_engine(max_waiting=6)
        assert _submit(engine, 4) is None
        full = _submit(engine, 3)  # 4 + 3 > 6: a fan-out must not slip past the limit
        fits = _submit(engine, 2)  # 4 + 2 = 6
        after = _submit(engine, 1)
        too_big = _submit(_idle_engine(max_waiting=6), 7)  # could never fit: waiting would not help
        return engine, full, fits, after, too_big

    engine, full, fits, after, too_big = asyncio.run(main())
    assert full.status == 429 and full.code == "queue_full" and int(full.headers["Retry-After"]) >= 1
    assert "max_waiting_requests=6" in full.message and "adds 3" in full.message
    assert fits is None and engine.num_waiting == 6
    assert after.status == 429
    assert too_big.status == 400 and too_big.code == "request_too_large" and "6" in too_big.message


def _data(lines):
    return (line for line in lines if line.startswith("data: "))


@pytest.mark.integration
def test_server_flags_cap_fanout_and_waiting_sequences(server_model_dir):
    flags = engine_flags(**{**TINY_ENGINE, "max_num_seqs": 1})
    with (
        ServerProcess(
            "--model",
            server_model_dir,
            "--threads",
            "1",
            *flags,
            "--max-seqs-per-request",
            "4",
            "--max-waiting-requests",
            "6",
        ) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        r = c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 3, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert "max_seqs_per_request=4" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/completions", json={**LONG, "prompt": "busy"}) as running:  # the only slot
            assert running.status_code == 200
            tokens = _data(running.iter_lines())  # kept: dropping it would close the stream
            next(tokens)
            with c.stream("POST", "/v1/completions", json={**LONG, "prompt": "wait", "n": 4}) as waiting:
                assert waiting.status_code == 200  # 4 sequences wait behind it
                r = c.post("/v1/completions", json={"prompt": ["x"], "n": 3, "max_tokens": 2})
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
                err = r.json()["error"]
                assert err["code"] == "queue_full" and "max_waiting_requests=6" in err["message"]
        srv.wait_idle()
        r = c.post("/v1/completions", json={"prompt": ["x"], "n": 3, "max_tokens": 2})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_max_seqs_per_request_must_be_positive(bad):
    from pdserve.cli import build_parser
    from pdserve.server.cli import _build

    args = build_parser("serve").parse_args(["serve", "--max-seqs-per-request", bad])
    with pytest.raises(ValueError, match="--max-seqs-per-request"):
        _build(args)
