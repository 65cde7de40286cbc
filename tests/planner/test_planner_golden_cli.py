"""Golden tests: every worked example of the architecture and capacity notes,
reproduced through the command line (`pdserve plan ... --json`).

The notes mix units: KV sizes are binary ("320 KB" per token is 320 KiB, "10 GB"
is 10 GiB) and then divided by a "GB/s" read as GiB/s; weights are decimal
(7e9 x 2 B = 14 GB). `--units binary` reproduces the first reading; the
decimal default gives the physical time. Each test says which one it uses.
"""

import json

import pytest

from pdserve.cli import main
from pdserve.planner.units import GiB, KiB, MiB

L70 = ["--model", "llama-3-70b", "--gpu", "h100"]


def plan(capsys, *argv) -> dict:
    rc = main(["plan", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return json.loads(out)["results"]


# ---- the architecture note: 70B (80 layers, 8 KV heads, d_head 128) on H100 nodes


def test_tp8_decode_does_160_allreduces_of_6_us_0_96_ms(capsys):
    """80 layers x 2 = 160 all-reduces per token at ~6 us on NVLink = 0.96 ms, against
    ~1.92 ms of compute: communication is a third of the step."""
    r = plan(capsys, *L70, "--tp", "8", "--context", "4096", "--decode-batch", "1", "--latency-model", "roofline")
    # the note counts the latency floor only; one token's 16 KB message adds ~1%
    assert r["decode"]["tp_comm_s"] == pytest.approx(0.96e-3, rel=0.02)
    assert r["decode"]["tp_comm_s"] / (r["decode"]["tp_comm_s"] + 1.92e-3) == pytest.approx(1 / 3, abs=0.01)


def test_tp16_crosses_nodes_and_allreduces_grow_past_6_ms(capsys):
    """TP beyond the 8-GPU node: 160 x ~40 us = 6.4 ms (from ~1 ms inside the node)."""
    inside = plan(capsys, *L70, "--tp", "8", "--context", "4096", "--decode-batch", "1", "--latency-model", "roofline")[
        "decode"
    ]["tp_comm_s"]
    across = plan(
        capsys, *L70, "--tp", "16", "--context", "4096", "--decode-batch", "1", "--latency-model", "roofline"
    )["decode"]["tp_comm_s"]
    assert inside == pytest.approx(1e-3, abs=0.05e-3)
    assert across == pytest.approx(6.4e-3, rel=0.02) and across > 6e-3


def test_pp4_with_one_micro_batch_idles_75_percent(capsys):
    """Bubble = (P - 1) / (P + B - 1): P = 4, B = 1 -> 75%."""
    r = plan(capsys, *L70, "--tp", "8", "--pp", "4", "--context", "4096", "--decode-batch", "1")
    assert r["decode"]["pp_bubble"] == 0.75


@pytest.mark.parametrize(
    "context, kib, gib", [(4096, 1_310_720, 1.25), (32768, 10_485_760, 10.0), (131072, 41_943_040, 40.0)]
)
def test_70b_kv_320_kib_per_token_and_per_request(capsys, context, kib, gib):
    """2 x 8 x 128 x 2 B = 4 KiB per layer, x 80 = 320 KiB per token; 4K -> 1,310,720 KiB
    (1.25 GiB; the note's "1.28 GB" divides by 1024 then 1000), 32K -> 10, 128K -> 40 GiB."""
    kv = plan(capsys, *L70, "--tp", "8", "--context", str(context))["kv"]
    assert kv["kv_bytes_per_token_layer"] == 4 * KiB
    assert kv["kv_bytes_per_token"] == 320 * KiB
    assert kv["kv_bytes_per_request"] / KiB == kib
    assert kv["kv_bytes_per_request"] / GiB == gib


@pytest.mark.parametrize(
    "argv, seconds",
    [
        (["--link-gbps", "100", "--units", "binary"], 0.909),  # 10 GB / 11 GB/s
        (["--link-gbps", "100"], 0.976),  # the same in decimal B/s
        (["--link-gbps", "400", "--units", "binary"], 0.222),  # 10 GB / 45 GB/s
        (["--link-gbps", "400", "--units", "binary", "--kv-dtype", "fp8"], 0.111),  # FP8: 5 GB
    ],
)
def test_32k_prompt_kv_transfer_909_222_111_ms(capsys, argv, seconds):
    """A 32K prompt's 10 GiB of KV: 909 ms at 100 Gb/s (11 GB/s), 222 ms at 400 Gb/s
    (45 GB/s), 111 ms with FP8 KV."""
    nets = plan(capsys, *L70, "--tp", "8", "--context", "32768", *argv)["transfer"]["networks"]
    (t,) = nets.values()
    assert t["total_s"] == pytest.approx(seconds, abs=0.0005)
    assert t["eager_exposed_s"] == pytest.approx(t["total_s"])  # eager: all of it on the TTFT


def test_10g_ethernet_takes_over_8_s_for_a_32k_prompt(capsys):
    """Plain 10G Ethernet instead of RDMA: 10 GB of KV need more than 8 seconds."""
    nets = plan(capsys, *L70, "--tp", "8", "--context", "32768", "--link-gbps", "10")
    assert nets["transfer"]["networks"]["10"]["total_s"] > 8.0
    binary = plan(capsys, *L70, "--tp", "8", "--context", "32768", "--link-gbps", "10", "--units", "binary")[
        "transfer"
    ]["networks"]["10"]
    assert binary["total_s"] > 8.0


def test_layerwise_128_mib_per_layer_at_48_gb_s_2_6_ms_hidden(capsys):
    """10 GB / 80 layers = 128 MB per layer; at 48 GB/s 2.6 ms (the note's text says 2.66,
    128e6 / 48e9 with units mixed), under the 3.5 ms a layer computes: only the last
    layer's transfer is exposed, eager exposes all 80."""
    r = plan(capsys, *L70, "--tp", "8", "--context", "32768", "--link-gbytes", "48", "--units", "binary")
    t = r["transfer"]["networks"]["48GB/s"]
    assert r["transfer"]["kv_bytes"] / 80 == 128 * MiB
    assert t["per_layer_s"] == pytest.approx(2.6e-3, abs=0.05e-3)
    assert t["per_layer_s"] < 3.5e-3 < t["per_layer_compute_s"]
    assert t["hidden"] and t["layerwise_exposed_s"] == pytest.approx(t["per_layer_s"])
    assert t["eager_exposed_s"] == pytest.approx(80 * t["per_layer_s"])
    assert 1 - t["layerwise_exposed_s"] / t["eager_exposed_s"] > 0.95
    decimal = plan(capsys, *L70, "--tp", "8", "--context", "32768", "--link-gbytes", "48")
    assert decimal["transfer"]["networks"]["48GB/s"]["per_layer_s"] == pytest.approx(128 * MiB / 48e9)


def test_64k_prompt_20_gib_444_ms_5_55_ms_per_layer_hidden(capsys):
    """64K tokens: 20,971,520 KiB = 20 GiB; at 45 GB/s 444 ms; per layer 444 / 80 = 5.55 ms,
    less than a layer's compute, so 98% of the transfer disappears."""
    r = plan(capsys, *L70, "--tp", "8", "--context", "65536", "--link-gbps", "400", "--units", "binary")
    t = r["transfer"]["networks"]["400"]
    assert r["kv"]["kv_bytes_per_request"] / KiB == 20_971_520
    assert t["total_s"] == pytest.approx(0.444, abs=0.0005)
    assert t["per_layer_s"] == pytest.approx(5.55e-3, abs=0.01e-3)
    assert t["hidden"] and 1 - t["layerwise_exposed_s"] / t["total_s"] > 0.98
    fp8 = plan(capsys, *L70, "--tp", "8", "--context", "65536", "--kv-dtype", "fp8")
    assert fp8["kv"]["kv_bytes_per_request"] / GiB == 10.0


@pytest.mark.parametrize("lin, lout, ratio", [(8000, 500, 0.5), (1000, 4000, 32)])
def test_pd_ratio_from_measured_throughputs(capsys, lin, lout, ratio):
    """Theta_P = 4,000 tokens/s (H100), Theta_D = 500 (H20): ratio 8; Lin 8,000 / Lout 500
    -> N_D / N_P = 0.5; Lin 1,000 / Lout 4,000 (long reasoning) -> 32."""
    r = plan(
        capsys,
        *L70,
        "--decode-gpu",
        "h20",
        "--tp",
        "8",
        "--lin",
        str(lin),
        "--lout",
        str(lout),
        "--theta-p",
        "4000",
        "--theta-d",
        "500",
    )
    assert r["pd_ratio"]["theta_p"] / r["pd_ratio"]["theta_d"] == 8
    assert r["pd_ratio"]["ratio_d_per_p"] == ratio and r["pd_ratio"]["measured"]


# ---- the capacity note: physics, KV sizes, a 7B on a 24 GB card, GPU count


M7 = ["--model", "mistral-7b", "--gpu", "h100"]  # 7.24B, the 7B GQA shape


def test_prefill_flops_are_2n_per_prompt_token(capsys):
    """Prefill costs about 2 N S_in FLOPs; attention adds little at 512 tokens."""
    r = plan(capsys, *M7, "--lin", "512", "--lout", "1")
    assert r["prefill"]["flops"] == pytest.approx(2 * 7.24e9 * 512, rel=0.03)


@pytest.mark.parametrize("batch", [1, 32, 256])
def test_decode_intensity_is_the_batch_and_h100_ridge_is_295(capsys, batch):
    """Decode at batch B: AI ≈ 2NB / 2N = B (1, 32, 256), against H100's 989e12 / 3.35e12
    ≈ 295 FLOP/byte; B = 256 is close to compute-bound."""
    r = plan(capsys, *M7, "--context", "1", "--decode-batch", str(batch), "--latency-model", "roofline")
    ai = r["decode"]["flops"] / r["decode"]["bytes_per_gpu"]
    assert ai == pytest.approx(batch, rel=0.01)
    gpu = r["hardware"]["gpu"]
    ridge = gpu["bf16_flops"] / gpu["memory_bytes_per_s"]
    assert ridge == pytest.approx(295, abs=0.5) and ridge / ai > (250 if batch == 1 else 1)


def test_7b_decode_floor_4_2_ms_on_h100_and_fitted_is_slower(capsys):
    """T_decode >= (model + KV bytes) / bandwidth: 7B in BF16 (about 14 GB) at 3.35 TB/s is
    about 4.2 ms per token; real steps take longer (kernels, KV, scheduling)."""
    floor = plan(capsys, *M7, "--context", "1", "--decode-batch", "1", "--latency-model", "roofline")["decode"]
    assert floor["bound"] == "memory"
    assert floor["time_s"] == pytest.approx(4.2e-3, rel=0.04)
    fitted = plan(capsys, *M7, "--context", "1", "--decode-batch", "1")["decode"]
    assert fitted["roofline_time_s"] == floor["time_s"] < fitted["time_s"]


@pytest.mark.parametrize("model, kib, gib_4k, gib_32k", [("llama-3-8b", 128, 0.5, 4), ("llama-3-70b", 320, 1.25, 10)])
def test_kv_table_gqa_rows(capsys, model, kib, gib_4k, gib_32k):
    """7B GQA (32 layers, 8 KV heads, 128): 128 KB/token, 0.5 GB at 4K, 4 GB at 32K;
    70B GQA: 320 KB, 1.25 GB, 10 GB."""
    for ctx, gib in ((4096, gib_4k), (32768, gib_32k)):
        kv = plan(capsys, "--model", model, "--gpu", "h100", "--tp", "8", "--context", str(ctx))["kv"]
        assert kv["kv_bytes_per_token"] == kib * KiB
        assert kv["kv_bytes_per_request"] / GiB == gib


def test_kv_table_mha_row_from_a_config_file(capsys, tmp_path):
    """70B MHA (64 KV heads): "2.56 MB" per token (2,560 KiB = 2.5 MiB), 10 GB at 4K, 80 GB at 32K."""
    cfg = {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "intermediate_size": 28672,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    for ctx, gib in ((4096, 10), (32768, 80)):
        kv = plan(capsys, "--model", str(path), "--gpu", "h100", "--tp", "8", "--context", str(ctx))["kv"]
        assert kv["kv_bytes_per_token"] == 2560 * KiB == 2.5 * MiB
        assert kv["kv_bytes_per_request"] / GiB == gib


def test_mla_caches_576_values_per_layer(capsys):
    """MLA: L x (d_c + d_R) x S x bytes; DeepSeek-V2 keeps 512 + 64 = 576 per layer and token."""
    kv = plan(capsys, "--model", "deepseek-v2", "--gpu", "h100", "--tp", "8", "--context", "1000")["kv"]
    assert kv["kv_bytes_per_token_layer"] == 576 * 2
    assert kv["kv_bytes_per_request"] == 60 * 576 * 2 * 1000


def test_7b_4k_20_requests_do_not_fit_24_gb_and_the_fixes_do(capsys):
    """7B, 4K context, 20 concurrent, 24 GB card: 14 GB weights + 20 x 0.5 GB KV = 24 GB, no
    room left; INT4 weights, FP8 KV or TP 2 make it fit."""
    base = ["--model", "mistral-7b", "--gpu", "rtx-4090", "--context", "4096"]
    r = plan(capsys, *base)
    assert r["kv"]["kv_bytes_per_request"] / GiB == 0.5
    assert r["fit"]["max_concurrency"] < 20
    for change in (["--weight-quant", "int4"], ["--kv-dtype", "fp8"], ["--tp", "2"]):
        assert plan(capsys, *base, *change)["fit"]["max_concurrency"] >= 20


def test_7b_at_32k_needs_4_gb_per_request_so_few_fit_24_gb(capsys):
    """7B at 32K: 4 GB of KV per request; with 14 GB of weights a 24 GB card runs only a few."""
    r = plan(capsys, "--model", "llama-3-8b", "--gpu", "rtx-4090", "--context", "32768")
    assert r["kv"]["kv_bytes_per_request"] / GiB == 4
    assert r["fit"]["max_concurrency"] <= 2


def test_latency_is_ttft_plus_lout_minus_1_tpot(capsys):
    """Latency ≈ TTFT + (T_out - 1) x TPOT: 256 tokens at 10-20 ms are 2.5-5 s."""
    r = plan(
        capsys,
        "--model",
        "mistral-7b",
        "--gpu",
        "rtx-4090",
        "--weight-quant",
        "int4",
        "--lin",
        "512",
        "--lout",
        "256",
        "--decode-batch",
        "20",
    )
    lat = r["latency"]
    assert lat["latency_s"] == pytest.approx(lat["ttft_s"] + 255 * lat["tpot_s"])
    assert 2.5 <= 256 * 10e-3 and 256 * 20e-3 <= 5.2


def test_gpu_count_10_qps_5_s_20_per_gpu_2_5_to_3_to_4(capsys):
    """GPUs = ceil(peak QPS x occupancy / concurrency per GPU) x (1 + redundancy):
    10 x 5 / 20 = 2.5 -> 3 GPUs, +30% -> 4."""
    r = plan(capsys, *M7, "--context", "4096", "--qps", "10", "--occupancy-s", "5", "--concurrency-per-gpu", "20")
    c = r["gpu_count"]["by_concurrency"]
    assert (c["raw"], c["base"], c["total"]) == (2.5, 3, 4)


@pytest.mark.parametrize(
    "k, alpha, cost, tokens, speedup",
    [(4, 0.8, 0.0, 3.3616, 3.3616), (4, 0.8, 0.1, 3.3616, 3.3616 / 1.4), (3, 0.5, 0.05, 1.875, 1.875 / 1.15)],
)
def test_speculative_decoding_accepted_tokens_and_speedup(capsys, k, alpha, cost, tokens, speedup):
    """Expected accepted tokens (1 - a^(g+1)) / (1 - a); speed-up = accepted tokens /
    (draft cost + verify cost)."""
    r = plan(
        capsys,
        *M7,
        "--context",
        "4096",
        "--decode-batch",
        "1",
        "--spec-k",
        str(k),
        "--spec-acceptance",
        str(alpha),
        "--spec-draft-cost",
        str(cost),
    )
    assert r["spec"]["expected_tokens_per_step"] == pytest.approx(tokens, rel=1e-4)
    assert r["spec"]["speedup"] == pytest.approx(speedup, rel=1e-4)
    assert r["spec"]["tpot_s"] == pytest.approx(r["decode"]["tpot_s"] / speedup)
