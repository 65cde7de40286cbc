"""`pdserve serve`: the OpenAI-compatible API over one collocated engine.

The port is bound at once and the model loads in the engine thread, so
`/health` answers 503 ("loading") until the engine is ready and a supervisor
can tell a slow start from a dead one.
"""

from __future__ import annotations

import logging
import os
import sys

from pdserve.router.policy import POLICIES
from pdserve.server import serving

log = logging.getLogger("pdserve.server")


def add_arguments(p) -> None:
    from pdserve.engine.cli import add_engine_arguments
    from pdserve.router.disagg import KV_TIMEOUT_S

    p.add_argument(
        "--mode",
        default="disaggregated",
        choices=["disaggregated", "collocated"],
        help="disaggregated: router + prefill and decode worker processes; collocated: one engine",
    )
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (disaggregated)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (disaggregated)")
    p.add_argument(
        "--policy",
        dest="router_policy",
        default="cache_aware",
        choices=list(POLICIES),
        help="router's prefill placement (disaggregated); the engine's own is --scheduling-policy",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="router refuses (429) requests predicted to miss this TTFT, before prefill (off by default)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="router refuses requests whose decode worker's predicted TPOT exceeds this (off)",
    )
    p.add_argument(
        "--kv-watermark",
        type=float,
        default=None,
        help="router refuses new long requests while decode KV usage is above this, e.g. 0.92 (off)",
    )
    p.add_argument(
        "--kv-layerwise",
        action=__import__("argparse").BooleanOptionalAction,
        default=True,
        help="stream each layer's KV as soon as it is computed (--no-kv-layerwise: eager)",
    )
    p.add_argument("--kv-wire", choices=["none", "int8", "fp8"], default="none")
    p.add_argument(
        "--kv-transport",
        choices=["auto", "tcp", "nixl"],
        default="auto",
        help="auto: shared memory on one host, TCP across hosts; nixl: NIXL WRITE (needs nixl-cu12)",
    )
    p.add_argument("--kv-mode", choices=["push", "pull"], default="push")
    p.add_argument(
        "--kv-bandwidth-gbps",
        type=float,
        default=None,
        help="router: KV bandwidth for its TTFT prediction (default: measured from transfers)",
    )
    p.add_argument(
        "--worker-timeout-s",
        type=float,
        default=None,
        help="router: seconds without a heartbeat before a worker is dead (router default 3)",
    )
    p.add_argument(
        "--kv-timeout-s",
        type=float,
        default=KV_TIMEOUT_S,
        help="router: lease of a decode reservation whose KV has not arrived (default %(default)s s)",
    )
    p.add_argument("--no-pin", action="store_true", help="do not pin workers to cores")
    p.add_argument(
        "--host",
        default=None,
        help="address to bind (default: loopback only; with --ray-address, each node's Ray address)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 and /tokenize (env PDSERVE_API_KEY)",
    )
    p.add_argument(
        "--served-model-name", nargs="+", default=None, help="model id(s) clients use (default: the model's own name)"
    )
    p.add_argument(
        "--max-waiting-requests",
        type=int,
        default=256,
        help="sequences (prompts x n of each request) that may wait for their first token before new requests get 429",
    )
    p.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="most sequences (prompts x n) one request may ask for; more get 400",
    )
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish after SIGTERM"
    )
    p.add_argument(
        "--step-trace",
        default=None,
        metavar="FILE",
        help="append one JSON line per engine step (timing and batch shape) for `pdserve sim "
        "--calibrate --from-trace`; disaggregated: FILE.<worker-id>.jsonl per worker",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])
    add_engine_arguments(p)
    add_security_arguments(p)


def add_security_arguments(p) -> None:
    """What guards a deployment: the cluster secret (internal routes, KV) and /metrics behind the API key."""
    from pdserve.router.cli import add_autoscale_arguments, add_cluster_token_argument

    add_cluster_token_argument(p)
    add_autoscale_arguments(p)
    g = p.add_argument_group("Ray (pip install 'pdserve[ray]')")
    g.add_argument(
        "--ray",
        action="store_true",
        help="run the router and every worker as Ray actors on a Ray cluster (disaggregated mode)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        help="the cluster to join: auto, or HOST:PORT of its head (default: start a local one)",
    )
    g.add_argument(
        "--placement",
        choices=["spread", "pack"],
        default="spread",
        help="spread: prefill and decode workers on different nodes where possible; pack: together",
    )
    g.add_argument("--ray-max-restarts", type=int, default=-1, help="restarts Ray gives each actor (-1: no limit)")
    p.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the --api-key too (by default it is open, like /health)",
    )


def run(args) -> int:
    from pdserve.server import logs

    logs.configure(args.log_level, args.log_format)
    if args.host is None and not (args.ray and args.ray_address):
        args.host = "127.0.0.1"
    if getattr(args, "kv_store", "") and not args.kv_store_master:
        if args.ray and args.ray_address:
            print(
                "pdserve serve: with --ray-address, start a Mooncake master every host can reach and pass "
                "--kv-store-master HOST:PORT",
                file=sys.stderr,
            )
            return 2
        err = _start_store_master(args)
        if err:
            print(f"pdserve serve: {err}", file=sys.stderr)
            return 2
    if args.mode == "disaggregated":
        if args.prefill < 1 or args.decode < 1:
            print("pdserve serve: --prefill and --decode must be at least 1", file=sys.stderr)
            return 2
        if args.ray:
            if not args.ray_address and not os.environ.get("RAY_AUTH_MODE"):
                # a local Ray we start keeps its token auth on (read when ray is imported)
                from pdserve import auth

                os.environ["RAY_AUTH_MODE"] = "token"
                os.environ.setdefault("RAY_AUTH_TOKEN", auth.new_token())
            try:
                from pdserve.server import ray_launcher
            except ImportError as e:
                print(f"pdserve serve --ray: Ray is not installed ({e}); pip install 'pdserve[ray]'", file=sys.stderr)
                return 2
            return ray_launcher.launch(args)
        from pdserve.server.launcher import launch

        return launch(args)
    try:
        app, engine = _build(args)
    except ValueError as e:  # ConfigError and friends: refuse before binding the port
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    log.info(
        "serving",
        extra={"fields": {"host": args.host, "port": args.port, "mode": args.mode, "auth": args.api_key is not None}},
    )
    server = serving.serve(app, args.host, args.port, engine, args.shutdown_timeout)
    return 0 if server.started else 1


def _start_store_master(args) -> str | None:
    """`--kv-store mooncake` without a master: run one on loopback for this deployment's lifetime."""
    import atexit

    from pdserve.kvstore.master import MooncakeMaster, mooncake_missing

    missing = mooncake_missing()
    if missing:
        return missing
    try:
        master = MooncakeMaster(host="127.0.0.1").start()
    except RuntimeError as e:
        return f"the Mooncake master did not start: {e}"
    atexit.register(master.stop)
    args.kv_store_master, args.kv_store_metadata_url = master.rpc_address, master.metadata_url
    log.info("Mooncake master for the shared KV tier at %s (metadata %s)", master.rpc_address, master.metadata_url)
    return None


def _build(args):
    from pdserve.config import EngineConfig
    from pdserve.engine.cli import engine_kwargs
    from pdserve.engine.step_trace import open_step_trace
    from pdserve.server.app import ServerSettings, build_app
    from pdserve.server.async_engine import AsyncEngine
    from pdserve.server.metrics import ServerMetrics

    if args.max_waiting_requests < 0 or args.max_request_body_bytes < 1 or args.max_seqs_per_request < 1:
        raise ValueError(
            "--max-waiting-requests must be >= 0, --max-request-body-bytes and --max-seqs-per-request >= 1"
        )
    config = EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))
    names = args.served_model_name or []

    def make_engine():
        from pdserve.engine.llm_engine import LLMEngine

        return LLMEngine(config)

    engine = AsyncEngine(
        make_engine,
        lambda name: ServerMetrics(names[0] if names else name),
        max_waiting_requests=args.max_waiting_requests,
        step_trace=open_step_trace(args.step_trace),
    )
    settings = ServerSettings(
        served_model_names=names,
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        max_seqs_per_request=args.max_seqs_per_request,
        metrics_require_key=args.metrics_require_key,
    )
    return build_app(engine, settings), engine
