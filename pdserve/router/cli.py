"""`pdserve router`: the OpenAI API in front of prefill and decode workers that register here."""

from __future__ import annotations

import argparse
import logging
import socket
import sys

log = logging.getLogger("pdserve.router")


def add_arguments(p) -> None:
    from pdserve import flags
    from pdserve.settings import ROUTER_SECTIONS

    flags.add_arguments(p, ROUTER_SECTIONS, config_file=True)
    p.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)  # a listening socket from pdserve serve


def autoscale_config(args):
    from pdserve import flags
    from pdserve.router.autoscale import AutoscaleConfig

    return flags.build(AutoscaleConfig, args) if args.autoscale else None


def add_cluster_token_argument(p) -> None:
    """`--cluster-token-file`, for the commands that only talk to a deployment (`pdserve scale`)."""
    from pdserve import flags
    from pdserve.flags import Section
    from pdserve.settings import SecurityConfig

    flags.add_arguments(p, [Section(SecurityConfig)])


def build(args):
    from pdserve import auth
    from pdserve.engine.loader import load_model_info
    from pdserve.engine.tokenizer import Tokenizer
    from pdserve.router.admission import AdmissionConfig, Admitter
    from pdserve.router.app import build_router_app
    from pdserve.router.disagg import DisaggEngine
    from pdserve.router.placement import Placer
    from pdserve.router.registry import Registry
    from pdserve.server.app import ServerSettings
    from pdserve.server.metrics import ServerMetrics

    secret = auth.load_cluster_secret(args.cluster_token_file)
    info = load_model_info(args.model)
    core = _Core(info.config, Tokenizer.from_loaded(info), args.max_model_len)
    names = args.served_model_name or []
    registry = Registry(timeout_s=args.worker_timeout_s)
    ms = lambda v: None if v is None else v / 1e3
    admission = AdmissionConfig(
        slo_ttft_s=ms(args.slo_ttft_ms),
        slo_tpot_s=ms(args.slo_tpot_ms),
        kv_watermark=args.kv_watermark,
        long_request_tokens=args.long_request_tokens,
        kv_bandwidth_bytes_per_s=args.kv_bandwidth_gbps * 1e9 / 8 if args.kv_bandwidth_gbps else None,
    )
    engine = DisaggEngine(
        core,
        registry,
        ServerMetrics(names[0] if names else info.config.name, vllm_names=args.vllm_metric_names),
        Placer(args.router_policy),
        kv_timeout_s=args.kv_timeout_s,
        max_in_flight=args.max_num_seqs_in_flight,
        kv_mode=args.kv_mode,
        admitter=Admitter(admission) if admission.enabled else None,
        secret=secret,
        max_local_prefill_length=args.max_local_prefill_length,
    )
    engine.pools.set_autoscale(autoscale_config(args))
    settings = ServerSettings.from_args(args)
    return build_router_app(engine, registry, settings, secret, aliases=args.internal_aliases), engine


class _Core:
    """What the OpenAI app reads from an engine: name, tokenizer, context length."""

    def __init__(self, model_config, tokenizer, max_model_len: int | None = None):
        self.model_config = model_config
        self.tokenizer = tokenizer
        # as the engine takes it: --max-model-len, never past the model's own
        positions = model_config.max_position_embeddings
        self.max_model_len = min(max_model_len or positions, positions)


def run(args) -> int:
    from pdserve import flags, tracing
    from pdserve.engine.loader import ModelLoadError
    from pdserve.server import logs, serving
    from pdserve.settings import ROUTER_SECTIONS

    logs.configure(args.log_level, args.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control call is noise
    flags.log_settings(log, ROUTER_SECTIONS, args)
    try:
        tracing.configure(args.otlp_traces_endpoint, "pdserve-router", **{"pdserve.role": "router"})
        app, engine = build(args)
    except (ModelLoadError, ValueError, tracing.TracingUnavailable) as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    log.info("router starting", extra={"fields": {"host": args.host, "port": args.port, "policy": args.router_policy}})
    # under `pdserve serve` the launcher owns the listening socket: while a crashed router
    # restarts, clients wait in its backlog instead of being refused
    sockets = [socket.socket(fileno=args.fd)] if args.fd is not None else None
    server = serving.serve(app, args.host, args.port, engine, args.shutdown_timeout, sockets=sockets)
    return 0 if server.started else 1
