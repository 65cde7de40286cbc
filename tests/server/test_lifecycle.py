"""Admission control (429), an engine that cannot serve (503), and graceful shutdown on SIGTERM."""

import json
import os
import time

import httpx
import pytest

from tests.server.conftest import TINY_ENGINE, engine_flags
from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.integration

LONG = {"prompt": "busy", "max_tokens": 1500, "ignore_eos": True, "stream": True}


def one_seq_server(model_dir, *extra):
    flags = engine_flags(**{**TINY_ENGINE, "max_num_seqs": 1})
    return ServerProcess("--model", model_dir, "--threads", "1", *flags, *extra)


def data_events(lines):
    for line in lines:
        if line.startswith("data: "):
            yield line[6:]


def test_full_queue_answers_429_with_retry_after(server_model_dir):
    with (
        one_seq_server(server_model_dir, "--max-waiting-requests", "1") as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        with c.stream("POST", "/v1/completions", json=LONG) as running:  # takes the only batch slot
            assert running.status_code == 200
            tokens = data_events(running.iter_lines())  # kept: dropping it would close the stream
            next(tokens)
            with c.stream("POST", "/v1/completions", json=LONG) as waiting:  # queued behind it
                assert waiting.status_code == 200
                r = c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 4})
                assert r.status_code == 429
                assert int(r.headers["Retry-After"]) >= 1
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and err["code"] == "queue_full"
        # both streams closed: the queue is empty again and requests are admitted
        srv.wait_idle()
        r = c.post("/v1/completions", json={"prompt": "one more", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert "pdserve:request_rejected_total{model_name=" in c.get("/metrics").text


def test_engine_that_failed_to_load_exits_2_and_says_why(tmp_path):
    # a model that does not load will not load on a retry: the process exits (a supervisor sees
    # it) instead of staying up and useless; answers while it was loading were 503 "loading"
    os.makedirs(tmp_path / "empty")
    with ServerProcess("--model", str(tmp_path / "empty"), wait_ready=False) as srv:
        srv.proc.wait(120)
        assert srv.proc.returncode == 2, srv.log()
        assert "engine failed to load" in srv.log()


def test_a_failed_step_answers_503_and_the_process_exits_1(server_model_dir):
    """A step that raised leaves the engine in an unknown state: the requests in flight end with
    503 at once (never a hang), and the process exits 1 so its supervisor restarts it (it had
    stayed up, useless, still looking healthy to its router)."""
    env = {"PDSERVE_KV_FAULT": "fail_step=0"}
    with ServerProcess("--model", server_model_dir, *engine_flags(**TINY_ENGINE), env=env) as srv:
        t0 = time.monotonic()
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 503, r.text
        assert "step failed" in r.json()["error"]["message"]
        assert srv.proc.wait(30) == 1
        assert time.monotonic() - t0 < 30
        assert "engine step failed" in srv.log()


def test_sigterm_drains_then_ends_streams_with_an_error(server_model_dir):
    srv = one_seq_server(server_model_dir, "--shutdown-timeout", "0.5")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json=LONG) as r:
                events = data_events(r.iter_lines())
                next(events)
                srv.terminate()
                t0 = time.monotonic()
                rest = list(events)
                elapsed_s = time.monotonic() - t0
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["type"] == "service_unavailable_error"
        assert len(rest) > 3  # it kept generating during the grace period
        assert 0.4 < elapsed_s < 10
        assert srv.proc.wait(20) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(srv.url + "/health")
    finally:
        srv.stop()
