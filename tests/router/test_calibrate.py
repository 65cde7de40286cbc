"""Start-up prefill calibration on a real (tiny) engine, and what a cluster's router sees of it."""

import pytest

from pdserve import SamplingParams
from pdserve.costmodel import fit_decode_cost
from pdserve.server.calibrate import (
    DecodeStepRecorder,
    calibration_stats,
    decode_stats,
    measure_decode,
    measure_prefill,
    prefill_stats,
)


def test_measure_prefill_on_tiny_engine_leaves_cache_empty(tiny_llm):
    engine = tiny_llm.engine
    engine.block_manager.record_events = True
    samples = measure_prefill(engine, lengths_tokens=(8, 32, 64), repeats=2)
    assert [n for n, _ in samples] == [8, 32, 64] and all(s > 0 for _, s in samples)
    assert not engine.block_manager.cached and not engine.block_manager.drain_events()
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.stats.queries_tokens == 0  # calibration is not traffic
    st = calibration_stats(samples)
    assert len(st["prefill_cost_s"]) == 3 and st["prefill_tokens_per_s"] > 0


def test_decode_recorder_times_only_pure_decode_steps(tiny_llm):
    engine = tiny_llm.engine
    rec = DecodeStepRecorder(engine)
    engine.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.add_request("b", list(range(40, 50)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # one prefill step (both prompts), then three steps of two one-token decodes
    assert [(b, ctx) for b, ctx, _ in rec.recent()] == [(2, 29 + 1 + 10 + 1), (2, 43), (2, 45)]
    assert all(s > 0 for *_, s in rec.recent())
    assert [chunks for chunks, _ in rec.prefill_samples] == [[(0, 29), (0, 10)]]


def test_prefill_stats_rescale_the_calibration():
    cal = {"prefill_cost_s": [0.0, 1e-3, 0.0], "prefill_tokens_per_s": 1000.0}
    assert prefill_stats({}, []) == {}
    st = prefill_stats(cal, [([(0, 100)], 0.3)])  # three times slower than calibrated
    assert st["prefill_live_scale"] == pytest.approx(3.0) and st["prefill_cost_s"][1] == pytest.approx(3e-3)
    assert st["prefill_tokens_per_s"] == pytest.approx(1000.0 / 3)


def test_measure_decode_on_tiny_engine_fits_and_leaves_cache_empty(tiny_llm):
    engine = tiny_llm.engine
    engine.block_manager.record_events = True
    rec = DecodeStepRecorder(engine)
    samples = measure_decode(engine, rec, steps=3)
    # five points, shrunk to the 64 x 4-token pool where they do not fit
    assert [b for b, _, _ in samples] == [1, 8, 1, 8, 4] and all(s > 0 for *_, s in samples)
    assert all(ctx <= 64 * 4 for _, ctx, _ in samples)  # the whole batch fits the pool
    assert not engine.block_manager.cached and not engine.block_manager.drain_events()
    assert not engine.has_unfinished_requests() and not rec.recent()
    assert engine.block_manager.stats.queries_tokens == 0
    st = decode_stats(fit_decode_cost(samples), [], max_num_seqs=8)
    assert len(st["decode_cost_s"]) == 3 and st["decode_tokens_per_s"] > 0 and st["decode_live_scale"] == 1.0
