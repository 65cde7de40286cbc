"""`pdserve sim` from the command line: the bench's JSON fields, search, bad input."""

import json

from pdserve.cli import main
from tests.data import MOONCAKE_SAMPLE as TRACE


def test_sim_prints_bench_json_fields(capsys):
    rc = main(
        [
            "sim",
            "--scenario",
            "seed-000-6.1",
            "--mode",
            "disagg",
            "--prefill-tp",
            "8",
            "--decode-tp",
            "8",
            "--goodput",
            "ttft:5000",
            "tpot:50",
            "--json",
        ]
    )
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    for key in (
        "completed",
        "failed",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_tpot_ms",
        "p90_itl_ms",
        "mean_e2el_ms",
        "request_throughput",
        "output_throughput",
        "request_goodput",
        "slo_attainment_pct",
        "ttfts",
        "itls",
        "start_times",
        "by_tag",
    ):
        assert key in res, key
    assert res["completed"] == 20 and res["backend"] == "pdserve-sim"
    assert res["sim"]["mode"] == "disagg" and res["sim"]["gpus"] == 16


def test_sim_report_prints_requests_simulated_per_second(capsys, tmp_path):
    rc = main(
        [
            "sim",
            "--dataset-name",
            "mooncake",
            "--dataset-path",
            TRACE,
            "--num-prompts",
            "60",
            "--mode",
            "chunked",
            "--tp",
            "4",
            "--block-size",
            "512",
            "--result-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "Serving Benchmark Result" in out and "requests simulated per second" in out
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert saved["completed"] == 60


def test_sim_random_workload_with_bench_flags(capsys):
    rc = main(
        [
            "sim",
            "--dataset-name",
            "random",
            "--num-prompts",
            "30",
            "--random-input-len",
            "2000",
            "--random-output-len",
            "50",
            "--request-rate",
            "4",
            "--mode",
            "collocated",
            "--tp",
            "4",
            "--json",
        ]
    )
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["completed"] == 30 and res["total_input_tokens"] == 30 * 2000


def test_search_finds_the_cheapest_layout_and_prints_what_it_tried(capsys):
    rc = main(
        [
            "sim",
            "--dataset-name",
            "random",
            "--num-prompts",
            "40",
            "--random-input-len",
            "4000",
            "--random-output-len",
            "100",
            "--request-rate",
            "8",
            "--goodput",
            "ttft:1000",
            "tpot:60",
            "--search",
            "--search-tp",
            "4,8",
            "--search-max-gpus",
            "32",
            "--search-modes",
            "disagg,chunked",
            "--num-gpu-blocks",
            "4000",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "cheapest:" in out and "P99 TTFT ms" in out
    rows = [line for line in out.splitlines() if "|" in line and "---" not in line][1:]
    assert len(rows) >= 3  # several layouts simulated and listed
    assert any(r.rstrip().endswith("yes") for r in rows)


def test_bad_flags_exit_2(capsys):
    assert main(["sim", "--dataset-name", "mooncake"]) == 2
    assert "needs --dataset-path" in capsys.readouterr().err
    assert main(["sim", "--scenario", "seed-000-6.1", "--goodput", "bogus:1"]) == 2
    assert main(["sim", "--scenario", "seed-000-6.1", "--search"]) == 2


def test_profile_must_be_a_profile(tmp_path, capsys):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    assert main(["sim", "--scenario", "seed-000-6.1", "--profile", str(bad)]) == 2
    assert "not a profile" in capsys.readouterr().err


def test_workload_json_replays_a_closed_loop_of_chats(tmp_path, capsys):
    """The format benchmarks/interference.py writes: chats without arrival times run as
    `chat_streams` users in a closed loop; long prompts at their own times."""
    reqs = [
        {"index": i, "arrival_s": None, "prompt_tokens": 64, "output_tokens": 16, "kind": "chat"} for i in range(12)
    ] + [{"index": 12, "arrival_s": 0.5, "prompt_tokens": 2048, "output_tokens": 4, "kind": "long"}]
    path = tmp_path / "workload.json"
    path.write_text(json.dumps({"params": {"chat_streams": 3}, "requests": reqs}))
    rc = main(
        ["sim", "--workload-json", str(path), "--mode", "chunked", "--model", "llama-3-8b", "--tp", "1", "--json"]
    )
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["completed"] == 13
    assert res["by_tag"]["chat"]["max_concurrent_requests"] <= 3
    assert sorted(res["start_times"])[3] > 0  # the 4th chat waited for a slot


def test_sim_runs_without_torch():
    """Only --calibrate needs the engine's model; the simulator itself must start without torch."""
    import subprocess
    import sys

    code = (
        "import sys, io, contextlib\nfrom pdserve.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    rc = main(['sim', '--scenario', 'seed-000-6.1', '--model', 'llama-3-8b', '--mode', 'chunked'])\n"
        "assert rc == 0 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:3]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
