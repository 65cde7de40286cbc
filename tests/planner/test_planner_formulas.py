"""The planner's formulas beyond the worked examples' numbers: edge cases,
rounding, and checks against brute force or measurements on this machine."""

import random
from dataclasses import replace

import pytest

from pdserve.planner import memory as mem
from pdserve.planner import roofline as rl
from pdserve.planner.capacity import gpu_count, max_batch_within
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import GPUS
from pdserve.planner.models import MODELS, param_count
from pdserve.planner.transfer import exposed_transfer_s


def _pipeline_finish(layers: int, t_compute: float, t_transfer: float) -> float:
    """Brute force: when the last layer's KV lands, if layer i may leave as
    soon as it is computed and the link carries one layer at a time."""
    link_free = 0.0
    for i in range(layers):
        start = max((i + 1) * t_compute, link_free)
        link_free = start + t_transfer
    return link_free


def test_layerwise_exposure_matches_brute_force_schedule():
    rng = random.Random(0)
    for _ in range(200):
        layers = rng.randint(1, 100)
        tc, tx = rng.uniform(1e-4, 1e-2), rng.uniform(1e-4, 1e-2)
        exposed = exposed_transfer_s(layers, tx, tc, layerwise=True)
        assert exposed == pytest.approx(_pipeline_finish(layers, tc, tx) - layers * tc)


def test_layerwise_when_link_is_slower_than_compute():
    # 4 layers, transfer 2 ms vs compute 1 ms: the link falls 1 ms behind per layer.
    assert exposed_transfer_s(4, 2e-3, 1e-3, layerwise=True) == pytest.approx(5e-3)
    assert exposed_transfer_s(4, 2e-3, 1e-3, layerwise=False) == pytest.approx(8e-3)


def test_gpu_count_ignores_float_noise_when_rounding():
    # 10 x 1.3 is 13.000000000000002 in floating point: must stay 13.
    assert gpu_count(10, 1, 0.3).total == 13
    assert gpu_count(3, 1, 0.0).total == 3
    with pytest.raises(ValueError):
        gpu_count(1, 0, 0.3)


def test_max_batch_within_matches_a_linear_scan():
    def cost(b):
        return 0.004 + 0.0003 * b

    for slo in (0.001, 0.0043, 0.01, 0.02, 1.0):
        expected = max([b for b in range(1, 101) if cost(b) <= slo], default=0)
        assert max_batch_within(cost, slo, 100) == expected


def test_kv_heads_replicate_when_tp_exceeds_them():
    m = MODELS["qwen2.5-7b"]  # 4 KV heads
    assert mem.kv_shards(m, 2) == 2
    assert mem.kv_shards(m, 8) == 4


def test_mla_latent_is_not_split_across_tp():
    m = MODELS["deepseek-v3"]
    assert mem.kv_shards(m, 8) == 1
    dep = Deployment(m, GPUS["h200"], tp=8)
    assert mem.kv_bytes_per_token_per_gpu(dep) == mem.kv_bytes_per_token(m, 2)
    assert mem.kv_bytes_per_token(m, 2) == 61 * 576 * 2


def test_moe_decode_reads_only_routed_experts():
    m = MODELS["deepseek-v3"]
    one = rl.weight_bytes_read(m, 1, 1)
    everything = rl.weight_bytes_read(m, 100_000, 1)
    # One token touches its 8 experts (+ shared): the active parameters.
    assert one == pytest.approx(param_count(m, active=True), rel=0.01)
    assert everything == pytest.approx(param_count(m), rel=1e-6)
    assert one < rl.weight_bytes_read(m, 64, 1) < everything


def test_pp_adds_throughput_only_with_micro_batches():
    dep = Deployment(MODELS["llama-3-70b"], GPUS["h100-sxm"], tp=8, pp=2)
    step = rl.decode_step_time(dep, 64, 1024)
    lone = rl.tokens_per_s_per_gpu(dep, 64, step, 1) * dep.gpus
    full = rl.tokens_per_s_per_gpu(dep, 64, step, 64) * dep.gpus
    assert lone == pytest.approx(64 / step.total_s)
    assert full == pytest.approx(64 / step.total_s * 2 * (1 - 1 / 65))


def test_decode_gets_compute_bound_past_the_ridge():
    dep = Deployment(MODELS["llama-3-8b"], GPUS["h100-sxm"])
    assert rl.decode_step_time(dep, 1, 0).bound == "memory"
    assert rl.decode_step_time(dep, 1024, 0).bound == "compute"


def test_cpu_local_decode_roofline_matches_findings():
    """Measured on this machine: at ~38 GB/s the bf16 batch-1 decode roofline of
    SmolLM2-135M is about 140 tokens/s."""
    dep = Deployment(MODELS["smollm2-135m"], GPUS["cpu-local"])
    tok_s = 1 / rl.decode_step_time(dep, 1, 0).total_s
    assert tok_s == pytest.approx(140, rel=0.05)


def test_fp8_compute_needs_an_fp8_chip():
    with pytest.raises(ValueError, match="FP8"):
        Deployment(MODELS["llama-3-8b"], GPUS["a100-80gb"], dtype="fp8")
    dep = Deployment(MODELS["llama-3-8b"], GPUS["h100-sxm"], dtype="fp8")
    assert dep.peak_flops == 1979e12 and dep.weight_bytes_per_param == 1


@pytest.mark.parametrize(
    "change",
    [
        {"tp": 0},
        {"pp": 1000},
        {"kv_dtype": "fp4"},
        {"weight_quant": "nf4"},
        {"gpu_memory_utilization": 1.5},
        {"compute_efficiency": 0},
    ],
)
def test_deployment_rejects_bad_settings(change):
    base = dict(model=MODELS["llama-3-8b"], gpu=GPUS["h100-sxm"])
    with pytest.raises(ValueError):
        Deployment(**{**base, **change})


def test_weight_quant_overrides_the_compute_dtype_for_storage():
    dep = Deployment(MODELS["llama-3-70b"], GPUS["h100-sxm"], tp=2, weight_quant="int4")
    assert mem.deployment_weight_bytes(dep) == pytest.approx(70.55e9 * 0.5, rel=0.001)
    assert mem.weight_bytes_per_gpu(replace(dep, tp=4)) == mem.weight_bytes_per_gpu(dep) / 2
