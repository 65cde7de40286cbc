"""Golden and unit tests of the conductor's pure decisions (router/conductor.py).

One worked number per idea: a prefix-cache hit of H_i = 0.8 leaves 20% of the
prefill to compute (placement); SLOs of TTFT < 500 ms / TPOT < 30 ms
(admission); a KV watermark of 92% above which long requests wait
(backpressure); decode-per-prefill ratios of 0.5 for long-prompt, short-answer
traffic and 32 for short-prompt, long-answer traffic (capacity); and layer-wise
KV transfer exposing only the last layer's bytes. The tests pin those, and the
behaviour each decision promises around them.
"""

import pytest

from pdserve.costmodel import DecodeCostModel, PrefillCostModel
from pdserve.router import conductor as c

# ---------------------------------------------------------------- placement


def test_placement_hit_0_8_leaves_20_percent_of_prefill():
    """A prefill worker that already caches 80% of the prompt's prefix (H_i = 0.8) has only
    the remaining 20% to compute."""
    d_prefill_s = 1.0
    assert c.prefill_score(0.8, d_prefill_s, 0.0, alpha=1.0) == pytest.approx(0.2)
    assert c.prefill_score(0.0, d_prefill_s, 0.0, alpha=1.0) == pytest.approx(1.0)


def test_placement_score_adds_alpha_times_queue():
    assert c.prefill_score(0.5, 0.4, 0.3, alpha=2.0) == pytest.approx(0.5 * 0.4 + 2.0 * 0.3)


def test_placement_cache_hit_wins_when_calm_queue_wins_at_peak():
    """Small alpha in calm periods favours prefix hits; large alpha at peak
    favours the node whose queue drains first."""
    cached_busy = c.PrefillCandidate("p0", hit_ratio=0.8, prefill_time_s=1.0, queue_drain_s=0.5)
    cold_idle = c.PrefillCandidate("p1", hit_ratio=0.0, prefill_time_s=1.0, queue_drain_s=0.0)
    calm, peak = c.adaptive_alpha(0.0), c.adaptive_alpha(1.0)
    assert calm < peak
    # calm: 0.2 + 0.5*0.5 = 0.45 < 1.0
    best, score = c.choose_prefill([cached_busy, cold_idle], calm)
    assert best.worker_id == "p0" and score == pytest.approx(0.45)
    # peak: 0.2 + 4*0.5 = 2.2 > 1.0
    best, score = c.choose_prefill([cached_busy, cold_idle], peak)
    assert best.worker_id == "p1" and score == pytest.approx(1.0)


def test_choose_prefill_ties_break_by_worker_id():
    a, b = c.PrefillCandidate("b", 0.0, 1.0, 0.0), c.PrefillCandidate("a", 0.0, 1.0, 0.0)
    assert c.choose_prefill([a, b], 1.0)[0].worker_id == "a"


def test_prefill_score_rejects_bad_hit_ratio():
    with pytest.raises(ValueError):
        c.prefill_score(1.5, 1.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        c.choose_prefill([], 1.0)


def test_adaptive_alpha_clamps_and_pool_utilisation():
    assert c.adaptive_alpha(-1.0) == 0.5 and c.adaptive_alpha(9.0) == 4.0
    assert c.adaptive_alpha(0.5, 1.0, 3.0) == pytest.approx(2.0)
    assert c.pool_utilisation([0.25, 5.0], horizon_s=0.5) == pytest.approx((0.5 + 1.0) / 2)
    assert c.pool_utilisation([], 0.5) == 0.0


# ---------------------------------------------------------------- admission

SLO_TTFT_S, SLO_TPOT_S = 0.500, 0.030  # TTFT < 500 ms, TPOT < 30 ms: interactive chat


def test_admission_predicted_ttft_over_slo_is_rejected_before_prefill():
    """A request predicted to miss its SLO gets 429 at once, with a Retry-After."""
    ttft = c.predict_ttft(queue_s=1.2, prefill_s=0.3, transfer_s=0.05)
    assert ttft == pytest.approx(1.55)
    d = c.admit(ttft, 0.020, SLO_TTFT_S, SLO_TPOT_S)
    assert not d.admitted and d.reason == "ttft_slo" and d.retry_after_s == 2  # ceil(1.05)


def test_admission_decode_tpot_over_slo_is_rejected():
    """A request predicted to break the TPOT SLO once it joins the decode batch -> 429."""
    d = c.admit(0.2, 0.045, SLO_TTFT_S, SLO_TPOT_S)
    assert not d.admitted and d.reason == "tpot_slo" and d.retry_after_s >= 1


def test_admission_within_slo_admitted_and_off_by_default():
    assert c.admit(0.45, 0.025, SLO_TTFT_S, SLO_TPOT_S) == c.ADMIT
    assert c.admit(99.0, 9.0, None, None).admitted  # no SLO set: nothing is refused
    assert c.admit(0.2, 0.001, SLO_TTFT_S, SLO_TPOT_S).retry_after_s == 0


def test_kv_watermark_92_stops_long_requests_only():
    """Above the 92% KV watermark of the decode pool, refuse new *long* requests: they would
    force preemption after their prefill was paid for; short ones still fit."""
    assert c.backpressure(0.93, is_long=True) == c.Admission(False, "kv_backpressure", 1)
    assert c.backpressure(0.93, is_long=False).admitted
    assert c.backpressure(0.92, is_long=True).admitted  # at the mark is still fine
    assert not c.backpressure(0.85, is_long=True, watermark=0.80).admitted


def test_pool_kv_usage_weights_by_blocks_and_long_request():
    assert c.pool_kv_usage([1.0, 0.0], [300, 100]) == pytest.approx(0.75)
    assert c.pool_kv_usage([], []) == 0.0
    assert c.is_long_request(3000, 1000, 4096) is False
    assert c.is_long_request(3096, 1000, 4096) is True


# ---------------------------------------------------------------- capacity


def test_capacity_summarisation_long_in_short_out_ratio_0_5():
    """Summarisation: Lin 8,000, Lout 500, Theta_P 4,000, Theta_D 500 -> N_D/N_P = 0.5."""
    assert c.recommended_pd_ratio(8000, 500, 4000, 500) == pytest.approx(0.5)


def test_capacity_reasoning_short_in_long_out_ratio_32():
    """Reasoning: Lin 1,000, Lout 4,000, same GPUs -> N_D/N_P = 32."""
    assert c.recommended_pd_ratio(1000, 4000, 4000, 500) == pytest.approx(32)


def test_recommended_pd_ratio_none_without_observations():
    assert c.recommended_pd_ratio(0, 0, 4000, 500) is None
    assert c.recommended_pd_ratio(1000, 100, 4000, 0) is None


# ---------------------------------------------------------------- decode step model, transfer


def test_layerwise_transfer_exposes_only_the_last_layer():
    """64 Ki tokens x 320 KiB (llama 70B) = 20 GiB over 45 GiB/s = 444 ms eager; layer-wise
    over 80 layers exposes 444 / 80 = 5.55 ms, more than 98% less."""
    gib = 2**30
    eager = c.predict_transfer_s(65536, 320 * 1024, 80, 45 * gib, layerwise=False)
    layerwise = c.predict_transfer_s(65536, 320 * 1024, 80, 45 * gib, layerwise=True)
    assert eager == pytest.approx(0.444, abs=1e-3)
    assert layerwise == pytest.approx(0.00555, abs=1e-5)
    assert 1 - layerwise / eager > 0.98
    assert c.predict_transfer_s(0, 320 * 1024, 80, 45 * gib, True, latency_s=0.1) == 0.0  # all cached on D
    assert c.predict_ttft(0.1, 0.2, layerwise) == pytest.approx(0.30555, abs=1e-5)
    with pytest.raises(ValueError):
        c.predict_transfer_s(1, 1, 1, 0.0, True)


def test_queue_drain_and_predicted_tpot_come_from_the_cost_models():
    prefill = PrefillCostModel(0.01, 2e-4, 3e-8)
    assert c.queue_drain_s([128, 512], prefill) == pytest.approx(prefill(128) + prefill(512))
    decode = DecodeCostModel(0.010, 0.0005, 1e-6)
    # joining a batch of 3 holding 3000 tokens with a 1000-token prompt and 200 to generate
    assert c.predict_tpot(decode, 3, 3000, 1000, 200) == pytest.approx(0.010 + 4 * 0.0005 + 4100e-6)


def test_a_prompt_short_beyond_what_the_decode_worker_holds_is_prefilled_there():
    assert c.prefill_locally(64, 0, 100)
    assert not c.prefill_locally(164, 0, 100)
    assert c.prefill_locally(164, 128, 100)  # the decode worker holds the first 128 tokens
    assert not c.prefill_locally(1, 0, 0)  # off
