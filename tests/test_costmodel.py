"""The cost models (pdserve/costmodel.py): fits that recover the model they were sampled from,
fall back without a negative term, and rescale to live steps by the bounded median ratio."""

import numpy as np
import pytest

from pdserve.costmodel import (
    DecodeCostModel,
    PrefillCostModel,
    fit_decode_cost,
    fit_prefill_cost,
    nonnegative_lstsq,
)


def test_fit_prefill_cost_recovers_quadratic():
    truth = PrefillCostModel(0.01, 2e-4, 3e-8)
    samples = [(n, truth(n)) for n in (16, 128, 512, 1024, 2048)]
    fit = fit_prefill_cost(samples)
    assert fit.a_s == pytest.approx(0.01, rel=1e-6)
    assert fit.b_s_per_token == pytest.approx(2e-4, rel=1e-6)
    assert fit.c_s_per_token2 == pytest.approx(3e-8, rel=1e-6)


def test_fit_prefill_cost_degrades_gracefully():
    # one length: a constant; two: a line; a concave cloud must not get a negative L^2 term
    assert fit_prefill_cost([(100, 0.5), (100, 0.7)])(5000) == pytest.approx(0.6)
    line = fit_prefill_cost([(100, 0.1), (200, 0.2)])
    assert line(400) == pytest.approx(0.4) and line.c_s_per_token2 == 0.0
    concave = fit_prefill_cost([(100, 0.10), (200, 0.19), (400, 0.30), (800, 0.40)])
    assert concave.c_s_per_token2 >= 0 and concave.b_s_per_token >= 0
    assert concave(1600) > concave(800)
    with pytest.raises(ValueError):
        fit_prefill_cost([])


def test_fit_decode_cost_recovers_the_step_model():
    truth = DecodeCostModel(0.010, 0.0005, 1e-6)
    samples = [(b, ctx, truth.step_s(b, ctx)) for b, ctx in ((1, 100), (4, 2000), (8, 9000), (16, 4000))]
    fit = fit_decode_cost(samples)
    assert fit.base_s == pytest.approx(0.010) and fit.per_kv_token_s == pytest.approx(1e-6)
    assert fit.per_seq_s == pytest.approx(0.0005)


def test_fit_decode_cost_drops_a_negative_term_and_refits():
    # steps that do not grow with context: a noisy negative per-token term is dropped,
    # and base / per-sequence refitted without it (not clipped around it)
    samples = [(1, 100, 0.011), (8, 100, 0.018), (1, 2000, 0.0109), (8, 2000, 0.0179), (4, 800, 0.014)]
    fit = fit_decode_cost(samples)
    assert fit.per_kv_token_s == 0.0
    assert fit.base_s == pytest.approx(0.010, abs=3e-4) and fit.per_seq_s == pytest.approx(0.001, abs=1e-4)
    with pytest.raises(ValueError):
        fit_decode_cost(samples[:2])


def test_live_scale_is_the_median_ratio_bounded():
    m = DecodeCostModel(0.010, 0.001, 0.0)
    assert m.live_scale([]) == 1.0
    live = [(1, 10, 0.022), (1, 10, 0.033), (1, 10, 0.5)]  # 2x, 3x and one stalled step
    assert m.live_scale(live) == pytest.approx(3.0)
    assert m.live_scale([(1, 10, 10.0)]) == 8.0 and m.live_scale([(1, 10, 1e-6)]) == 0.25
    assert m.scaled(2.0).step_s(3, 0) == pytest.approx(0.026)


def test_decode_tokens_per_s_is_batch_over_step():
    m = DecodeCostModel(0.020, 0.001, 1e-6)
    # 32 sequences of 512 tokens: 20 + 32 + 16.384 ms per step
    assert m.tokens_per_s(32, 512) == pytest.approx(32 / 0.068384)


def test_prefill_step_and_live_prefill_scale():
    m = PrefillCostModel(0.01, 1e-3, 1e-6)
    # a whole 100-token prompt in one step is D_prefill(100); in two chunks the parts add up
    assert m.step_s([(0, 100)]) == pytest.approx(m(100))
    assert m.step_s([(0, 60)]) + m.step_s([(60, 40)]) - m.a_s == pytest.approx(m(100))
    assert m.live_scale([]) == 1.0
    live = [
        ([(0, 100)], 2 * m(100)),
        ([(0, 50), (10, 1)], 2.5 * m.step_s([(0, 50), (10, 1)])),
        ([(0, 10)], 0.5 * m(10)),
    ]
    assert m.live_scale(live) == pytest.approx(2.0)


def test_models_travel_in_heartbeat_stats_as_their_terms():
    p, d = PrefillCostModel(0.01, 1e-3, 1e-6), DecodeCostModel(0.02, 0.001, 1e-6)
    stats = {p.STATS_KEY: p.terms(), d.STATS_KEY: d.terms()}
    assert stats == {"prefill_cost_s": [0.01, 1e-3, 1e-6], "decode_cost_s": [0.02, 0.001, 1e-6]}
    assert PrefillCostModel.from_stats(stats) == p and DecodeCostModel.from_stats(stats) == d
    assert PrefillCostModel.from_stats({}) is None and DecodeCostModel.from_stats(None) is None
    assert p.tokens_per_s(100) == pytest.approx(100 / p(100)) and PrefillCostModel().tokens_per_s(10) is None


def test_nonnegative_lstsq_drops_the_most_negative_term_first():
    x = np.array([[1.0, 1.0, 0.0], [1.0, 2.0, 0.0], [1.0, 3.0, 0.0]])
    assert nonnegative_lstsq(x, np.array([3.0, 5.0, 7.0])) == pytest.approx([1.0, 2.0, 0.0])
    # falling with x: the slope is dropped and the mean kept
    assert nonnegative_lstsq(x, np.array([3.0, 2.0, 1.0])) == pytest.approx([2.0, 0.0, 0.0])
    assert nonnegative_lstsq(x[:, 1:], np.array([-1.0, -2.0, -3.0])) == pytest.approx([0.0, 0.0])
