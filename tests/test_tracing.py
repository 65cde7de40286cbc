"""pdserve/tracing.py in one process: off by default and free, on: real OTLP exports."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from pdserve import tracing

pytest.importorskip("opentelemetry.proto", reason="the [tracing] extra")
from pdserve.testing.otlp import Collector  # noqa: E402

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_off_by_default_every_call_is_a_no_op():
    assert not tracing.enabled()
    assert tracing.extract({"traceparent": TRACEPARENT}) is None  # not traced: the caller's header is ignored
    sp = tracing.start("x", None, attributes={"a": 1})
    assert sp is tracing.NO_SPAN and not sp.recording and sp.headers() == {}
    sp.set({"a": 1})
    sp.event("e")
    sp.fail("nothing")
    sp.end()
    with tracing.span("y", sp) as inner:
        assert inner is tracing.NO_SPAN
    tracing.record("z", None, 0.0, 1.0)
    tracing.configure(None, "pdserve")  # no endpoint: stays off
    assert not tracing.enabled()


def test_off_never_imports_opentelemetry():
    code = (
        "import sys; from pdserve import tracing; "
        "tracing.start('x', tracing.extract({'traceparent': 'y'})).end(); "
        "print(any(m.startswith('opentelemetry') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    "protocol, endpoint, why",
    [
        ("grpc", "http://collector:4317", None),
        ("grpc", "collector:4317", None),
        ("http/protobuf", "http://collector:4318/v1/traces", None),
        ("http/protobuf", "collector:4318", "is a URL"),
        ("grpc", "http://a b", "not an address"),
        ("http/json", "http://collector:4318/v1/traces", "the protocols are grpc, http/protobuf"),
    ],
)
def test_endpoint_and_protocol_are_checked(monkeypatch, protocol, endpoint, why):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, protocol)
    got = tracing.check_endpoint(endpoint)
    assert (got is None) if why is None else (why in got)


def test_without_opentelemetry_the_error_says_what_to_install():
    code = (
        "import sys; sys.modules['opentelemetry.sdk'] = None\n"
        "from pdserve import tracing\n"
        "print(tracing.check('http://127.0.0.1:4317'))\n"
        "try:\n"
        "    tracing.configure('http://127.0.0.1:4317', 'x')\n"
        "except ValueError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.count("pip install 'pdserve[tracing]'") == 2 and "refused:" in out


def test_cli_refuses_a_bad_endpoint_before_starting_anything():
    env = {**os.environ, tracing.PROTOCOL_ENV: "http/protobuf"}
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--otlp-traces-endpoint", "collector:4318"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "http://HOST:4318/v1/traces" in r.stderr, r.stderr


@pytest.fixture
def collector(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/protobuf")
    with Collector() as c:
        tracing.configure(c.endpoint, "pdserve-test", **{"pdserve.role": "test"})
        try:
            yield c
        finally:
            tracing.shutdown()  # exports what is left; the process is untraced again


def test_spans_nest_carry_times_and_propagate(collector):
    parent = tracing.extract({"traceparent": TRACEPARENT})
    t0 = time.monotonic()
    root = tracing.start("llm_request", parent, kind="server", attributes={"n": 2, "skipped": None}, start_s=t0)
    assert root.recording
    headers = root.headers()
    assert headers["traceparent"].startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-")
    remote = tracing.extract(headers)  # what a worker reads from the call
    tracing.record("engine_request", remote, t0 + 0.01, t0 + 0.03, {"tokens": 5}, events=[("scheduled", t0 + 0.02)])
    with pytest.raises(RuntimeError), tracing.span("prefill", root, kind="client") as sp:
        sp.set({"worker": "p0"})
        raise RuntimeError("worker gone")

    async def cancelled():
        with tracing.span("decode", root, kind="client"):
            raise asyncio.CancelledError

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(cancelled())
    for i in range(tracing.MAX_EVENTS + 5):
        root.event("retry", {"i": i})
    root.end(t0 + 0.05)
    root.set({"late": 1})  # after the end: dropped, not a warning per call
    tracing.shutdown()

    spans = {s.name: s for s in collector.spans}
    assert set(spans) == {"llm_request", "engine_request", "prefill", "decode"}
    req = spans["llm_request"]
    assert req.parent_id == "00f067aa0ba902b7" and req.kind == 2 and req.service == "pdserve-test"
    assert req.attributes == {"n": 2} and len(req.events) == tracing.MAX_EVENTS
    assert req.resource["pdserve.role"] == "test"
    assert abs((req.end_ns - req.start_ns) / 1e9 - 0.05) < 1e-3
    eng = spans["engine_request"]
    assert eng.parent_id == req.span_id and eng.attributes == {"tokens": 5}
    assert abs((eng.start_ns - req.start_ns) / 1e9 - 0.01) < 1e-3 and eng.event_names == ["scheduled"]
    assert spans["prefill"].error == "RuntimeError: worker gone" and spans["prefill"].attributes["worker"] == "p0"
    assert spans["decode"].error is None and spans["decode"].attributes["pdserve.cancelled"] is True
    assert all(s.trace_id == req.trace_id for s in spans.values())


def test_service_name_from_the_environment_wins(monkeypatch):
    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-llm")
    with Collector() as c:
        tracing.configure(c.endpoint, "pdserve-router")
        try:
            tracing.start("x").end()
        finally:
            tracing.shutdown()
        assert [s.service for s in c.spans] == ["my-llm"]


def test_a_collector_that_never_answers_delays_the_exit_by_seconds_only(monkeypatch):
    """The exit flush is bounded (tracing.EXIT_FLUSH_MS, one export's EXPORT_TIMEOUT_S): a
    collector that accepts the connection and never answers does not hold a stopping process."""
    import socket

    monkeypatch.setenv(tracing.PROTOCOL_ENV, "http/protobuf")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        tracing.configure(f"http://127.0.0.1:{silent.getsockname()[1]}/v1/traces", "pdserve-test")
        for _ in range(3000):  # more than one batch: the SDK's flush would export them one by one
            tracing.start("x").end()
        t0 = time.monotonic()
        tracing.shutdown()
        took = time.monotonic() - t0
    assert not tracing.enabled()
    assert took < tracing.EXIT_FLUSH_MS / 1000 + tracing.EXPORT_TIMEOUT_S + 1.5, took
