"""`pdserve serve`: the OpenAI-compatible API over one collocated engine.

The port is bound at once and the model loads in the engine thread, so
`/health` answers 503 ("loading") until the engine is ready and a supervisor
can tell a slow start from a dead one.
"""

from __future__ import annotations

import logging
import os
import sys

from pdserve.server import serving

log = logging.getLogger("pdserve.server")


def add_arguments(p) -> None:
    """Every section the router and the workers take, and serve's own (what it starts, Ray):
    `pdserve serve` hands each child the settings it shares with it (server/launcher.py)."""
    from pdserve import flags
    from pdserve.settings import SERVE_SECTIONS

    flags.add_arguments(p, SERVE_SECTIONS, config_file=True)


def run(args) -> int:
    from pdserve import flags
    from pdserve.server import logs
    from pdserve.settings import SERVE_SECTIONS

    logs.configure(args.log_level, args.log_format)
    flags.log_settings(log, SERVE_SECTIONS, args)
    if args.otlp_traces_endpoint:
        from pdserve import tracing

        # refused here, not by each child once started
        why = tracing.check(args.otlp_traces_endpoint)
        if why:
            print(f"pdserve serve: {why}", file=sys.stderr)
            return 2
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
        if args.speculative_config is not None:  # refused here, not by each worker once started
            from pdserve.config import ConfigError, SpeculativeConfig

            try:
                SpeculativeConfig.parse(args.speculative_config)
            except ConfigError as e:
                print(f"pdserve serve: {e}", file=sys.stderr)
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
    if args.prefill != 1 or args.decode != 1:
        log.warning("--prefill and --decode size the pools of --mode disaggregated; collocated runs one engine")
    try:
        from pdserve import tracing

        tracing.configure(args.otlp_traces_endpoint, "pdserve", **{"pdserve.role": "collocated"})
        app, engine = _build(args)
    except ValueError as e:  # ConfigError and friends: refuse before binding the port
        print(f"pdserve serve: {e}", file=sys.stderr)
        return 2
    log.info(
        "serving",
        extra={"fields": {"host": args.host, "port": args.port, "mode": args.mode, "auth": args.api_key is not None}},
    )
    server = serving.make_server(app, args.host, args.port, engine, args.shutdown_timeout)
    engine.on_failure = server.exit
    server.run()
    return server.status


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
    from pdserve.config import EngineConfig, engine_kwargs
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
        lambda name: ServerMetrics(names[0] if names else name, vllm_names=args.vllm_metric_names),
        max_waiting_requests=args.max_waiting_requests,
        step_trace=open_step_trace(args.step_trace),
    )
    settings = ServerSettings.from_args(args)
    return build_app(engine, settings), engine
