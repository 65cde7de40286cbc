"""The fitted step-time terms that are structure, not constants (perf.py), and the
simulator pricing steps with the very same model (sim/latency.FittedLatency)."""

import random

import pytest

from pdserve.planner import fitted, perf
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import resolve_gpu
from pdserve.planner.models import resolve_model
from pdserve.sim.latency import FittedLatency, StepShape

MODEL = resolve_model("llama-2-70b")


def _dep(gpu="a100-80gb", tp=8, engine="vidur"):
    return Deployment(MODEL, resolve_gpu(gpu), tp=tp, engine=engine)


def test_pairs_against_a_cache_cost_less_than_causal_pairs_of_the_chunk():
    dep = _dep()
    n, ctx = 512, 4096
    pairs = n * (ctx + (n + 1) / 2)
    dense = perf.step_time(dep, n, pairs, prefill_seqs=1, prefill_context=ctx, prefill_cached_pairs=n * ctx)
    all_causal = perf.step_time(dep, n, pairs, prefill_seqs=1, prefill_context=ctx)
    assert dense.attention_s < all_causal.attention_s
    assert dense.gemm_s == all_causal.gemm_s


def test_h100_prefill_attention_runs_at_flash_attention_2s_share_of_peak():
    a100, h100 = (fitted.FITS[k]["attention"] for k in ("a100", "h100"))
    for key in ("causal_eff", "cached_eff"):
        assert h100["prefill"][key] == pytest.approx(a100["prefill"][key] * 0.35 / 0.73, abs=1e-3)
    assert h100["decode"] == a100["decode"]


def test_an_overlapping_engine_pays_the_larger_of_gpu_and_kernel_issue():
    e = fitted.ENGINES["vllm-2023-overlap"]["a100"]
    for tp, batch in ((2, 64), (8, 1)):
        c = perf.decode_cost(_dep(tp=tp, engine="vllm-2023-overlap"), batch, 576)
        base = perf.decode_cost(_dep(tp=tp), batch, 576)
        assert c.launch_s == pytest.approx(e["launch_per_layer_s"] * MODEL.layers)
        assert c.gpu_s == base.gpu_s
        sync = base.overhead_s + e["per_seq_s"] * batch
        assert c.total_s == pytest.approx(sync + max(c.gpu_s, c.launch_s))
    # TP 2 is GPU-bound, TP 8 issue-bound: the window shows only at TP 8
    assert perf.decode_cost(_dep(tp=2, engine="vllm-2023-overlap"), 1, 576).gpu_s > c.launch_s
    assert c.launch_s > c.gpu_s


@pytest.mark.parametrize("engine", ["vidur", "vllm-2023", "vllm-2023-overlap"])
@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-sxm"])
def test_the_simulator_prices_mixed_steps_with_the_planner_model(engine, gpu):
    dep = _dep(gpu, 4, engine)
    lat = FittedLatency(dep)
    rng = random.Random(7)
    for _ in range(100):
        s = StepShape()
        for _ in range(rng.randint(1, 6)):
            decode = rng.random() < 0.6
            s.add(rng.randint(0, 3000), 1 if decode else rng.randint(1, 600), decode)
        ref = perf.step_time(
            dep,
            s.prefill_tokens,
            s.prefill_attention,
            s.decode_seqs,
            s.decode_context,
            s.prefill_seqs,
            s.prefill_context,
            s.prefill_cached_pairs,
        )
        assert lat.step_s(s) == pytest.approx(ref.total_s, rel=1e-12)


@pytest.mark.parametrize("engine", ["vidur", "vllm-2023-overlap"])
def test_the_simulators_decode_run_is_its_steps_one_by_one(engine):
    # TP 4 at batch 64 on A100 crosses from issue-bound to GPU-bound as the context grows
    lat = FittedLatency(_dep(tp=4, engine=engine))
    run = lat.decode_steps_s(64, 600 * 64, 6400)  # contexts summed over the batch
    one_by_one = [lat.step_s(StepShape(decode_seqs=64, decode_context=600 * 64 + 64 * i)) for i in range(6400)]
    assert run == pytest.approx(one_by_one, rel=1e-12)
    if engine != "vidur":
        c0, c1 = (perf.decode_cost(lat.dep, 64, ctx) for ctx in (600, 600 + 6399))
        assert c0.gpu_s < c0.launch_s < c1.gpu_s
