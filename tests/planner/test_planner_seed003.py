"""Golden tests: every worked example of seed 003 (physics), by section.

Seed 003 mixes units in one sum: weights in decimal GB (7e9 x 2 B = 14 GB)
and KV in binary GB (128 KB x 4,096 = 0.5 GB = 0.5 GiB). The tests assert
each figure in the unit the seed used for it.
"""
from dataclasses import replace

import pytest

from pdserve.planner import memory as mem
from pdserve.planner import roofline as rl
from pdserve.planner.capacity import gpu_count, request_latency_s
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import GPUS
from pdserve.planner.models import MODELS
from pdserve.planner.units import GB, GiB, KiB, MiB

H100 = GPUS["h100-sxm"]
GQA_7B = MODELS["llama-3-8b"]  # the seed's "7B (GQA) 32 layers, 8 KV heads, d_h 128"
GQA_70B = MODELS["llama-3-70b"]
MHA_70B = replace(GQA_70B, name="70b-mha", kv_heads=64)
SEED_7B_PARAMS = 7e9
UTIL = 0.9


def test_seed003_s1_1_prefill_flops_2n_s():
    """§1.1: prefill costs "约 2N·S_in FLOPs"; attention adds little at 512."""
    m = MODELS["mistral-7b"]
    two_n_s = 2 * 7.24e9 * 512
    assert rl.prefill_flops(m, 512) == pytest.approx(two_n_s, rel=0.03)


def test_seed003_s2_1_decode_ai_1_h100_ridge_295():
    """§2.1: batch-1 decode: FLOPs ≈ 2N, bytes ≈ 2N (BF16), AI ≈ 1; H100
    989e12 / 3.35e12 ≈ 295 FLOP/byte, about 300x above decode's AI."""
    m = MODELS["mistral-7b"]
    ai = rl.arithmetic_intensity(rl.decode_flops(m, 1, 0), rl.weight_bytes_read(m, 1, 2))
    assert ai == pytest.approx(1.0)
    ridge = rl.ridge_point(989e12, 3.35e12)
    assert ridge == pytest.approx(295, abs=0.5)
    assert ridge / ai == pytest.approx(300, rel=0.02)


def test_seed003_s2_2_decode_floor_7b_4_2_ms_on_h100():
    """§2.2: T_decode >= (model + KV bytes) / bandwidth; 7B BF16 ≈ 14 GB at
    3.35 TB/s ≈ 4.2 ms/token."""
    weights = mem.weight_bytes(SEED_7B_PARAMS, 2)
    assert weights == 14 * GB
    t = rl.roofline_time_s(2 * SEED_7B_PARAMS, weights, 989e12, 3.35e12)
    assert t == pytest.approx(4.2e-3, abs=0.05e-3)
    # The same floor through the deployment path, for the catalog's 6.74B Llama-2-7B.
    step = rl.decode_step_time(Deployment(MODELS["llama-2-7b"], H100), 1, 0)
    assert step.bound == "memory"
    assert step.total_s == pytest.approx(6.74e9 * 2 / 3.35e12, rel=0.01)


@pytest.mark.parametrize("batch", [1, 32, 256])
def test_seed003_s2_3_batch_b_gives_ai_b(batch):
    """§2.3: AI ≈ 2NB / 2N = B: B=1 -> 1, B=32 -> 32 (still < 295), B=256 ->
    256, close to compute-bound."""
    m = MODELS["mistral-7b"]
    ai = rl.arithmetic_intensity(rl.decode_flops(m, batch, 0), rl.weight_bytes_read(m, batch, 2))
    assert ai == pytest.approx(batch)
    ridge = rl.ridge_point(H100.bf16_flops, H100.memory_bytes_per_s)
    assert ai < ridge
    if batch == 256:
        assert ai / ridge > 0.85


@pytest.mark.parametrize("model, per_token_kib, gib_4k, gib_32k", [
    (GQA_7B, 128, 0.5, 4),
    (GQA_70B, 320, 1.25, 10),
    (MHA_70B, 2560, 10, 80),
])
def test_seed003_s3_2_kv_table(model, per_token_kib, gib_4k, gib_32k):
    """§3.2 table: 7B GQA 128KB / 0.5GB / 4GB; 70B GQA 320KB / 1.25GB / 10GB;
    70B MHA "2.56MB" / 10GB / 80GB.

    The MHA row's 2.56MB is 2,560 KiB written with MB = 1,000 KB; it is
    2.5 MiB (2.62 MB). Every other figure is exact in binary units.
    """
    assert mem.kv_bytes_per_token(model, 2) == per_token_kib * KiB
    assert mem.kv_bytes(model, 4096, 2) / GiB == gib_4k
    assert mem.kv_bytes(model, 32768, 2) / GiB == gib_32k


def test_seed003_s3_2_mha_row_is_2_5_mib():
    assert mem.kv_bytes_per_token(MHA_70B, 2) == 2.5 * MiB


def test_seed003_s3_3_mla_deepseek_v2_576_per_layer():
    """§3.3: M_KV ≈ L x (d_c + d_R) x S x B x bytes; DeepSeek-V2 ≈ 576 per
    layer per token, "远小于 MHA" (its 128 heads x 128 x 2 would be 32,768)."""
    m = MODELS["deepseek-v2"]
    assert m.kv_lora_rank + m.qk_rope_head_dim == 576
    assert mem.kv_bytes_per_token_layer(m, 2) == 576 * 2
    assert mem.kv_bytes(m, 1000, 2, requests=3) == 60 * 576 * 1000 * 3 * 2
    as_mha = 2 * m.heads * m.head_dim
    assert as_mha / 576 > 50


def _seed_7b_total(kv_bytes_per_element: float, concurrency: int, params_bytes: float = 2):
    weights = mem.weight_bytes(SEED_7B_PARAMS, params_bytes)
    kv = mem.kv_bytes(GQA_7B, 4096, kv_bytes_per_element, requests=concurrency)
    return weights, kv


def test_seed003_s7_2_7b_4k_20_requests_24gb_does_not_fit():
    """§7.2: weights 14GB; KV 128KB x 4096 = 0.5GB per request; 20 requests
    10GB; weights + KV = 24GB on a 24GB card: no room left -> does not fit."""
    weights, kv = _seed_7b_total(2, 20)
    assert weights == 14 * GB
    assert mem.kv_bytes(GQA_7B, 4096, 2) / GiB == 0.5
    assert kv / GiB == 10
    assert weights / GB + kv / GiB == 24  # the seed's sum, in its own units
    for gpu in ("rtx-4090", "l4"):
        assert not mem.fits(weights, kv, GPUS[gpu].memory_bytes, UTIL)


@pytest.mark.parametrize("change, weights_gb, kv_gib, total", [
    ("int4 weights", 3.5, 10, 13.5),
    ("fp8 kv", 14, 5, 19),
    ("int4 weights + fp8 kv", 3.5, 5, 8.5),
    ("10 requests", 14, 5, 19),
])
def test_seed003_s7_2_changes_that_make_it_fit(change, weights_gb, kv_gib, total):
    """§7.2 调整方案: INT4 weights 3.5 + 10 = 13.5GB; FP8 KV 14 + 5 = 19GB;
    both 3.5 + 5 = 8.5GB; 10 requests 14 + 5 = 19GB ("勉强"): all fit."""
    params_bytes = 0.5 if "int4" in change else 2
    kv_b = 1 if "fp8" in change else 2
    requests = 10 if "10 requests" in change else 20
    weights, kv = _seed_7b_total(kv_b, requests, params_bytes)
    assert weights / GB == weights_gb
    assert kv / GiB == kv_gib
    assert weights / GB + kv / GiB == total
    assert mem.fits(weights, kv, GPUS["rtx-4090"].memory_bytes, UTIL)


def test_seed003_s7_2_bigger_card_or_tp2_fits():
    """§7.2: "换 48GB/80GB 卡，或张量并行到 2 卡"."""
    weights, kv = _seed_7b_total(2, 20)
    for gpu in ("l40s", "a100-80gb"):
        assert mem.fits(weights, kv, GPUS[gpu].memory_bytes, UTIL)
    assert mem.fits(weights / 2, kv / 2, GPUS["rtx-4090"].memory_bytes, UTIL)


def test_seed003_s7_2_same_verdicts_through_the_deployment_path():
    """The catalog's 7.24B Mistral-7B has the seed's KV shape; on a 24 GB
    card it holds fewer than 20 requests of 4K, and each change fixes that."""
    dep = Deployment(MODELS["mistral-7b"], GPUS["rtx-4090"])
    assert mem.deployment_max_concurrency(dep, 4096) < 20
    for change in ({"weight_quant": "int4"}, {"kv_dtype": "fp8"}, {"tp": 2}):
        assert mem.deployment_max_concurrency(replace(dep, **change), 4096) >= 20


def test_seed003_s7_3_256_tokens_take_2_5_to_5_s_and_4_req_per_s():
    """§7.3: 10–20 ms/token; 256 output tokens ≈ 2.5–5 s; 20 concurrent
    requests over 5 s ≈ 4 req/s. (256 x 10 ms = 2.56 s; the seed rounds down.)"""
    assert request_latency_s(0.0, 256, 10e-3) == pytest.approx(2.5, abs=0.1)
    assert request_latency_s(0.0, 256, 20e-3) == pytest.approx(5.0, abs=0.15)
    assert 20 / 5 == 4


def test_seed003_s7_4_gpu_count_2_5_to_3_to_4():
    """§7.4: 10 QPS x 5 s / 20 per card = 2.5 -> 3 cards; +30% -> 4."""
    count = gpu_count(10 * 5, 20, 0.3)
    assert count.raw == 2.5
    assert count.base == 3
    assert count.total == 4


def test_seed003_q2_7b_32k_4gb_per_request_few_fit_on_24gb():
    """§10 Q2: 7B (32 layers, 8 KV heads, 128, FP16) 32K ≈ 4GB per request;
    with 14GB of weights a 24GB card "只能跑少量并发"."""
    per_request = mem.kv_bytes(GQA_7B, 32768, 2)
    assert per_request / GiB == 4
    free = mem.usable_memory_bytes(GPUS["rtx-4090"].memory_bytes, UTIL) - 14 * GB
    assert mem.max_concurrency(free, per_request) == 2
