"""`pdserve router`: the OpenAI API in front of prefill and decode workers that register here."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from pdserve.router.policy import POLICIES

log = logging.getLogger("pdserve.router")


def add_arguments(p) -> None:
    from pdserve.router.disagg import KV_TIMEOUT_S

    p.add_argument("--model", default=None, help="GGUF file or HF directory (tokenizer, context length)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"))
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument(
        "--policy",
        default="cache_aware",
        choices=list(POLICIES),
        help="prefill placement (cache_aware: lowest (1 - cache hit) x prefill time + alpha x queue wait, "
        "from the prefix index); "
        "decode goes to the worker with the most free KV",
    )
    p.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=None,
        help="refuse (429) requests whose predicted TTFT exceeds this, before any prefill (off by default)",
    )
    p.add_argument(
        "--slo-tpot-ms",
        type=float,
        default=None,
        help="refuse requests whose decode worker's predicted TPOT exceeds this (off by default)",
    )
    p.add_argument(
        "--kv-watermark",
        type=float,
        default=None,
        help="refuse new long requests while decode KV usage is above this fraction, e.g. 0.92 (off)",
    )
    p.add_argument(
        "--long-request-tokens",
        type=int,
        default=1024,
        help="prompt + max_tokens at or above this is a long request for --kv-watermark",
    )
    p.add_argument(
        "--kv-bandwidth-gbps",
        type=float,
        default=None,
        help="KV transfer bandwidth in Gbit/s (10^9 bits) for the TTFT prediction; default: measured "
        "from the exposed part of past transfers (10 Gbit/s until the first one)",
    )
    p.add_argument(
        "--kv-mode",
        default="push",
        choices=["push", "pull"],
        help="push: P writes into blocks D reserved; pull: D fetches from P when told",
    )
    p.add_argument("--worker-timeout-s", type=float, default=3.0, help="missed heartbeats before a worker is dead")
    p.add_argument(
        "--kv-timeout-s",
        type=float,
        default=KV_TIMEOUT_S,
        help="lease of a decode reservation whose KV has not arrived (default %(default)s s); a "
        "transfer that breaks is reported at once, so this only bounds a silent hang (a CPU "
        "prefill queued behind long prompts can take tens of seconds)",
    )
    p.add_argument("--max-num-seqs-in-flight", type=int, default=1024)
    p.add_argument("--max-request-body-bytes", type=int, default=1 << 20)
    p.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="refuse (400) a request of more sequences than this (prompts x n)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (new ones get 503 meanwhile)",
    )
    add_autoscale_arguments(p)
    p.add_argument("--fd", type=int, default=None, help=argparse.SUPPRESS)  # a listening socket from pdserve serve
    add_cluster_token_argument(p)
    p.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="/metrics needs the --api-key too (by default it is open, like /health)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--log-format", default="text", choices=["text", "json"])


def add_autoscale_arguments(p) -> None:
    import argparse

    from pdserve.router.autoscale import AutoscaleConfig

    d = AutoscaleConfig()
    p.add_argument(
        "--autoscale",
        action="store_true",
        help="grow and shrink the pools from queue and KV-usage signals and the P:D advice, "
        "within --min/--max-prefill and --min/--max-decode, one worker per --autoscale-cooldown-s",
    )
    for role in ("prefill", "decode"):
        p.add_argument(f"--min-{role}", type=int, default=getattr(d, f"min_{role}"), help=argparse.SUPPRESS)
        p.add_argument(
            f"--max-{role}",
            type=int,
            default=getattr(d, f"max_{role}"),
            help=f"autoscale bounds of the {role} pool (--min-{role} too)",
        )
    p.add_argument("--autoscale-cooldown-s", type=float, default=d.cooldown_s)
    p.add_argument("--autoscale-interval-s", type=float, default=d.interval_s)


def autoscale_config(args):
    from pdserve.router.autoscale import AutoscaleConfig

    if not args.autoscale:
        return None
    return AutoscaleConfig(
        min_prefill=args.min_prefill,
        max_prefill=args.max_prefill,
        min_decode=args.min_decode,
        max_decode=args.max_decode,
        cooldown_s=args.autoscale_cooldown_s,
        interval_s=args.autoscale_interval_s,
    )


def add_cluster_token_argument(p) -> None:
    from pdserve import auth

    p.add_argument(
        "--cluster-token-file",
        default=None,
        metavar="FILE",
        help="the deployment's shared secret, required on every internal route and KV connection "
        f"(default: ${auth.TOKEN_ENV}, else {auth.DEFAULT_TOKEN_FILE}, made on first use)",
    )


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
    core = _Core(info.config, Tokenizer.from_loaded(info))
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
        ServerMetrics(names[0] if names else info.config.name),
        Placer(args.policy),
        kv_timeout_s=args.kv_timeout_s,
        max_in_flight=args.max_num_seqs_in_flight,
        kv_mode=args.kv_mode,
        admitter=Admitter(admission) if admission.enabled else None,
        secret=secret,
    )
    engine.pools.set_autoscale(autoscale_config(args))
    settings = ServerSettings(
        served_model_names=names,
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        metrics_require_key=args.metrics_require_key,
        max_seqs_per_request=args.max_seqs_per_request,
    )
    return build_router_app(engine, registry, settings, secret), engine


class _Core:
    """What the OpenAI app reads from an engine: name, tokenizer, context length."""

    def __init__(self, model_config, tokenizer):
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_position_embeddings


def run(args) -> int:
    from pdserve.engine.loader import ModelLoadError
    from pdserve.server import logs, serving

    logs.configure(args.log_level, args.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per control call is noise
    try:
        app, engine = build(args)
    except (ModelLoadError, ValueError) as e:
        print(f"pdserve router: {e}", file=sys.stderr)
        return 2
    log.info("router listening", extra={"fields": {"host": args.host, "port": args.port, "policy": args.policy}})
    # under `pdserve serve` the launcher owns the listening socket: while a crashed router
    # restarts, clients wait in its backlog instead of being refused
    sockets = [socket.socket(fileno=args.fd)] if args.fd is not None else None
    server = serving.serve(app, args.host, args.port, engine, args.shutdown_timeout, sockets=sockets)
    return 0 if server.started else 1
