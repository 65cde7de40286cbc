"""An OTLP trace receiver for tests and benchmarks: what a collector (Jaeger, an OpenTelemetry
Collector) would receive from pdserve, over http/protobuf or grpc, decoded with OpenTelemetry's
own protobuf definitions into plain spans. Needs `pdserve[tracing]`."""

from __future__ import annotations

import gzip
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


@dataclass
class Span:
    name: str
    service: str
    resource: dict
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    kind: int  # SpanKind in OTLP's numbering: 1 internal, 2 server, 3 client, 4 producer, 5 consumer
    start_ns: int
    end_ns: int
    attributes: dict
    events: list[tuple[str, int, dict]] = field(default_factory=list)
    error: str | None = None  # the status message of an error span

    @property
    def event_names(self) -> list[str]:
        return [e[0] for e in self.events]


def _value(v):
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, which) if which else None


def _attrs(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


def decode(body: bytes) -> list[Span]:
    req = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
    out = []
    for rs in req.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Span(
                        name=s.name,
                        service=resource.get("service.name", ""),
                        resource=resource,
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=[(e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events],
                        error=s.status.message if s.status.code == 2 else None,
                    )
                )
    return out


class Collector:
    """`with Collector("grpc") as c:` ... `c.endpoint` for --otlp-traces-endpoint, `c.spans`."""

    def __init__(self, protocol: str = "http/protobuf"):
        self.protocol = protocol
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self._server = None

    def _add(self, body: bytes) -> bytes:
        spans = decode(body)
        with self._lock:
            self.spans += spans
        return trace_service_pb2.ExportTraceServiceResponse().SerializeToString()

    def __enter__(self) -> Collector:
        if self.protocol == "grpc":
            import grpc
            from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

            collector = self

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):  # noqa: N802 (the service's own name)
                    collector._add(request.SerializeToString())
                    return trace_service_pb2.ExportTraceServiceResponse()

            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
            port = self._server.add_insecure_port("127.0.0.1:0")
            self._server.start()
            self.endpoint = f"http://127.0.0.1:{port}"
        else:
            collector = self

            class Handler(BaseHTTPRequestHandler):
                def do_POST(self):  # noqa: N802 (http.server's name)
                    body = self.rfile.read(int(self.headers.get("content-length", 0)))
                    if self.headers.get("content-encoding") == "gzip":
                        body = gzip.decompress(body)
                    if self.path != "/v1/traces":
                        self.send_response(404)
                        self.end_headers()
                        return
                    answer = collector._add(body)
                    self.send_response(200)
                    self.send_header("content-type", "application/x-protobuf")
                    self.send_header("content-length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)

                def log_message(self, *args):
                    pass

            self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
            self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        return self

    def __exit__(self, *exc) -> None:
        if self.protocol == "grpc":
            self._server.stop(grace=None)
        else:
            self._server.shutdown()
            self._server.server_close()

    def trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait(self, pred, timeout_s: float = 30.0) -> list[Span]:
        """The spans once `pred(spans)` holds (AssertionError with what came, at the timeout)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                spans = list(self.spans)
            if pred(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError("spans received: " + ", ".join(f"{s.service}/{s.name}" for s in spans) or "none")
            time.sleep(0.1)
