"""The router process: the OpenAI API in front, the worker registry behind.

The public API is the collocated server's own app (pdserve/server/app.py)
over a `DisaggEngine`; this file adds the control endpoints workers use and
the router's own metrics.
"""
from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.router import conductor
from pdserve.router.disagg import DisaggEngine
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.server.app import ServerSettings, build_app
from pdserve.server.errors import APIError


def build_router_app(engine: DisaggEngine, registry: Registry, settings: ServerSettings):
    app = build_app(engine, settings)
    engine.metrics.registry.register(_RouterCollector(engine, registry))

    async def register(request: Request):
        b = _json(await request.body())
        try:
            info = WorkerInfo(worker_id=str(b["worker_id"]), url=str(b["url"]), role=str(b["role"]),
                              kv_address=str(b.get("kv_address", "")),
                              kv_export_address=str(b.get("kv_export_address", "")), host=str(b.get("host", "")))
            registry.register(info)
        except (KeyError, ValueError) as e:
            raise APIError(400, f"bad registration: {e}") from None
        engine.refresh_stats()
        return {"registered": info.worker_id}

    async def heartbeat(request: Request):
        b = _json(await request.body())
        wid = str(b.get("worker_id"))
        if not registry.heartbeat(wid, b.get("stats") or {}):
            return JSONResponse({"error": "unknown worker: register again"}, status_code=404)
        engine.refresh_stats()
        if not isinstance(b.get("kv_events"), dict):
            return {"ok": True}
        return {"ok": True, "kv_snapshot": _feed_index(engine.placer.index, wid, b["kv_events"])}

    async def workers(request: Request):
        return {"workers": [{"worker_id": w.worker_id, "url": w.url, "role": w.role, "alive": w.alive,
                             "kv_address": w.kv_address, "stats": w.stats} for w in registry.all()],
                "counters": engine.counters, "policy": engine.placer.name,
                "prefix_index": engine.placer.index.stats(),
                "admission": _admission_status(engine.admitter)}

    app.add_api_route("/internal/register", register, methods=["POST"])
    app.add_api_route("/internal/heartbeat", heartbeat, methods=["POST"])
    app.add_api_route("/internal/workers", workers, methods=["GET"])
    app.add_api_route("/internal/conductor", lambda: conductor_status(engine.metrics, registry), methods=["GET"])
    return app


def _mean(h) -> float | None:
    n = sum(h.counts)
    return h.sum / n if n else None


def _mean_stat(workers, key: str) -> float | None:
    vals = [float(w.stats[key]) for w in workers if (w.stats or {}).get(key)]
    return sum(vals) / len(vals) if vals else None


def conductor_status(metrics, registry: Registry) -> dict:
    """Observed mean Lin / Lout and the P:D ratio seed 000 §5.3 recommends for them.

    Theta_P / Theta_D are the means of what live workers report in their stats
    (`prefill_tokens_per_s`, `decode_tokens_per_s`); until they do, the ratio is null."""
    lin, lout = _mean(metrics.req_prompt), _mean(metrics.req_generation)
    theta_p = _mean_stat(registry.alive("prefill"), "prefill_tokens_per_s")
    theta_d = _mean_stat(registry.alive("decode"), "decode_tokens_per_s")
    ratio = None
    if None not in (lin, lout, theta_p, theta_d):
        ratio = conductor.recommended_pd_ratio(lin, lout, theta_p, theta_d)
    return {"mean_lin_tokens": lin, "mean_lout_tokens": lout, "theta_p_tokens_per_s": theta_p,
            "theta_d_tokens_per_s": theta_d, "recommended_nd_per_np": ratio,
            "num_prefill": len(registry.alive("prefill")), "num_decode": len(registry.alive("decode"))}


def _admission_status(admitter) -> dict | None:
    if admitter is None:
        return None
    return {"admitted": admitter.admitted, "rejected": dict(admitter.rejected), **vars(admitter.config),
            "kv_bandwidth_used_bytes_per_s": admitter.bandwidth_bytes_per_s,
            "kv_bandwidth_measured_bytes_per_s": admitter.transfers.bandwidth_bytes_per_s,
            "last_prediction": admitter.last}


def _feed_index(index, worker_id: str, kv: dict) -> bool:
    """Apply a heartbeat's KV events (and snapshot); True when the worker must send a snapshot."""
    try:
        epoch = str(kv["epoch"])
        index.apply_events(worker_id, epoch, kv.get("events") or [])
        snap = kv.get("snapshot")
        if isinstance(snap, dict):
            index.apply_snapshot(worker_id, epoch, int(snap["seq"]), snap.get("block_hashes") or [])
    except (KeyError, TypeError, ValueError) as e:
        raise APIError(400, f"bad kv_events: {e}") from None
    return index.needs_snapshot(worker_id)


def _json(raw: bytes) -> dict:
    try:
        b = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"invalid JSON: {e}") from None
    if not isinstance(b, dict):
        raise APIError(400, "body must be a JSON object")
    return b


class _RouterCollector:
    """Disaggregation metrics, read at scrape time from the engine's counters and the registry."""

    def __init__(self, engine: DisaggEngine, registry: Registry):
        self.engine, self.registry = engine, registry

    def describe(self):
        return []

    def collect(self):
        c = self.engine.counters
        for name, doc, key in (("kv_transfer_bytes", "KV bytes moved from prefill to decode workers.", "kv_bytes"),
                               ("kv_transfer_seconds", "Seconds from transfer start to acknowledgement.", "kv_seconds"),
                               ("kv_transfer_failed", "KV transfers that failed.", "kv_failed"),
                               ("kv_transfer_retries", "Reconnects during KV transfers.", "kv_retries"),
                               ("request_recomputed", "Requests whose prompt the decode worker recomputed.",
                                "recomputed"),
                               ("request_replaced", "Requests moved to another worker mid-decode.", "replaced"),
                               ("kv_transfer_exposed_seconds", "Transfer seconds left after the prefill ended "
                                "(what TTFT pays; layer-wise hides the rest).", "kv_exposed_seconds"),
                               ("kv_transfer_exposed_bytes", "Bytes that travelled in the exposed seconds.",
                                "kv_exposed_bytes")):
            m = CounterMetricFamily(f"pdserve:{name}", doc)
            m.add_metric([], c.get(key, 0))
            yield m
        alive = GaugeMetricFamily("pdserve:workers_alive", "Live workers by role.", labels=["role"])
        queue = GaugeMetricFamily("pdserve:worker_queue_requests", "Waiting requests per role.", labels=["role"])
        for role in ("prefill", "decode"):
            ws = self.registry.alive(role)
            alive.add_metric([role], len(ws))
            queue.add_metric([role], sum((w.stats or {}).get("num_waiting", 0) for w in ws))
        yield alive
        yield queue
        rejected = CounterMetricFamily("pdserve:router_early_rejected", "Requests refused before prefill "
                                       "(predicted SLO miss, or KV backpressure).", labels=["reason"])
        counts = self.engine.admitter.rejected if self.engine.admitter is not None else {}
        for reason in ("ttft_slo", "tpot_slo", "kv_backpressure"):
            rejected.add_metric([reason], counts.get(reason, 0))
        yield rejected
        st = conductor_status(self.engine.metrics, self.registry)
        for key, name, doc in (("mean_lin_tokens", "observed_mean_prompt_tokens", "Mean prompt tokens (Lin)."),
                               ("mean_lout_tokens", "observed_mean_generation_tokens", "Mean generated tokens (Lout)."),
                               ("recommended_nd_per_np", "recommended_pd_ratio",
                                "N_D / N_P = (Lout / Lin) x (Theta_P / Theta_D), seed 000 §5.3.")):
            if st[key] is not None:
                g = GaugeMetricFamily(f"pdserve:{name}", doc)
                g.add_metric([], st[key])
                yield g
