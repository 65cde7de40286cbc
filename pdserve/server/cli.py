"""`pdserve serve`: the OpenAI-compatible API over one collocated engine.

The port is bound at once and the model loads in the engine thread, so
`/health` answers 503 ("loading") until the engine is ready and a supervisor
can tell a slow start from a dead one.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys

import uvicorn

from pdserve.router.policy import POLICIES
from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.server")


def add_arguments(p) -> None:
    from pdserve.engine.cli import add_engine_arguments

    p.add_argument("--mode", default="disaggregated", choices=["disaggregated", "collocated"],
                   help="disaggregated: router + prefill and decode worker processes; collocated: one engine")
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    p.add_argument("--policy", dest="router_policy", default="cache_aware", choices=list(POLICIES),
                   help="router's prefill placement (disaggregated); the engine's own is --scheduling-policy")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="router refuses (429) requests predicted to miss this TTFT, before prefill (off by default)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="router refuses requests whose decode worker's predicted TPOT exceeds this (off)")
    p.add_argument("--kv-watermark", type=float, default=None,
                   help="router refuses new long requests while decode KV usage is above this, e.g. 0.92 (off)")
    p.add_argument("--kv-layerwise", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="stream each layer's KV as soon as it is computed (--no-kv-layerwise: eager)")
    p.add_argument("--kv-wire", choices=["none", "int8", "fp8"], default="none")
    p.add_argument("--kv-transport", choices=["auto", "tcp", "nixl"], default="auto",
                   help="auto: shared memory on one host, TCP across hosts; nixl: NIXL WRITE (needs nixl-cu12)")
    p.add_argument("--kv-mode", choices=["push", "pull"], default="push")
    p.add_argument("--kv-bandwidth-gbps", type=float, default=None,
                   help="router: KV bandwidth for its TTFT prediction (default: measured from transfers)")
    p.add_argument("--worker-timeout-s", type=float, default=None,
                   help="router: seconds without a heartbeat before a worker is dead (router default 3)")
    p.add_argument("--kv-timeout-s", type=float, default=None,
                   help="router: lease of a decode reservation whose KV has not arrived (router default 120)")
    p.add_argument("--no-pin", action="store_true", help="do not pin workers to cores")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /tokenize (env PDSERVE_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="model id(s) clients use (default: the model's own name)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests that may wait for their first token before new ones get 429")
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="append one JSON line per engine step (timing and batch shape) for `pdserve sim "
                        "--calibrate --from-trace`; disaggregated: FILE.<worker-id>.jsonl per worker")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    add_engine_arguments(p)


def run(args) -> int:
    from pdserve.server import logs

    logs.configure(args.log_level, args.log_format)
    if args.mode == "disaggregated":
        from pdserve.server.launcher import launch

        if args.prefill < 1 or args.decode < 1:
            print("pdserve serve: --prefill and --decode must be at least 1", file=sys.stderr)
            return 2
        return launch(args)
    try:
        app, engine = _build(args)
    except ValueError as e:  # ConfigError and friends: refuse before binding the port
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    config = uvicorn.Config(app, host=args.host, port=args.port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=args.shutdown_timeout + 5, lifespan="on")
    server = _Server(config, engine, args.shutdown_timeout)
    log.info("serving", extra={"fields": {"host": args.host, "port": args.port, "mode": args.mode,
                                          "auth": args.api_key is not None}})
    server.run()
    return 0 if server.started else 1


def _build(args):
    from pdserve.config import EngineConfig
    from pdserve.engine.cli import engine_kwargs
    from pdserve.engine.step_trace import open_step_trace
    from pdserve.server.app import ServerSettings, build_app
    from pdserve.server.async_engine import AsyncEngine
    from pdserve.server.metrics import ServerMetrics

    if args.max_waiting_requests < 0 or args.max_request_body_bytes < 1:
        raise ValueError("--max-waiting-requests must be >= 0 and --max-request-body-bytes >= 1")
    config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    names = args.served_model_name or []

    def make_engine():
        from pdserve.engine.llm_engine import LLMEngine

        return LLMEngine(config)

    engine = AsyncEngine(make_engine, lambda name: ServerMetrics(names[0] if names else name),
                         max_waiting_requests=args.max_waiting_requests, step_trace=open_step_trace(args.step_trace))
    settings = ServerSettings(served_model_names=names, api_key=args.api_key,
                              max_request_body_bytes=args.max_request_body_bytes)
    return build_app(engine, settings), engine


class _Server(uvicorn.Server):
    """uvicorn's graceful shutdown, plus: refuse new work at once, give in-flight
    requests `grace_s` to finish, then end the rest with a clear 503 error event."""

    def __init__(self, config, engine, grace_s: float):
        super().__init__(config)
        self.engine = engine
        self.grace_s = grace_s
        self._loop = None

    async def serve(self, sockets=None):
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame):
        first = not self.should_exit
        super().handle_exit(sig, frame)
        # exit 0 after a clean drain instead of re-raising the signal at the end
        getattr(self, "_captured_signals", []).clear()
        if first and self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self):
        self.engine.draining = True
        log.info("draining", extra={"fields": {"in_flight": self.engine.num_in_flight, "grace_s": self.grace_s}})
        self._loop.call_later(self.grace_s, self.engine.fail_all,
                              APIError(503, "the server shut down before this request finished"))
