"""The fitted step-time model against held-out end-to-end measurements (heldout.py).

These pin where the model stands today (docs/planner.md shows the table): a
change to the model or its constants that moves predictions away from the
measurements fails here, and so does one that silently fixes or adds a miss.
"""

import json

import pytest

from pdserve.cli import main as cli_main
from pdserve.planner import fitted, heldout, perf, validate
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import resolve_gpu
from pdserve.planner.models import resolve_model

# (engine, gpu, TP, phase, tokens, batch) of every point outside 0.75-1.33; see
# "Where it stands" in docs/planner.md for why each misses.
MISSES = {
    ("vLLM", "a100", 8, "decode", 576, 1),
    ("vLLM", "a100", 8, "decode", 576, 4),
    ("vLLM", "h100", 8, "prefill", 128, 1),
    ("vLLM", "h100", 8, "prefill", 8192, 1),
    ("TurboMind", "a100", 4, "prefill", 128, 1),
    ("TurboMind", "a100", 4, "decode", 64, 1),
}
# The same points with the vLLM ones priced by the other reading of the same
# engine fit (host kernel issue overlapping the GPU, "vllm-2023-overlap").
OVERLAP_MISSES = {
    ("vLLM", "h100", 8, "decode", 576, 1),
    ("vLLM", "h100", 8, "prefill", 8192, 1),
    ("TurboMind", "a100", 4, "prefill", 128, 1),
    ("TurboMind", "a100", 4, "decode", 64, 1),
}

# Runs whose end-to-end time is many times their own prompt + 127 token times:
# not one steady batch of 64 (see validate.consistent_run), so not scored.
EXCLUDED = {
    ("vLLM", "a100", 2, "decode", 576, 64),
    ("vLLM", "h100", 2, "decode", 576, 64),
}


def _key(r):
    return (r["engine"], r["gpu"], r["tp"], r["phase"], r["tokens"], r["batch"])


@pytest.fixture(scope="module")
def rows():
    return validate.rows()


def test_roofline_is_a_lower_bound_on_every_measurement(rows):
    assert all(r["roofline_ratio"] < 1.0 for r in rows)


def test_median_in_the_target_band_and_the_misses_are_the_known_ones(rows):
    s = validate.summary(rows)
    assert s["points"] == 52 and s["excluded"] == 2
    assert 0.90 <= s["median"] <= 1.10
    assert s["in_band"] == 46
    assert {_key(r) for r in rows if r["valid"] and not 0.75 <= r["ratio"] <= 1.33} == MISSES
    assert 0.55 <= s["min"] and s["max"] <= 1.40


def test_only_the_runs_that_were_not_one_steady_batch_are_excluded(rows):
    assert {_key(r) for r in rows if not r["valid"]} == EXCLUDED
    for r in rows:
        if r["e2e_consistency"] is not None and r["valid"]:
            assert abs(r["e2e_consistency"] - 1.0) < 0.02, r  # the others agree with themselves closely
    assert all(r["e2e_consistency"] > 10 for r in rows if not r["valid"])


def test_consistent_run():
    # 0.2 s of prompt and 127 steps of 50 ms: 6.55 s end to end
    assert validate.consistent_run(0.2, 0.05, 6.55, 128)
    assert validate.consistent_run(0.2, 0.05, 7.0, 128)  # within 10%
    assert not validate.consistent_run(0.2, 0.05, 60.0, 128)  # waited and recomputed
    assert not validate.consistent_run(0.2, 0.05, 2.0, 128)  # stopped early


def test_the_engine_fit_reads_only_steady_runs_of_128_outputs():
    from pdserve.planner.fit_engines import _bloom_runs

    def row(prompt_ms, token_ms, e2e_ms, outputs=128, batch=1):
        return {
            "model": "bloom-176b",
            "hardware": "a100-80gb",
            "tensor_parallel": "8",
            "prompt_size": "512",
            "batch_size": str(batch),
            "token_size": str(outputs),
            "prompt_time": str(prompt_ms),
            "token_time": str(token_ms),
            "e2e_time": str(e2e_ms),
        }

    runs = _bloom_runs(
        [
            row(170, 48, 170 + 127 * 48),
            row(170, 60, 170 + 255 * 60, outputs=256),  # other output length
            row(170, 30, 50_000, batch=2),  # not one steady batch
        ]
    )
    assert runs == {("a100-80gb", 8, 512, 1): [(0.17, 0.048)]}


def test_the_overlapping_reading_is_pinned_too():
    rows = validate.rows({"vllm-2023": "vllm-2023-overlap"})
    s = validate.summary(rows)
    assert s["in_band"] == 48 and 0.90 <= s["median"] <= 1.10
    assert {_key(r) for r in rows if r["valid"] and not 0.75 <= r["ratio"] <= 1.33} == OVERLAP_MISSES


def test_long_prompts_at_tp_4_and_8_are_within_the_band_but_h100_tp8(rows):
    # what the attention refit (causal and cached pairs apart) and FlashAttention-2's
    # H100 share of peak brought in; H100 TP 8 at 8,192 tokens still misses
    pts = [r for r in rows if r["phase"] == "prefill" and r["tokens"] == 8192 and r["tp"] >= 4]
    inside = {(r["gpu"], r["tp"]) for r in pts if 0.75 <= r["ratio"] <= 1.33}
    assert inside == {("a100", 4), ("a100", 8), ("h100", 4)}


def test_decode_at_batch_16_and_64_with_tp_4_or_8_is_within_the_band(rows):
    # the regime the vllm-2023 engine terms (fitted on BLOOM-176B at TP 8) address
    pts = [r for r in rows if r["engine"] == "vLLM" and r["phase"] == "decode" and r["tp"] >= 4 and r["batch"] >= 16]
    assert len(pts) == 8 and all(0.75 <= r["ratio"] <= 1.33 for r in pts)


def test_fitted_beats_the_roofline_at_every_scored_point(rows):
    for r in rows:
        if not r["valid"]:
            continue
        assert abs(r["ratio"] - 1.0) < abs(r["roofline_ratio"] - 1.0), r


def test_no_fit_source_is_a_held_out_row():
    src = fitted.SOURCES["splitwise_bloom"]
    assert "bloom-176b" in src["rows"]
    # same file and commit as the held-out Llama-2-70B rows, other rows
    assert src["commit"] in heldout.SPLITWISE["source"]
    assert "llama" not in src["rows"].lower()


def test_engine_terms_add_host_time_only_where_asked():
    model, gpu = resolve_model("llama-2-70b"), resolve_gpu("h100-sxm")
    base = Deployment(model, gpu, tp=8)
    vllm = Deployment(model, gpu, tp=8, engine="vllm-2023")
    e = fitted.ENGINES["vllm-2023"]["h100"]
    d0, d1 = perf.decode_cost(base, 32, 576), perf.decode_cost(vllm, 32, 576)
    assert d1.total_s - d0.total_s == pytest.approx(e["fixed_s"] + 32 * e["per_seq_s"])
    p0, p1 = perf.prefill_cost(base, 512), perf.prefill_cost(vllm, 512)
    assert p1.total_s - p0.total_s == pytest.approx(e["fixed_s"] + e["per_seq_s"] + e["prefill_fixed_s"])
    assert d1.gemm_s == d0.gemm_s and d1.comm_s == d0.comm_s


def test_engine_flag_on_the_command_line(capsys):
    args = [
        "plan",
        "--model",
        "llama-2-70b",
        "--gpu",
        "a100-80gb",
        "--tp",
        "8",
        "--lin",
        "512",
        "--lout",
        "128",
        "--decode-batch",
        "64",
        "--json",
    ]
    assert cli_main(args) == 0
    base = json.loads(capsys.readouterr().out)["results"]["decode"]["time_s"]
    assert cli_main(args + ["--engine", "vllm-2023"]) == 0
    vllm = json.loads(capsys.readouterr().out)["results"]["decode"]["time_s"]
    assert vllm > base + 0.02


def test_the_table_lists_every_point(rows):
    assert validate.table(rows).count("\n") == len(rows) + 1
