"""Predictive early rejection and KV backpressure at the router.

Runs when a request arrives, before any worker sees it: a refused request
costs no prefill. The decisions are conductor.admit / conductor.backpressure;
this file only gathers their inputs from the registry and the placer.

TTFT = queue + prefill on the prefill worker cache_aware would pick (the
placer's bookings and D_prefill) + the KV's exposed transfer: the bytes of the
prompt tokens the decode worker does not cache, over the configured bandwidth
(or the one measured from past transfers), all of them in eager mode, one
layer's share in layer-wise mode.

TPOT = one decode step of the decode worker the placer would pick, once this
request joins its batch, on the step model that worker calibrated
(stats "decode_cost_s": [base, per_seq, per_kv_token], rescaled by its live
steps); its batch is the longer of the heartbeat's and the router's bookings.
Without a step model there is nothing honest to predict, so the TPOT SLO is
not checked for that worker.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from pdserve.costmodel import DecodeCostModel
from pdserve.kv.hashing import ROOT_HASH, block_hashes
from pdserve.router import conductor
from pdserve.router.placement import Placer
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.settings import SLOConfig

# until a transfer has been measured and none is configured: a 10 Gbit/s link
DEFAULT_KV_BANDWIDTH_BYTES_PER_S = 10e9 / 8


@dataclass
class AdmissionConfig:
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    kv_watermark: float | None = None  # decode pool KV usage above which long requests are refused
    long_request_tokens: int = SLOConfig.long_request_tokens  # prompt + max_tokens at or above this is "long"
    transfer_s: float = 0.0  # fixed exposed transfer latency per request, on top of the bytes
    kv_bandwidth_bytes_per_s: float | None = None  # None: measured from transfers

    def __post_init__(self):
        if self.kv_watermark is not None and not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError("kv_watermark must be in (0, 1]")
        for name in ("slo_ttft_s", "slo_tpot_s", "kv_bandwidth_bytes_per_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.slo_ttft_s, self.slo_tpot_s, self.kv_watermark))


class TransferObserver:
    """Effective bandwidth of the exposed part of recent KV transfers (bytes / seconds
    that lay between the prefill's end and the decode side's acknowledgement)."""

    def __init__(self, window: int = 64):
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)

    def observe(self, exposed_bytes: float, exposed_s: float) -> None:
        if exposed_bytes > 0 and exposed_s > 0:
            self._recent.append((exposed_bytes, exposed_s))

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        secs = sum(s for _, s in self._recent)
        return sum(b for b, _ in self._recent) / secs if secs > 0 else None


class Admitter:
    def __init__(self, config: AdmissionConfig, transfers: TransferObserver | None = None):
        self.config = config
        self.transfers = transfers or TransferObserver()
        self.rejected: Counter[str] = Counter()  # by reason, for /metrics
        self.admitted = 0
        self.last: dict = {}  # the last prediction, for the status endpoint

    def check(
        self, registry: Registry, placer: Placer, prompt: list[int], max_tokens: int, root: int = ROOT_HASH
    ) -> conductor.Admission:
        """Admit or refuse a prompt; `root`: its hash chain's start (its cache salt's)."""
        cfg = self.config
        decision = (
            self._backpressure(registry, len(prompt), max_tokens) if cfg.kv_watermark is not None else conductor.ADMIT
        )
        if decision.admitted and (cfg.slo_ttft_s is not None or cfg.slo_tpot_s is not None):
            decision = self._predict(registry, placer, prompt, max_tokens, root)
        if decision.admitted:
            self.admitted += 1
        else:
            self.rejected[decision.reason] += 1
        return decision

    def _backpressure(self, registry: Registry, prompt_tokens: int, max_tokens: int) -> conductor.Admission:
        ds = registry.alive("decode")
        usage = conductor.pool_kv_usage(
            [float((w.stats or {}).get("kv_usage", 0.0)) for w in ds],
            [int((w.stats or {}).get("num_blocks", 0)) for w in ds],
        )
        is_long = conductor.is_long_request(prompt_tokens, max_tokens, self.config.long_request_tokens)
        return conductor.backpressure(usage, is_long=is_long, watermark=self.config.kv_watermark)

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return (
            self.config.kv_bandwidth_bytes_per_s
            or self.transfers.bandwidth_bytes_per_s
            or DEFAULT_KV_BANDWIDTH_BYTES_PER_S
        )

    def _predict(
        self, registry: Registry, placer: Placer, prompt: list[int], max_tokens: int, root: int
    ) -> conductor.Admission:
        best = placer.peek_prefill(registry, prompt, root)
        d = placer.pick_decode(registry)
        transfer_s = 0.0
        if best is not None and d is not None:
            transfer_s = self.predict_transfer_s(registry.get(best.worker_id), d, placer, prompt, root)
        ttft_s = (
            0.0
            if best is None
            else conductor.predict_ttft(best.queue_drain_s, (1 - best.hit_ratio) * best.prefill_time_s, transfer_s)
        )
        tpot_s = 0.0 if d is None else self.predict_tpot_s(d, placer, len(prompt), max_tokens)
        self.last = {
            "ttft_s": ttft_s,
            "transfer_s": transfer_s,
            "tpot_s": tpot_s,
            "prefill": best.worker_id if best else None,
            "decode": d.worker_id if d else None,
        }
        return conductor.admit(ttft_s, tpot_s, self.config.slo_ttft_s, self.config.slo_tpot_s)

    def predict_transfer_s(
        self, p: WorkerInfo | None, d: WorkerInfo, placer: Placer, prompt: list[int], root: int = ROOT_HASH
    ) -> float:
        """Exposed transfer of the prompt tokens `d` does not already cache."""
        ps = (p.stats if p is not None else None) or {}
        per_token = float(ps.get("kv_bytes_per_token", 0))
        if per_token <= 0:
            return self.config.transfer_s  # a worker that does not say: only the fixed part
        bs = int((d.stats or {}).get("kv_block_size", 0))
        cached = (
            placer.index.hit_ratio(d.worker_id, block_hashes(prompt, bs, root=root), bs, len(prompt)) if bs else 0.0
        )
        return conductor.predict_transfer_s(
            (1 - cached) * len(prompt),
            per_token,
            int(ps.get("num_layers", 1)),
            self.bandwidth_bytes_per_s,
            bool(ps.get("kv_layerwise", True)),
            latency_s=self.config.transfer_s,
        )

    @staticmethod
    def predict_tpot_s(d: WorkerInfo, placer: Placer, prompt_tokens: int, max_tokens: int) -> float:
        model = DecodeCostModel.from_stats(d.stats)
        if model is None:
            return 0.0
        num_running, context = placer.decode_load(d)
        return conductor.predict_tpot(model, num_running, int(context), prompt_tokens, max_tokens)
