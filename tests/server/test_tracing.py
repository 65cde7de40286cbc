"""Request traces (pdserve/tracing.py): real servers export over OTLP to a receiver that
decodes what a collector would get, and the spans must form one tree under the caller's
traceparent, across the router and its workers."""

import pytest

pytest.importorskip("opentelemetry.proto", reason="the [tracing] extra")
from pdserve.testing.otlp import Collector  # noqa: E402
from tests.server.conftest import TINY_ENGINE, engine_flags
from tests.server.deployment import Deployment
from tests.server.serverproc import ServerProcess

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
SECRET = "zebra violin"  # in the prompts: no span may carry it
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # the batch processor exports every 0.1 s
SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # OTLP's span kinds


def named(spans, name: str, service: str | None = None) -> list:
    return [s for s in spans if s.name == name and (service is None or s.service == service)]


def within(child, parent, slack_ns: int = 5_000_000) -> bool:
    return parent.start_ns - slack_ns <= child.start_ns and child.end_ns <= parent.end_ns + slack_ns


def test_collocated_server_traces_each_request_and_choice(server_model_dir):
    """http/protobuf: the API request's span is a child of the caller's traceparent, with one
    engine_request per choice inside it; a request without traceparent starts its own trace;
    a request the engine refuses still leaves a span, marked as an error."""
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", **FAST_EXPORT}
    with Collector("http/protobuf") as col:
        flags = ["--otlp-traces-endpoint", col.endpoint, "--max-waiting-requests", "4"]
        with (
            ServerProcess(
                "--model", server_model_dir, "--threads", "1", "--served-model-name", "tiny",
                *flags, *engine_flags(**TINY_ENGINE), env=env,
            ) as server,
            openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client,
        ):  # fmt: skip
            stream = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": SECRET}],
                n=2,
                max_tokens=6,
                stream=True,
                extra_headers=TRACEPARENT,
                extra_body={"ignore_eos": True},
            )
            assert sum(len(c.choices) for c in stream) > 0
            client.completions.create(model="tiny", prompt=SECRET, max_tokens=3, extra_body={"ignore_eos": True})
            with pytest.raises(openai.BadRequestError):  # 5 sequences: more than may ever wait
                client.completions.create(model="tiny", prompt="x", max_tokens=3, n=5)
            spans = col.wait(lambda ss: len(named(ss, "llm_request")) >= 3 and len(named(ss, "engine_request")) >= 3)

    assert all(s.service == "pdserve" for s in spans)
    mine = [s for s in spans if s.trace_id == TRACE_ID]
    (req,) = named(mine, "llm_request")
    assert req.parent_id == PARENT_ID and req.kind == SERVER and req.error is None
    a = req.attributes
    assert a["gen_ai.request.n"] == 2 and a["gen_ai.response.model"] == "tiny" and a["pdserve.stream"] is True
    assert a["gen_ai.usage.completion_tokens"] == 12 and a["gen_ai.usage.prompt_tokens"] > 0
    assert a["pdserve.outcome"] == "ok"
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert "first_token" in req.event_names
    engines = named(mine, "engine_request")
    assert len(engines) == 2
    for e in engines:
        assert e.parent_id == req.span_id and within(e, req)
        ea = e.attributes
        assert ea["gen_ai.usage.completion_tokens"] == 6 and ea["gen_ai.response.finish_reasons"] == ["length"]
        assert ea["gen_ai.latency.time_in_queue"] >= 0 and ea["gen_ai.latency.time_to_first_token"] > 0
        assert ea["gen_ai.latency.e2e"] >= ea["gen_ai.latency.time_to_first_token"]
        assert e.event_names == ["scheduled", "first_token"]
    assert len({e.attributes["gen_ai.request.id"] for e in engines}) == 2

    others = [s for s in named(spans, "llm_request") if s.trace_id != TRACE_ID]
    ok = [s for s in others if s.error is None]
    refused = [s for s in others if s.error is not None]
    assert len(ok) == 1 and ok[0].parent_id == "" and ok[0].attributes["gen_ai.usage.completion_tokens"] == 3
    assert [e.parent_id for e in named(spans, "engine_request") if e.trace_id == ok[0].trace_id] == [ok[0].span_id]
    assert len(refused) == 1 and refused[0].attributes["http.response.status_code"] == 400
    assert "max_waiting_requests" in refused[0].error
    assert SECRET not in repr(spans)


def test_disaggregated_request_is_one_trace_across_router_and_workers(tiny_model_dir):
    """grpc (the default protocol): router, prefill worker and decode worker each export their
    part, and the parts nest: llm_request > route > reserve / prefill / decode, the prefill
    worker's engine_request and kv_transfer under prefill, the decode worker's under decode.
    A KV transfer cut at layer 1 shows up as a retry in its kv_transfer span, a stalled one as
    the decode worker's kv_wait, a prefill worker that dies as an event and the decode worker's
    recompute; a caller's unsampled traceparent leaves no span anywhere."""
    traces = {k: f"4bf92f3577b34da6a3ce929d0e0e47{i:02x}" for i, k in enumerate(("cut", "stall", "died", "unsampled"))}

    def complete(client, prompt: str, max_tokens: int, trace_id: str, flags: str = "01"):
        out = client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=max_tokens,
            extra_headers={"traceparent": f"00-{trace_id}-{PARENT_ID}-{flags}"},
            extra_body={"ignore_eos": True},
        )
        assert out.usage.completion_tokens == max_tokens

    def fault(spec: dict) -> None:
        prefill_url = dep.workers()["prefill-0"]["url"]
        assert dep.http.post(prefill_url + "/internal/fault", json=spec).status_code == 200

    with Collector("grpc") as col:
        dep = Deployment(
            tiny_model_dir, "--served-model-name", "tiny", "--otlp-traces-endpoint", col.endpoint, env=FAST_EXPORT
        )
        try:
            with openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
                complete(client, "seven eight " * 12, 3, traces["unsampled"], flags="00")
                complete(client, SECRET + " " + "one two three " * 12, 5, TRACE_ID)
                fault({"kv": "cut_at_layer=1"})
                complete(client, "four five six " * 12, 3, traces["cut"])
                fault({"kv": "stall_at_layer=1:0.5"})
                complete(client, "nine ten " * 12, 3, traces["stall"])

                def landed(ss) -> bool:
                    want = {"llm_request": 1, "route": 1, "kv_transfer": 1, "engine_request": 2}
                    done = all(
                        len(named(col.trace(t), n)) >= k for t in (TRACE_ID, traces["cut"]) for n, k in want.items()
                    )
                    return done and bool(named(col.trace(traces["stall"]), "kv_wait"))

                col.wait(landed)  # before the prefill worker dies with spans it has not exported yet
                fault({"kv": "exit_at_layer=1"})
                complete(client, "eleven twelve " * 12, 3, traces["died"])
            col.wait(lambda ss: len(named(col.trace(traces["died"]), "engine_request")) >= 1)
        finally:
            assert dep.stop() == 0, dep.log()

    assert col.trace(traces["unsampled"]) == []
    # ... and its workers were told so (traceparent with the flag off), or they would have
    # started traces of their own: every worker span is under a router's
    assert all(s.parent_id for s in col.spans if s.service != "pdserve-router")
    spans = col.trace(TRACE_ID)
    by_id = {s.span_id: s for s in spans}
    (req,) = named(spans, "llm_request", "pdserve-router")
    assert req.parent_id == PARENT_ID and req.kind == SERVER
    (route,) = named(spans, "route", "pdserve-router")
    assert route.parent_id == req.span_id and within(route, req)
    ra = route.attributes
    assert ra["pdserve.route"] == "disaggregated"
    assert ra["pdserve.prefill.worker"].startswith("prefill-") and ra["pdserve.decode.worker"].startswith("decode-")
    assert ra["pdserve.kv.bytes"] > 0 and ra["pdserve.kv.retries"] == 0
    assert ra["gen_ai.usage.completion_tokens"] == 5
    calls = {s.name: s for s in spans if s.parent_id == route.span_id}
    assert set(calls) == {"reserve", "prefill", "decode"}
    assert all(s.kind == CLIENT and s.service == "pdserve-router" and within(s, route) for s in calls.values())
    assert calls["reserve"].end_ns <= calls["prefill"].start_ns

    (p_engine,) = named(spans, "engine_request", "pdserve-prefill")
    assert p_engine.parent_id == calls["prefill"].span_id and p_engine.kind == SERVER
    assert p_engine.attributes["gen_ai.usage.completion_tokens"] == 1
    assert p_engine.resource["service.instance.id"] == ra["pdserve.prefill.worker"]
    (kv,) = named(spans, "kv_transfer", "pdserve-prefill")
    assert kv.parent_id == calls["prefill"].span_id and kv.kind == PRODUCER and within(kv, route)
    assert kv.start_ns >= calls["prefill"].start_ns - 5_000_000
    assert kv.attributes["pdserve.kv.bytes"] == ra["pdserve.kv.bytes"] and kv.attributes["pdserve.kv.retries"] == 0

    (d_engine,) = named(spans, "engine_request", "pdserve-decode")
    assert d_engine.parent_id == calls["decode"].span_id and within(d_engine, calls["decode"])
    assert d_engine.resource["service.instance.id"] == ra["pdserve.decode.worker"]
    assert all(s.error is None for s in spans)
    assert {by_id[s.parent_id].service for s in spans if s.parent_id in by_id} <= {"pdserve-router"}

    spans = col.trace(traces["cut"])
    (kv,) = named(spans, "kv_transfer", "pdserve-prefill")
    assert kv.attributes["pdserve.kv.retries"] >= 1
    (route,) = named(spans, "route")
    assert route.attributes["pdserve.kv.retries"] == kv.attributes["pdserve.kv.retries"]

    spans = col.trace(traces["stall"])
    (decode,) = named(spans, "decode", "pdserve-router")
    (wait,) = named(spans, "kv_wait", "pdserve-decode")
    assert wait.parent_id == decode.span_id and wait.kind == CONSUMER and within(wait, decode)
    assert wait.attributes["pdserve.kv.outcome"] == "kv_ready" and wait.end_ns - wait.start_ns > 0.2e9

    spans = col.trace(traces["died"])  # the prefill worker exited during its KV transfer
    (route,) = named(spans, "route")
    (prefill,) = named(spans, "prefill", "pdserve-router")
    assert "prefill_failed" in route.event_names and prefill.error is not None
    (decode,) = named(spans, "decode", "pdserve-router")
    assert decode.attributes["pdserve.kv_expected"] is False and decode.error is None
    (d_engine,) = named(spans, "engine_request", "pdserve-decode")  # the decode worker computed the prompt
    assert d_engine.parent_id == decode.span_id and d_engine.attributes["gen_ai.usage.completion_tokens"] >= 2
    assert SECRET not in repr(col.spans)
