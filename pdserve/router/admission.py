"""Predictive early rejection and KV backpressure at the router (seed 000 §5.2).

Runs when a request arrives, before any worker sees it: a refused request
costs no prefill. The decisions are conductor.admit / conductor.backpressure;
this file only gathers their inputs from the registry and the placer.

TTFT = the queue and prefill time of the prefill worker cache_aware would pick
(the placer's bookings and D_prefill) + a fixed exposed transfer time. TPOT is
predicted only for decode workers that report a calibrated step model
(stats "decode_cost_s": [base, per_seq, per_kv_token]); without one there is
nothing honest to predict, so the TPOT SLO is not checked for that worker.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pdserve.router import conductor, policy
from pdserve.router.placement import Placer, candidate
from pdserve.router.registry import Registry


@dataclass
class AdmissionConfig:
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    kv_watermark: float | None = None  # decode pool KV usage above which long requests are refused
    long_request_tokens: int = 1024    # prompt + max_tokens at or above this is "long"
    transfer_s: float = 0.0            # exposed KV transfer per request (layerwise hides the rest)

    def __post_init__(self):
        if self.kv_watermark is not None and not 0.0 < self.kv_watermark <= 1.0:
            raise ValueError("kv_watermark must be in (0, 1]")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive")

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.slo_ttft_s, self.slo_tpot_s, self.kv_watermark))


class Admitter:
    def __init__(self, config: AdmissionConfig):
        self.config = config
        self.rejected: Counter[str] = Counter()  # by reason, for /metrics
        self.admitted = 0

    def check(self, registry: Registry, placer: Placer, prompt: list[int], max_tokens: int) -> conductor.Admission:
        cfg = self.config
        decision = self._backpressure(registry, len(prompt), max_tokens) if cfg.kv_watermark is not None \
            else conductor.ADMIT
        if decision.admitted and (cfg.slo_ttft_s is not None or cfg.slo_tpot_s is not None):
            decision = self._predict(registry, placer, prompt, max_tokens)
        if decision.admitted:
            self.admitted += 1
        else:
            self.rejected[decision.reason] += 1
        return decision

    def _backpressure(self, registry: Registry, prompt_tokens: int, max_tokens: int) -> conductor.Admission:
        ds = registry.alive("decode")
        usage = conductor.pool_kv_usage([float((w.stats or {}).get("kv_usage", 0.0)) for w in ds],
                                        [int((w.stats or {}).get("num_blocks", 0)) for w in ds])
        is_long = conductor.is_long_request(prompt_tokens, max_tokens, self.config.long_request_tokens)
        return conductor.backpressure(usage, is_long=is_long, watermark=self.config.kv_watermark)

    def _predict(self, registry: Registry, placer: Placer, prompt: list[int], max_tokens: int) -> conductor.Admission:
        best = placer.peek_prefill(registry, prompt)
        ttft_s = 0.0 if best is None else conductor.predict_ttft(
            best.queue_drain_s, (1 - best.hit_ratio) * best.prefill_time_s, self.config.transfer_s)
        tpot_s = 0.0
        ds = registry.alive("decode")
        ds = [w for w in ds if w.role == "decode"] or ds
        if ds:
            d_id = policy.most_kv_headroom([candidate(w) for w in ds]).worker_id
            s = next(w for w in ds if w.worker_id == d_id).stats or {}
            if s.get("decode_cost_s"):
                model = conductor.DecodeCostModel(*map(float, s["decode_cost_s"]))
                context = int(float(s.get("kv_usage", 0.0)) * int(s.get("num_blocks", 0))
                              * int(s.get("kv_block_size", 0)))
                tpot_s = conductor.predict_tpot(model, int(s.get("num_running", 0)), context, len(prompt), max_tokens)
        return conductor.admit(ttft_s, tpot_s, self.config.slo_ttft_s, self.config.slo_tpot_s)
