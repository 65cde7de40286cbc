"""The event loop and the latency models (no engine, no cluster)."""

import numpy as np
import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.step_trace import step_rows
from pdserve.planner import perf
from pdserve.planner.hardware import resolve_gpu
from pdserve.planner.models import resolve_model
from pdserve.planner.roofline import decode_step_time, prefill_time
from pdserve.sim.calibrate import _shape
from pdserve.sim.events import EventLoop
from pdserve.sim.latency import (
    FittedLatency,
    ProfileLatency,
    RooflineLatency,
    StepShape,
    TransferModel,
    chunk_attention,
    network_bytes_per_s,
    roofline_for,
)


def test_events_run_in_time_order_and_ties_in_schedule_order():
    loop, seen = EventLoop(), []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")
    loop.at(0.5, lambda: loop.after(1.0, seen.append, "a2"))  # at 1.5, scheduled from inside an event
    assert loop.run() == 2.0
    assert seen == ["a", "b", "a2", "c"]
    assert loop.num_events == 5


def test_events_refuse_the_past_and_stop_at_until():
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.at(5.0, lambda: None)
    assert loop.run(until_s=2.0) == 2.0 and len(loop) == 1
    with pytest.raises(ValueError):
        loop.at(1.5, lambda: None)


def _dep_roofline(tp=8):
    return roofline_for(resolve_model("llama-3-70b"), resolve_gpu("h100"), tp, efficiency=(1.0, 1.0))


def test_roofline_pure_batches_match_the_planner():
    lat = _dep_roofline()
    for s in (512, 4096, 16000):
        shape = StepShape(prefill_tokens=s, prefill_seqs=1, prefill_attention=chunk_attention(0, s))
        assert lat.step_s(shape) == pytest.approx(prefill_time(lat.dep, s).total_s, rel=2e-3)
    for b, c in ((1, 1024), (32, 4096), (128, 512)):
        shape = StepShape(decode_seqs=b, decode_context=b * c)
        assert lat.step_s(shape) == pytest.approx(decode_step_time(lat.dep, b, c).total_s, rel=2e-3)


def test_roofline_efficiency_slows_steps_and_tp_speeds_prefill():
    fast, slow = _dep_roofline(), roofline_for(resolve_model("llama-3-70b"), resolve_gpu("h100"), 8)
    shape = StepShape(prefill_tokens=8192, prefill_seqs=1, prefill_attention=chunk_attention(0, 8192))
    assert slow.step_s(shape) > fast.step_s(shape)
    assert _dep_roofline(tp=2).step_s(shape) > 2 * fast.step_s(shape)


def test_simulator_prices_steps_with_the_planners_fitted_model():
    """One model, two users: a default pool's step is perf.step_time, whatever the batch mix."""
    lat = roofline_for(resolve_model("llama-3-70b"), resolve_gpu("h100"), 4)
    assert isinstance(lat, FittedLatency)
    shapes = [
        StepShape(prefill_tokens=512, prefill_seqs=1, prefill_attention=chunk_attention(0, 512)),
        StepShape(decode_seqs=16, decode_context=16 * 900),
        StepShape(
            prefill_tokens=256,
            prefill_seqs=1,
            prefill_attention=chunk_attention(300, 256),
            prefill_context=300,
            decode_seqs=7,
            decode_context=7000,
        ),
        StepShape(prefill_tokens=64, prefill_seqs=1, prefill_attention=chunk_attention(64, 64), prefill_context=64),
    ]
    for s in shapes:
        want = perf.step_time(
            lat.dep,
            s.prefill_tokens,
            s.prefill_attention,
            s.decode_seqs,
            s.decode_context,
            s.prefill_seqs,
            s.prefill_context,
        ).total_s
        assert lat.step_s(s) == pytest.approx(want, rel=1e-12)
        assert lat.step_s(s) > _dep_roofline(4).step_s(s)  # the roofline stays a lower bound
    assert isinstance(roofline_for(resolve_model("llama-3-8b"), resolve_gpu("cpu")), RooflineLatency)
    assert network_bytes_per_s(400) == 45e9 and network_bytes_per_s(10) == pytest.approx(1.125e9)


@pytest.mark.parametrize("model", ["roofline", "fitted", "profile"])
def test_vectorised_decode_steps_equal_single_steps(model):
    lat = {
        "roofline": _dep_roofline,
        "fitted": lambda: roofline_for(resolve_model("llama-3-70b"), resolve_gpu("h100"), 8),
        "profile": lambda: ProfileLatency([0.01, 1e-4, 2e-4, 3e-7, 1e-9]),
    }[model]()
    got = lat.decode_steps_s(24, 24 * 700, 50)
    want = [lat.step_s(StepShape(decode_seqs=24, decode_context=24 * 700 + i * 24)) for i in range(50)]
    assert np.allclose(got, want, rtol=1e-12)


def test_profile_fit_recovers_coefficients_and_drops_negative_terms(tmp_path):
    truth = ProfileLatency([0.004, 2e-4, 1e-3, 5e-7, 3e-9, 0.05])
    shapes = [
        StepShape(
            prefill_tokens=p,
            prefill_seqs=1 if p else 0,
            prefill_attention=chunk_attention(0, p),
            decode_seqs=b,
            decode_context=b * c,
        )
        for p in (0, 64, 512, 2048)
        for b in (0, 1, 8, 16)
        for c in (64, 512)
        if p or b
    ]
    fit = ProfileLatency.fit([(s, truth.step_s(s)) for s in shapes])
    assert np.allclose(fit.coef, truth.coef, rtol=1e-6, atol=1e-12)
    # a term that only adds noise and comes out negative is dropped, never kept below zero
    noisy = [(s, truth.step_s(s) - 1e-5 * s.decode_context / 1000) for s in shapes]
    assert min(ProfileLatency.fit(noisy).coef) >= 0.0
    path = tmp_path / "p.json"
    fit.save(str(path))
    again = ProfileLatency.load(str(path))
    assert again.coef == pytest.approx(fit.coef) and len(again.samples) == len(shapes)


def test_profile_prefill_steps_pay_their_own_fixed_cost_and_old_profiles_load():
    lat = ProfileLatency([0.01, 1e-3, 2e-3, 0.0, 0.0, 0.1])
    assert lat.step_s(StepShape(decode_seqs=1)) == pytest.approx(0.012)
    assert lat.step_s(StepShape(prefill_tokens=32, prefill_seqs=1)) == pytest.approx(0.01 + 0.032 + 0.1)
    assert ProfileLatency([0.01, 1e-3, 2e-3, 0.0, 0.0]).coef[-1] == 0.0  # a five-term profile


def test_kv_transfer_layerwise_hides_all_but_the_last_layer():
    """64K tokens x 320 KiB = 20 GiB; at 45 GB/s eager costs ~477 ms, layer-wise
    leaves one layer of 80 (~6 ms) exposed when a layer computes longer than it transfers."""
    kv_bytes = 65536 * 327680
    eager = TransferModel(45e9, layerwise=False).exposed_s(kv_bytes, 80, prefill_s=20.0)
    lw = TransferModel(45e9, layerwise=True).exposed_s(kv_bytes, 80, prefill_s=20.0)
    assert eager[1] == pytest.approx(kv_bytes / 45e9) == pytest.approx(0.477, abs=1e-3)
    assert lw[1] == pytest.approx(kv_bytes / 45e9 / 80)
    # a link slower than the compute falls behind by the difference every layer
    slow = TransferModel(1e9, layerwise=True).exposed_s(kv_bytes, 80, prefill_s=1.0)[1]
    assert slow == pytest.approx(kv_bytes / 1e9 - 1.0 + 1.0 / 80)


def test_calibration_reads_the_step_shape_from_the_step_rows():
    dec = Sequence("d", [1] * 100, SamplingParams(max_tokens=8))
    dec.output_token_ids = [5]
    chunk = Sequence("c", [2] * 1000, SamplingParams(max_tokens=1))
    dec.num_computed_tokens, chunk.num_computed_tokens = 101, 512  # after one engine step
    rows = step_rows(SchedulerOutput([ScheduledSeq(dec, 1), ScheduledSeq(chunk, 256)]))
    assert rows == [[100, 1, 1], [256, 256, 0]]
    s = _shape(rows)
    assert (s.decode_seqs, s.decode_context) == (1, 100)
    assert (s.prefill_tokens, s.prefill_seqs, s.prefill_context) == (256, 1, 256)
    assert s.prefill_attention == chunk_attention(256, 256)


def test_profile_fit_is_unbiased_when_steps_are_noisy():
    """Served steps scatter by +-20% around their mean; weighing rows by 1/measured favoured the
    fast ones (about -3% here); weighing by 1/predicted prices the sum of the steps right."""
    rng = np.random.default_rng(7)
    truth = ProfileLatency([0.01, 2e-3, 6e-3, 5e-6, 0.0, 0.1])
    shapes = [
        StepShape(prefill_tokens=p, prefill_seqs=1 if p else 0, decode_seqs=b, decode_context=b * 100)
        for p in (0, 0, 0, 64, 512)
        for b in range(1, 9)
    ] * 60
    measured = [(s, truth.step_s(s) * rng.uniform(0.8, 1.2)) for s in shapes]
    fit = ProfileLatency.fit(measured)
    total = sum(t for _, t in measured)
    assert sum(fit.step_s(s) for s, _ in measured) / total == pytest.approx(1.0, abs=0.01)
    decode = [(s, t) for s, t in measured if not s.prefill_tokens]
    assert sum(fit.step_s(s) for s, _ in decode) / sum(t for _, t in decode) == pytest.approx(1.0, abs=0.015)


def test_profile_prices_each_pass_of_a_small_decode_batch_over_the_weights():
    """Kernels that stream the weights once per 4 rows up to 16 rows, and multiply the dense
    weights beyond: a step of few rows is a staircase in its rows (the g term), a bigger one pays
    h once; both fitted back from steps, and the fast path's decode_steps_s agrees with step_s."""
    truth = ProfileLatency([0.005, 2e-3, 4e-3, 5e-6, 0.0, 0.1, 0.008, 0.05], row_tile=4, tile_max_rows=16)
    one = [truth.step_s(StepShape(decode_seqs=b, decode_context=100 * b)) for b in range(1, 10)]
    steps = np.diff(one)
    assert steps[3] == pytest.approx(steps[2] + 0.008)  # 4 -> 5 sequences: a second pass
    assert truth.weight_passes(17) == 0 and truth.weight_passes(16) == 4  # beyond the tiles: no staircase
    assert truth.dense(17) == 1 and truth.dense(16) == 0
    # an 8-token prompt beside 3 decodes is 11 rows: the prompt path, on the tiled kernels (3 passes)
    assert truth.step_s(StepShape(prefill_tokens=8, prefill_seqs=1, decode_seqs=3)) == pytest.approx(
        0.005 + 0.016 + 0.012 + 0.1 + 3 * 0.008
    )
    # 64 tokens: the dense weights
    assert truth.step_s(StepShape(prefill_tokens=64, prefill_seqs=1)) == pytest.approx(0.005 + 0.128 + 0.1 + 0.05)
    shapes = [
        StepShape(prefill_tokens=p, prefill_seqs=1 if p else 0, decode_seqs=b, decode_context=b * c)
        for p in (0, 8, 64, 256)
        for b in range(1, 13)
        for c in (64, 512)
    ]
    fit = ProfileLatency.fit([(s, truth.step_s(s)) for s in shapes], row_tile=4, tile_max_rows=16)
    assert np.allclose(fit.coef, truth.coef, rtol=1e-6, atol=1e-12)
    got = fit.decode_steps_s(6, 600, 5)
    assert np.allclose(got, [fit.step_s(StepShape(decode_seqs=6, decode_context=600 + 6 * i)) for i in range(5)])


def test_profile_fit_leaves_out_steps_a_busy_machine_slowed():
    """A few steps of a calibration on a shared machine took 5-10x their time (another process
    had the CPU): least squares followed them and priced every prefill step 0.45 s high. The
    slowest, up to a tenth of the steps, are left out when they ran > 2x their fit."""
    truth = ProfileLatency([0.004, 2e-4, 1e-3, 5e-7, 0.0, 0.05])
    shapes = [
        StepShape(prefill_tokens=p, prefill_seqs=1 if p else 0, decode_seqs=b, decode_context=b * c)
        for p in (0, 64, 512, 1024)
        for b in (0, 1, 4, 8)
        for c in (64, 512)
        if p or b
    ] * 2
    measured = [(s, truth.step_s(s)) for s in shapes]
    for i in (3, 17, 31):  # three prefill-heavy steps, descheduled for seconds
        measured[i] = (measured[i][0], measured[i][1] * 8 + 2.0)
    fit = ProfileLatency.fit(measured)
    assert fit.num_slow_dropped == 3
    assert np.allclose(fit.coef, truth.coef, rtol=1e-6, atol=1e-9)
    # beyond a tenth of the steps it is the machine, not noise: they stay, and the fit shows it
    crowded = [(s, t * (5 if i % 4 == 0 else 1)) for i, (s, t) in enumerate(measured)]
    assert ProfileLatency.fit(crowded).num_slow_dropped == len(crowded) // 10
