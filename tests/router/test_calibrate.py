"""Start-up prefill calibration on a real (tiny) engine, and what a cluster's router sees of it."""
from pdserve.server.calibrate import calibration_stats, measure_prefill


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
