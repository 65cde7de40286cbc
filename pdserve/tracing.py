"""Request traces (OpenTelemetry): where one request's time went, across router and workers.

Off unless a process is given `--otlp-traces-endpoint` (vLLM's flag). Then every
request the process serves leaves spans that it exports over OTLP to a collector
(Jaeger, Tempo, an OpenTelemetry Collector...), and every call it makes to another
pdserve process carries the W3C `traceparent` header, so a request served by a
router, a prefill worker and a decode worker is one trace:

    llm_request               the API request (router, or the collocated server)
    ├─ engine_request         collocated: one per choice, in the engine
    └─ route                  disaggregated: one per choice, in the router
       ├─ reserve             the decode worker reserves blocks for the prompt's KV
       ├─ prefill             to the prefill worker, until its first token
       │  ├─ engine_request   the prefill worker's engine (queue, prefill)
       │  └─ kv_transfer      the KV leaving the prefill worker, layer by layer
       ├─ decode              to the decode worker, until the last token
       │  ├─ kv_wait          the decode worker waiting for the KV (when it was not in yet)
       │  └─ engine_request   the decode worker's engine
       └─ generate            a whole request on one worker (no pool of one role, a short
                              prompt, a resumed or re-placed request)

A client that sends `traceparent` gets these under its own trace. The latency
attributes keep vLLM's names (gen_ai.latency.time_in_queue, time_to_first_token,
e2e, ...); pdserve's own are under `pdserve.`. No span holds a prompt or an output.

The exporter follows OpenTelemetry's environment variables: the protocol
(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, `grpc` by default as in vLLM, or
`http/protobuf`), headers, TLS, timeouts, the sampler (OTEL_TRACES_SAMPLER) and the
batching. OpenTelemetry itself is optional (`pip install 'pdserve[tracing]'`); this
module imports it only when tracing is on, and every call here is a no-op otherwise.

Times inside pdserve are `time.monotonic()` seconds; spans made after the fact (an
engine request, a KV transfer) convert them to the wall clock here.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping

log = logging.getLogger("pdserve.tracing")

PROTOCOLS = ("grpc", "http/protobuf")
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
MAX_EVENTS = 32  # events one span keeps (failures, retries): a request that retries forever does not grow it
EXPORT_TIMEOUT_S = 3.0  # one export's deadline unless OTEL_EXPORTER_OTLP_TRACES_TIMEOUT says: a dead collector
EXIT_FLUSH_MS = 2000  # delays an exit by at most about this plus one export's deadline

_tracer = None  # the process's tracer once `configure` turned tracing on
_provider = None


class TracingUnavailable(ValueError):
    """--otlp-traces-endpoint was given but OpenTelemetry cannot export from here."""


def protocol() -> str:
    return os.environ.get(PROTOCOL_ENV) or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"


def check_endpoint(endpoint: str) -> str | None:
    """Why `endpoint` cannot be an OTLP endpoint for the configured protocol, or None."""
    proto = protocol()
    if proto not in PROTOCOLS:
        return f"{PROTOCOL_ENV}={proto!r}: the protocols are {', '.join(PROTOCOLS)}"
    if not endpoint or any(c.isspace() for c in endpoint):
        return f"--otlp-traces-endpoint {endpoint!r} is not an address"
    if proto == "http/protobuf" and not endpoint.startswith(("http://", "https://")):
        return (
            f"--otlp-traces-endpoint {endpoint!r}: over http/protobuf the endpoint is a URL "
            "(http://HOST:4318/v1/traces)"
        )
    return None


def _sdk():
    """OpenTelemetry's pieces for exporting (imported only when tracing is on)."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        if protocol() == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporter ({e}); pip install 'pdserve[tracing]'"
        ) from None
    return Resource, TracerProvider, BatchSpanProcessor, OTLPSpanExporter


def check(endpoint: str) -> str | None:
    """Why this process could not export traces to `endpoint`, or None (a launcher asks
    before it starts the processes that will)."""
    why = check_endpoint(endpoint)
    if why is None:
        try:
            _sdk()
        except TracingUnavailable as e:
            why = str(e)
    return why


def configure(endpoint: str | None, service_name: str, **resource: str | None) -> None:
    """Turn tracing on for this process (nothing when `endpoint` is None). `service_name`
    names the process in the traces unless OTEL_SERVICE_NAME does; `resource` adds
    attributes of the process (its worker id, role). Raises TracingUnavailable."""
    global _tracer, _provider
    if not endpoint:
        return
    why = check_endpoint(endpoint)
    if why:
        raise TracingUnavailable(why)
    Resource, TracerProvider, BatchSpanProcessor, OTLPSpanExporter = _sdk()
    shutdown()  # configured again (tests): the previous exporter stops first
    attrs = {k: v for k, v in resource.items() if v is not None}
    given = [kv.split("=", 1)[0].strip() for kv in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")]
    if not os.environ.get("OTEL_SERVICE_NAME") and "service.name" not in given:
        attrs["service.name"] = service_name
    if protocol() == "http/protobuf" and not endpoint.rstrip("/").endswith("/v1/traces"):
        log.warning("--otlp-traces-endpoint %s: OTLP over HTTP is usually received at .../v1/traces", endpoint)
    timeout_s = None if os.environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") else EXPORT_TIMEOUT_S
    # the sampler comes from OTEL_TRACES_SAMPLER (default: follow the caller's traceparent, else all);
    # the exit flush is ours, bounded: the SDK's own waits out a dead collector's every retry
    provider = TracerProvider(resource=Resource.create(attrs), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, timeout=timeout_s)))
    _provider, _tracer = provider, provider.get_tracer("pdserve")
    # a caller's malformed traceparent or tracestate is ignored (a new trace): not a log line each
    logging.getLogger("opentelemetry.trace.span").setLevel(logging.ERROR)
    log.info("tracing on", extra={"fields": {"endpoint": endpoint, "protocol": protocol(), "service": service_name}})


def enabled() -> bool:
    return _tracer is not None


@atexit.register
def shutdown() -> None:
    """Export what is left and stop (at exit), waiting at most EXIT_FLUSH_MS plus one export's
    deadline: the SDK's flush exports everything queued, one blocking export after another,
    whatever its timeout says, so it runs on a thread that is left behind when time is up."""
    global _tracer, _provider
    provider, _tracer, _provider = _provider, None, None
    if provider is not None:
        done = threading.Thread(target=provider.shutdown, name="pdserve-tracing-exit", daemon=True)
        done.start()
        done.join(EXIT_FLUSH_MS / 1000 + EXPORT_TIMEOUT_S)
        if done.is_alive():
            log.warning("tracing: the collector did not take the last spans in time; they are dropped")


def wall_ns(mono_s: float) -> int:
    """A `time.monotonic()` instant on the wall clock, in nanoseconds since the epoch."""
    return time.time_ns() - time.monotonic_ns() + int(mono_s * 1e9)


def extract(headers: Mapping[str, str]):
    """The caller's trace context from its `traceparent` / `tracestate` headers: the parent
    of the spans a request makes here (an empty context, so a new trace, when it sent
    none). None when tracing is off: the request is not traced."""
    if _tracer is None:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(
        {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
    )


class Span:
    """One span (or, when tracing is off, NO_SPAN, which does nothing). Attributes are plain
    values; times are `time.monotonic()` seconds."""

    __slots__ = ("_span", "_events", "_ended")

    def __init__(self, span):
        self._span = span
        self._events = 0
        self._ended = False

    @property
    def traced(self) -> bool:
        """Part of a trace: its context goes on to the calls made under it, even when the
        sampler left it out (then the callees leave theirs out too)."""
        return self._span is not None

    @property
    def recording(self) -> bool:
        """Kept by the sampler: worth the work of its attributes."""
        return self._span is not None and self._span.is_recording()

    def set(self, attributes: Mapping[str, object]) -> None:
        if self._span is not None and not self._ended:
            self._span.set_attributes({k: v for k, v in attributes.items() if v is not None})

    def event(self, name: str, attributes: Mapping[str, object] | None = None, at_s: float | None = None) -> None:
        if self._span is not None and not self._ended and self._events < MAX_EVENTS:
            self._events += 1
            attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
            self._span.add_event(name, attrs, timestamp=None if at_s is None else wall_ns(at_s))

    def fail(self, description: str) -> None:
        """Mark the span as an error (what went wrong, in words)."""
        if self._span is not None and not self._ended:
            from opentelemetry.trace import Status, StatusCode

            self._span.set_status(Status(StatusCode.ERROR, description[:500]))

    def end(self, at_s: float | None = None) -> None:
        if self._span is not None and not self._ended:
            self._ended = True
            self._span.end(end_time=None if at_s is None else wall_ns(at_s))

    def headers(self) -> dict[str, str]:
        """`traceparent` (and `tracestate`) for a call made under this span."""
        if self._span is None:
            return {}
        from opentelemetry.trace import set_span_in_context
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=set_span_in_context(self._span))
        return carrier

    def context(self):
        from opentelemetry.trace import set_span_in_context

        return set_span_in_context(self._span) if self._span is not None else None


NO_SPAN = Span(None)


def start(
    name: str,
    parent=None,
    *,
    kind: str = "internal",
    attributes: Mapping[str, object] | None = None,
    start_s: float | None = None,
) -> Span:
    """A span that starts now (or at `start_s`); `parent`: a Span, a context from `extract`,
    or None (a new trace). NO_SPAN when tracing is off or the parent is NO_SPAN (a request
    that is not traced)."""
    if _tracer is None or (isinstance(parent, Span) and not parent.traced):
        return NO_SPAN
    from opentelemetry.trace import SpanKind

    if isinstance(parent, Span):
        parent = parent.context()
    span = _tracer.start_span(
        name,
        context=parent,
        kind=SpanKind[kind.upper()],
        attributes={k: v for k, v in (attributes or {}).items() if v is not None},
        start_time=None if start_s is None else wall_ns(start_s),
    )
    return Span(span)


@contextlib.contextmanager
def span(name: str, parent, **kw) -> Iterator[Span]:
    """`start(name, parent, **kw)` for the body of a `with`: ended when it ends, an error if
    it raised (a cancellation, a client that left, is not an error: an attribute says so)."""
    sp = start(name, parent, **kw)
    try:
        yield sp
    except asyncio.CancelledError:
        sp.set({"pdserve.cancelled": True})
        raise
    except BaseException as e:
        sp.fail(f"{type(e).__name__}: {e}")
        raise
    finally:
        sp.end()


def record(
    name: str,
    parent,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, object] | None = None,
    events: list[tuple[str, float | None]] = (),
    kind: str = "internal",
    error: str | None = None,
) -> None:
    """A span made after the fact, from `start_s` to `end_s` (monotonic): what the engine or
    a KV transfer measured while it ran."""
    if _tracer is None:
        return
    span = start(name, parent, kind=kind, attributes=attributes, start_s=start_s)
    for ev, at_s in events:
        if at_s is not None:
            span.event(ev, at_s=at_s)
    if error:
        span.fail(error)
    span.end(max(start_s, end_s))
