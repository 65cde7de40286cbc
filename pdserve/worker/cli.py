"""`pdserve worker --role prefill|decode|both --router URL`: one engine process that joins a router.

Workers are plain processes: any scheduler (a shell, Kubernetes, Slurm) can
start them anywhere the router and the other workers can reach.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.ports import free_port

if TYPE_CHECKING:
    from pdserve.costmodel import DecodeCostModel
    from pdserve.server.async_engine import HeartbeatSnapshot
    from pdserve.server.calibrate import DecodeStepRecorder

log = logging.getLogger("pdserve.worker")


@dataclass
class WorkerState:
    """What the worker learns about its engine once it is built (on the engine thread)
    and at start-up calibration, for its heartbeats."""

    steps: DecodeStepRecorder | None = None  # live step times: rescale the cost models
    static_stats: dict = field(default_factory=dict)  # heartbeat stats fixed by the engine's shape
    calibration: dict = field(default_factory=dict)  # prefill start-up calibration (heartbeat stats)
    decode_model: DecodeCostModel | None = None  # decode start-up calibration

    def live_stats(self, snap: HeartbeatSnapshot) -> dict:
        """A heartbeat's live stats from what the engine thread read: the decode side's
        context in the batch, the cost models rescaled by live steps, the KV block size."""
        from pdserve.server.calibrate import decode_stats, prefill_stats

        live = dict(self.static_stats)
        live.update(prefill_stats(self.calibration, snap.prefill_steps))
        live["running_context_tokens"] = snap.running_context_tokens
        if self.decode_model is not None:
            live.update(decode_stats(self.decode_model, snap.decode_steps, self.static_stats["max_num_seqs"]))
        live["kv_block_size"] = snap.block_size
        return live


def add_arguments(p) -> None:
    from pdserve import flags
    from pdserve.settings import WORKER_SECTIONS

    flags.add_arguments(p, WORKER_SECTIONS, config_file=True)


def run(args) -> int:
    from pdserve import flags
    from pdserve.server import logs, serving
    from pdserve.settings import WORKER_SECTIONS

    logs.configure(args.log_level, args.log_format)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat is noise
    if args.role is None:
        print("pdserve worker: --role is required (prefill, decode or both)", file=sys.stderr)
        return 2
    flags.log_settings(log, WORKER_SECTIONS, args)
    if args.cpu_cores:
        os.sched_setaffinity(0, {int(c) for c in args.cpu_cores.split(",")})
    port = args.port or free_port(args.host)
    try:
        app, api, beat_now = build(args, port)
    except ValueError as e:
        print(f"pdserve worker: {e}", file=sys.stderr)
        return 2

    async def tell_router():  # a beat now says we drain: no new work comes here
        beat_now.set()

    server = serving.make_server(
        app, args.host, port, api.engine, args.shutdown_timeout, on_drain=tell_router, log_level="warning"
    )
    api.start_drain = server.start_drain  # /internal/drain: the router retires this worker
    api.engine.on_failure = server.exit
    api.exit = server.exit
    server.run()
    return server.status


def build(args, port: int):
    """The worker's app, its API object, and an event that sends a heartbeat at once when set."""
    from pdserve import auth, tracing
    from pdserve.config import EngineConfig, engine_kwargs
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.step_trace import open_step_trace
    from pdserve.server.async_engine import AsyncEngine
    from pdserve.server.calibrate import DecodeStepRecorder
    from pdserve.server.metrics import ServerMetrics
    from pdserve.transfer.auto import AutoKVSender
    from pdserve.transfer.receiver import KV_IDLE_TIMEOUT_S, KVReceiverServer
    from pdserve.worker.app import WorkerApi, build_worker_app

    role = args.role
    secret = auth.load_cluster_secret(args.cluster_token_file)
    host = args.advertise_host or args.host
    worker_id = args.worker_id or f"{role}-{uuid.uuid4().hex[:6]}"
    tracing.configure(
        args.otlp_traces_endpoint,
        f"pdserve-{role}",
        **{"service.instance.id": worker_id, "pdserve.role": role, "pdserve.worker.id": worker_id},
    )
    kw = engine_kwargs(args)
    if args.kv_transport == "nixl" and role != "prefill":
        from pdserve.transfer.nixl import nixl_available

        if not nixl_available():
            raise SystemExit("--kv-transport nixl: NIXL is not importable (pip install --no-deps nixl-cu12==1.5.1)")
    if (
        role in ("decode", "both")
        and args.kv_transport != "nixl"
        and args.kv_shm_dir
        and os.path.isdir(args.kv_shm_dir)
    ):
        kw["kv_cache_shm_dir"] = args.kv_shm_dir
    sender = None
    if role != "decode":
        from pdserve.transfer.pull import PullKVExporter

        exporter = PullKVExporter(host=args.host, wire_mode=args.kv_wire, secret=secret)
        sender = AutoKVSender(
            args.kv_wire,
            allow_shm=args.kv_transport == "auto",
            exporter=exporter,
            secret=secret,
            shm_dir=args.kv_shm_dir,
        )
    state = WorkerState()

    def make_engine():
        engine = LLMEngine(
            EngineConfig.from_kwargs(model=args.model, **kw),
            kv_secret=secret,
            kv_sender=sender,
            kv_layerwise=args.kv_layerwise,
        )
        # the router's prefix index follows these; without a router nobody drains them
        engine.block_manager.record_events = bool(args.router)
        if role != "prefill":
            if args.kv_transport == "nixl":
                from pdserve.transfer.nixl import NixlKVReceiver

                api.receiver = NixlKVReceiver(engine.runner.kv_caches, host=args.host, secret=secret)
            else:
                api.receiver = KVReceiverServer(
                    engine.runner.kv_caches,
                    host=args.host,
                    secret=secret,
                    scheme="shm" if engine.runner.kv_shm_paths else "tcp",
                    shm_paths=engine.runner.kv_shm_paths,
                    # a pull connection waits out a whole prefill: never idle-closed inside a lease
                    idle_timeout_s=max(KV_IDLE_TIMEOUT_S, args.max_kv_lease_s + 60),
                )
        state.steps = DecodeStepRecorder(engine)
        state.static_stats = {
            "kv_bytes_per_token": engine.runner.kv_cache_bytes
            // max(1, engine.runner.num_blocks * engine.runner.block_size),
            "num_layers": engine.model_config.num_hidden_layers,
            "kv_layerwise": bool(args.kv_layerwise),
            "max_num_seqs": engine.config.scheduler.max_num_seqs,
        }
        return engine

    engine = AsyncEngine(
        make_engine,
        ServerMetrics,
        max_waiting_requests=args.max_waiting_requests,
        step_trace=open_step_trace(args.step_trace),
    )
    api = WorkerApi(engine, role, sender=sender, max_lease_s=args.max_kv_lease_s)
    beat_now = asyncio.Event()

    async def join_router():
        if not args.router:
            return
        await engine.ready.wait()
        if engine.failure is not None:  # the process exits (on_failure): never register
            return
        from pdserve import costmodel
        from pdserve.server import calibrate

        if args.calibrate and role != "decode":
            state.calibration = calibrate.calibration_stats(await api.engine.calibrate_prefill())
            log.info("prefill calibration: %s", state.calibration)
        if args.calibrate and role != "prefill":
            samples = await api.engine.calibrate_decode(state.steps)
            if len(samples) >= 3:
                state.decode_model = costmodel.fit_decode_cost(samples)
                log.info("decode calibration: %s from %s", state.decode_model, samples)
        state.steps.prefill_samples.clear()  # live rescaling is about traffic, not calibration
        await _register_loop(args, worker_id, f"http://{host}:{port}", role, api, state, secret, beat_now, host)

    async def close():
        if sender is not None:
            sender.close()
        if api.receiver is not None:
            api.receiver.close()

    return (
        build_worker_app(api, secret, on_startup=join_router, on_shutdown=close, aliases=args.internal_aliases),
        api,
        beat_now,
    )


def advertised(address: str, host: str) -> str:
    """A KV endpoint's address as others must dial it: `scheme://host:port` with the
    advertised host in place of the one bound (which may be 0.0.0.0)."""
    if not address:
        return ""
    scheme, _, rest = address.partition("://")
    return f"{scheme}://{host}:{rest.rsplit(':', 1)[1]}"


async def _register_loop(
    args, worker_id, url, role, api, state: WorkerState, secret: bytes, beat_now: asyncio.Event, host: str
) -> None:
    import httpx
    from pydantic import ValidationError

    from pdserve import auth
    from pdserve.control_api import (
        LORA_ENABLED_FEATURE,
        WORKER_FEATURES,
        HeartbeatRequest,
        HeartbeatResponse,
        KVEventsBody,
        RegisterRequest,
        adapter_features,
    )
    from pdserve.server.errors import APIError
    from pdserve.server.launcher import RESTARTS_ENV
    from pdserve.worker.kv_publisher import KVEventPublisher

    kv_pub = KVEventPublisher()
    restarts = int(os.environ.get(RESTARTS_ENV, "0") or 0)
    async with httpx.AsyncClient(
        base_url=args.router, timeout=5, auth=auth.http_auth(secret), trust_env=False
    ) as client:
        registered = False
        pending, last_live = None, {}
        unreachable_logged_s = None  # when "router unreachable" was last logged (once a minute)
        last_router_id = ""  # the router process we last registered with (RegisterResponse.router_id)
        while True:
            # beats keep their period however long the engine took to answer and the post took:
            # a busy worker that beat every 1.5 s was declared dead under a 2 s timeout
            next_beat_s = asyncio.get_running_loop().time() + args.heartbeat_s
            try:
                if not registered:
                    recv = api.receiver
                    exporter = api.sender.exporter if api.sender is not None else None
                    reply = await _post(
                        client,
                        "/internal/register",
                        RegisterRequest(
                            worker_id=worker_id,
                            url=url,
                            role=role,
                            kv_address=advertised(recv.address, host) if recv else "",
                            kv_export_address=advertised(exporter.address, host) if exporter else "",
                            host=socket.gethostname(),
                            restarts=restarts,
                            features=[
                                *WORKER_FEATURES,
                                *(
                                    [LORA_ENABLED_FEATURE]
                                    if getattr(api.engine.engine, "lora", None) is not None
                                    else []
                                ),
                                *adapter_features(api.engine.lora_adapters().values()),
                            ],
                        ).wire(),
                    )
                    registered = True
                    log.info("registered with %s as %s (%s)", args.router, worker_id, role)
                    router_id = str(reply.get("router_id") or "")
                    if router_id and router_id != last_router_id:
                        if last_router_id:  # another router process: the one that reserved blocks is gone
                            await api.free_reservations("its router restarted", everything=True)
                        last_router_id = router_id
                # The engine thread answers between steps; one long prefill step (seconds on a
                # busy CPU) must not make the router think this worker died. So the beat goes
                # out on time with the last stats, and the KV events follow with a later beat:
                # the call stays pending (its events are numbered only once they are sent).
                if pending is None:
                    pending = asyncio.ensure_future(api.engine.heartbeat_snapshot(kv_pub.want_snapshot, state.steps))
                await asyncio.wait({pending}, timeout=args.heartbeat_s / 2)
                body = HeartbeatRequest(worker_id=worker_id)
                if pending.done():
                    snap, pending = pending.result(), None
                    last_live = state.live_stats(snap)
                    body.kv_events = KVEventsBody.model_validate(kv_pub.payload(snap.kv_events, snap.cached_hashes))
                body.stats = {
                    **(api.engine.stats or {}),
                    **state.calibration,
                    **last_live,
                    "draining": api.engine.draining,
                }
                r = await client.post("/internal/heartbeat", json=body.wire())
                if r.status_code == 401:
                    _refused(api, r)
                    return
                if unreachable_logged_s is not None:
                    log.info("router %s reachable again", args.router)
                    unreachable_logged_s = None
                registered = r.status_code == 200  # 404: the router forgot us (restart): register again
                if r.status_code == 404:
                    # the router that reserved blocks here is gone: nobody will ever decode those
                    await api.free_reservations("its router restarted", everything=True)
                if body.kv_events is not None:
                    kv_pub.want_snapshot = registered and bool(HeartbeatResponse.model_validate(r.json()).kv_snapshot)
            except httpx.HTTPStatusError as e:
                registered = False
                if e.response.status_code == 401:
                    _refused(api, e.response)
                    return
                if e.response.status_code == 400:  # e.g. the router cannot reach the address we gave
                    log.error("registration refused: %s", e.response.text)
            except (httpx.HTTPError, OSError) as e:
                registered = False
                now = time.monotonic()
                if unreachable_logged_s is None or now - unreachable_logged_s >= 60:
                    log.warning("router %s unreachable (retrying every %.1f s): %s", args.router, args.heartbeat_s, e)
                    unreachable_logged_s = now
            except ValidationError as e:  # a registration the router would refuse, or an answer we cannot read
                registered = False
                log.error("bad registration or heartbeat answer: %s", e)
            except APIError as e:  # the engine is loading or failed: /health says so; keep beating
                log.debug("heartbeat without engine stats: %s", e)
            try:
                await asyncio.wait_for(beat_now.wait(), max(0.0, next_beat_s - asyncio.get_running_loop().time()))
                beat_now.clear()
            except asyncio.TimeoutError:
                pass


async def _post(client, path, body) -> dict:
    r = await client.post(path, json=body)
    r.raise_for_status()
    return r.json()


def _refused(api, response) -> None:
    """The router refuses our cluster secret: retrying cannot help, so the worker exits (2)."""
    log.error(
        "the router refused this worker's cluster secret (%s); check --cluster-token-file: exiting", response.text
    )
    api.exit(2)
