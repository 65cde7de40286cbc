"""The router process: the OpenAI API in front, the worker registry behind.

The public API is the collocated server's own app (pdserve/server/app.py)
over a `DisaggEngine`; this file adds the control endpoints workers use and
the router's own metrics. Every route under /internal/ needs a request signed
with the cluster secret (pdserve/auth.py): without it, 401 and a log line. The
bodies workers and supervisors send are models of pdserve/control_api.py.
"""

from __future__ import annotations

import logging
import os
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve import auth
from pdserve.control_api import (
    HeartbeatRequest,
    HeartbeatResponse,
    KVEventsBody,
    PoolPollRequest,
    PoolPollResponse,
    RegisterRequest,
    RegisterResponse,
    ResumeRequest,
    ScaleRequest,
    ScaleResponse,
)
from pdserve.router import conductor
from pdserve.router.disagg import DisaggEngine
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.server.app import ServerSettings, build_app
from pdserve.server.errors import APIError

log = logging.getLogger("pdserve.router")
ROUTER_ID = uuid.uuid4().hex  # this process's: RegisterResponse.router_id


def build_router_app(engine: DisaggEngine, registry: Registry, settings: ServerSettings, secret: bytes, aliases=()):
    app = build_app(engine, settings)
    verifier = auth.Verifier(secret, aliases=aliases)
    app.add_middleware(auth.InternalAuth, verifier=verifier)
    engine.metrics.registry.register(_RouterCollector(engine, registry, verifier))

    # The control routes take their bodies as control_api models: FastAPI validates them,
    # and a body that does not fit is a 400 naming the field (errors.install_handlers).
    async def register(b: RegisterRequest) -> RegisterResponse:
        info = WorkerInfo(
            worker_id=b.worker_id,
            url=b.url,
            role=b.role,
            kv_address=b.kv_address,
            kv_export_address=b.kv_export_address,
            host=b.host,
            restarts=b.restarts,
            features=frozenset(b.features),
        )
        unreachable = await engine.probe(info.url)
        if unreachable:
            log.warning("refused registration of %s: %s", info.worker_id, unreachable)
            raise APIError(
                400,
                f"the router cannot reach {info.url} ({unreachable}); start the worker with "
                "--advertise-host set to an address the router and the other workers can dial",
                param="url",
            )
        old = registry.get(info.worker_id)
        registry.register(info)
        log.info(
            "worker registered",
            extra={
                "fields": {
                    "worker_id": info.worker_id,
                    "role": info.role,
                    "url": info.url,
                    "restarts": info.restarts,
                    "again": old is not None,
                }
            },
        )
        engine.refresh_stats()
        engine.sync_lora_adapters(info.worker_id)
        return RegisterResponse(registered=info.worker_id, router_id=ROUTER_ID)

    async def heartbeat(b: HeartbeatRequest) -> HeartbeatResponse | JSONResponse:
        wid = b.worker_id
        if not registry.heartbeat(wid, b.stats):
            return JSONResponse({"error": "unknown worker: register again"}, status_code=404)
        engine.refresh_stats()
        if b.kv_events is None:
            return HeartbeatResponse(ok=True)
        kv_snapshot = _feed_index(engine.placer.index, wid, b.kv_events)
        _feed_tiers(engine.placer.index, wid, b.stats)
        return HeartbeatResponse(ok=True, kv_snapshot=kv_snapshot)

    async def workers(request: Request):
        return {
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "url": w.url,
                    "role": w.role,
                    "alive": w.alive,
                    "kv_address": w.kv_address,
                    "features": sorted(w.features),  # control_api.WORKER_FEATURES it has
                    "stats": w.stats,
                }
                for w in registry.all()
            ],
            "counters": engine.counters,
            "policy": engine.placer.name,
            "prefix_index": engine.placer.index.stats(),
            "admission": _admission_status(engine.admitter),
        }

    engine.pools.pd_advice = lambda: conductor_status(engine.metrics, registry)["recommended_nd_per_np"]

    async def pools(request: Request):
        return engine.pools.status()

    async def supervisor_poll(b: PoolPollRequest) -> PoolPollResponse:
        """A supervisor (pdserve serve, the Ray driver) says what it runs; gets the wanted sizes."""
        return PoolPollResponse(wanted=engine.pools.supervisor_poll(b.running))

    async def scale(b: ScaleRequest) -> ScaleResponse:
        try:
            wanted = engine.pools.scale({"prefill": b.prefill, "decode": b.decode})
        except ValueError as e:
            raise APIError(400, str(e)) from None
        live = engine.pools.live_counts()
        grows = [r for r in wanted if wanted[r] > live.get(r, 0)]
        note = None
        if grows and not engine.pools.sizes.supervised():
            note = (
                f"no supervisor polls this router: start the new {' and '.join(grows)} worker(s) by hand "
                "(pdserve worker --router ...)"
            )
        log.info("pools scaled", extra={"fields": {"wanted": wanted, "live": live}})
        await engine.pools.tick()  # shrink at once; growth is the supervisor's next poll
        return ScaleResponse(wanted=wanted, live=live, note=note)

    async def resume(request: Request, path: str, b: ResumeRequest):
        if path not in ("completions", "chat/completions"):
            raise APIError(404, f"no route POST /internal/resume/{path}")
        return await app.state.api.resume(request, b, path)

    app.add_api_route(
        "/internal/resume/{path:path}", resume, methods=["POST"], include_in_schema=False, response_model=None
    )
    app.add_api_route("/internal/admin/pools", pools, methods=["GET"], include_in_schema=False)
    app.add_api_route("/internal/admin/pools/poll", supervisor_poll, methods=["POST"], include_in_schema=False)
    app.add_api_route("/internal/admin/scale", scale, methods=["POST"], include_in_schema=False)
    app.add_api_route("/internal/register", register, methods=["POST"], include_in_schema=False)
    # response_model=None: an unknown worker gets a bare 404 JSONResponse, which is no HeartbeatResponse
    app.add_api_route("/internal/heartbeat", heartbeat, methods=["POST"], include_in_schema=False, response_model=None)
    app.add_api_route("/internal/workers", workers, methods=["GET"], include_in_schema=False)
    app.add_api_route(
        "/internal/conductor",
        lambda: conductor_status(engine.metrics, registry),
        methods=["GET"],
        include_in_schema=False,
    )
    return app


def _mean(h) -> float | None:
    n = sum(h.counts)
    return h.sum / n if n else None


def _mean_stat(workers, key: str) -> float | None:
    vals = [float(w.stats[key]) for w in workers if (w.stats or {}).get(key)]
    return sum(vals) / len(vals) if vals else None


def conductor_status(metrics, registry: Registry) -> dict:
    """Observed mean Lin / Lout and the decode-per-prefill ratio that balances the pools for them.

    Theta_P / Theta_D are the means of what live workers report in their stats
    (`prefill_tokens_per_s`, `decode_tokens_per_s`); until they do, the ratio is null."""
    lin, lout = _mean(metrics.req_prompt), _mean(metrics.req_generation)
    theta_p = _mean_stat(registry.alive("prefill"), "prefill_tokens_per_s")
    theta_d = _mean_stat(registry.alive("decode"), "decode_tokens_per_s")
    ratio = None
    if None not in (lin, lout, theta_p, theta_d):
        ratio = conductor.recommended_pd_ratio(lin, lout, theta_p, theta_d)
    return {
        "mean_lin_tokens": lin,
        "mean_lout_tokens": lout,
        "theta_p_tokens_per_s": theta_p,
        "theta_d_tokens_per_s": theta_d,
        "recommended_nd_per_np": ratio,
        "num_prefill": len(registry.alive("prefill")),
        "num_decode": len(registry.alive("decode")),
    }


def _admission_status(admitter) -> dict | None:
    if admitter is None:
        return None
    return {
        "admitted": admitter.admitted,
        "rejected": dict(admitter.rejected),
        **vars(admitter.config),
        "kv_bandwidth_used_bytes_per_s": admitter.bandwidth_bytes_per_s,
        "kv_bandwidth_measured_bytes_per_s": admitter.transfers.bandwidth_bytes_per_s,
        "last_prediction": admitter.last,
    }


def _feed_index(index, worker_id: str, kv: KVEventsBody | dict) -> bool:
    """Apply a heartbeat's KV events (and snapshot); True when the worker must send a snapshot.
    `kv`: as the heartbeat route validated it, or as a KVEventPublisher made it."""
    try:
        if not isinstance(kv, KVEventsBody):
            kv = KVEventsBody.model_validate(kv)
        index.apply_events(worker_id, kv.epoch, [e.model_dump() for e in kv.events])
        if kv.snapshot is not None:
            index.apply_snapshot(worker_id, kv.epoch, kv.snapshot.seq, kv.snapshot.block_hashes)
    except (KeyError, TypeError, ValueError) as e:
        raise APIError(400, f"bad kv_events: {e}") from None
    return index.needs_snapshot(worker_id)


def _feed_tiers(index, worker_id: str, stats: dict) -> None:
    """A worker's KV tiers as its heartbeat reports them (capacity in blocks, shared or not)."""
    kv = stats.get("kv_store")
    if not isinstance(kv, dict):
        return
    try:
        index.set_tiers(worker_id, int(kv.get("lower_capacity_blocks", 0)), bool(kv.get("shared", False)))
    except (TypeError, ValueError) as e:
        raise APIError(400, f"bad kv_store stats: {e}") from None


class _RouterCollector:
    """Disaggregation metrics, read at scrape time from the engine's counters and the registry."""

    def __init__(self, engine: DisaggEngine, registry: Registry, verifier: auth.Verifier):
        self.engine, self.registry, self.verifier = engine, registry, verifier

    def describe(self):
        return []

    def collect(self):
        c = self.engine.counters
        for name, doc, key in (
            ("kv_transfer_bytes", "KV bytes moved from prefill to decode workers.", "kv_bytes"),
            ("kv_transfer_seconds", "Seconds from transfer start to acknowledgement.", "kv_seconds"),
            ("kv_transfer_failed", "KV transfers that failed.", "kv_failed"),
            ("kv_transfer_retries", "Reconnects during KV transfers.", "kv_retries"),
            ("request_recomputed", "Requests whose prompt the decode worker recomputed.", "recomputed"),
            ("request_replaced", "Requests moved to another worker mid-decode.", "replaced"),
            (
                "request_whole_on_one_worker",
                "Requests one worker ran whole because the other role had no live worker.",
                "whole",
            ),
            (
                "request_local_prefill",
                "Requests whose short prompt was prefilled on their decode worker (--max-local-prefill-length).",
                "local_prefill",
            ),
            (
                "request_resumed",
                "Streams resumed here after the router that served them died (the front sent what they had streamed).",
                "resumed",
            ),
            (
                "kv_transfer_exposed_seconds",
                "Transfer seconds left after the prefill ended (what TTFT pays; layer-wise hides the rest).",
                "kv_exposed_seconds",
            ),
            ("kv_transfer_exposed_bytes", "Bytes that travelled in the exposed seconds.", "kv_exposed_bytes"),
            (
                "lora_adapters_synced",
                "LoRA adapters loaded at run time that the router loaded on a worker that joined or restarted.",
                "lora_synced",
            ),
        ):
            m = CounterMetricFamily(f"pdserve:{name}", doc)
            m.add_metric([], c.get(key, 0))
            yield m
        for h in (self.engine.kv_transfer_time, self.engine.kv_exposed_time):
            yield h.family(self.engine.metrics.model_name)
        refused = CounterMetricFamily(
            "pdserve:internal_auth_refused", "Internal calls refused for a missing or wrong cluster-token signature."
        )
        refused.add_metric([], self.verifier.refused)
        yield refused
        restarts = CounterMetricFamily(
            "pdserve:worker_restarts",
            "Restarts of each worker by its supervisor, as the worker reported at registration.",
            labels=["worker_id", "role"],
        )
        for w in self.registry.all():
            restarts.add_metric([w.worker_id, w.role], w.restarts)
        # the router's own, as its supervisor told it (its other counters start again from 0 then)
        from pdserve.server.launcher import RESTARTS_ENV

        restarts.add_metric(["router", "router"], float(os.environ.get(RESTARTS_ENV, "0") or 0))
        yield restarts
        alive = GaugeMetricFamily("pdserve:workers_alive", "Live workers by role.", labels=["role"])
        queue = GaugeMetricFamily("pdserve:worker_queue_requests", "Waiting requests per role.", labels=["role"])
        for role in ("prefill", "decode"):
            ws = self.registry.alive(role)
            alive.add_metric([role], len(ws))
            queue.add_metric([role], sum((w.stats or {}).get("num_waiting", 0) for w in ws))
        yield alive
        yield queue
        pools = self.engine.pools
        wanted = GaugeMetricFamily(
            "pdserve:pool_wanted_workers", "Wanted pool size by role (scale commands, the autoscaler).", labels=["role"]
        )
        for role, n in (pools.sizes.wanted or {}).items():
            wanted.add_metric([role], n)
        yield wanted
        decisions = CounterMetricFamily(
            "pdserve:autoscale_decisions", "Pool-size changes the autoscaler made.", labels=["role", "direction"]
        )
        for (role, direction), n in sorted(pools.decisions.items()):
            decisions.add_metric([role, direction], n)
        yield decisions
        retired = CounterMetricFamily("pdserve:workers_retired", "Workers asked to drain and leave (pool shrunk).")
        retired.add_metric([], pools.retired)
        yield retired
        rejected = CounterMetricFamily(
            "pdserve:router_early_rejected",
            "Requests refused before prefill (predicted SLO miss, or KV backpressure).",
            labels=["reason"],
        )
        counts = self.engine.admitter.rejected if self.engine.admitter is not None else {}
        for reason in ("ttft_slo", "tpot_slo", "kv_backpressure"):
            rejected.add_metric([reason], counts.get(reason, 0))
        yield rejected
        st = conductor_status(self.engine.metrics, self.registry)
        for key, name, doc in (
            ("mean_lin_tokens", "observed_mean_prompt_tokens", "Mean prompt tokens (Lin)."),
            ("mean_lout_tokens", "observed_mean_generation_tokens", "Mean generated tokens (Lout)."),
            ("recommended_nd_per_np", "recommended_pd_ratio", "N_D / N_P = (Lout / Lin) x (Theta_P / Theta_D)."),
        ):
            if st[key] is not None:
                g = GaugeMetricFamily(f"pdserve:{name}", doc)
                g.add_metric([], st[key])
                yield g
