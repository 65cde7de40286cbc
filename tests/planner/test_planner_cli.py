"""`pdserve plan` through the real entry point: text, --json, --list, errors."""

import json
import subprocess
import sys

import pytest

from pdserve.cli import main
from pdserve.planner.units import GiB, KiB

SEED_Q2 = ["plan", "--model", "llama-3-70b", "--gpu", "h100", "--context", "65536", "--tp", "8"]


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_prints_each_step_with_formula_numbers_and_result(capsys):
    rc, out, _ = _run(capsys, *SEED_Q2)
    assert rc == 0
    # The 64K-token, 70B, TP 8 transfer question, step by step.
    assert "KV/token/layer = 2 (K, V) x n_kv x d_head x bytes" in out
    assert "= 2 x 8 x 128 x 2 B" in out
    assert "= 4,096 B = 4 KiB" in out
    assert "= 320.00 KiB" in out
    assert "= 21.47 GB = 20.00 GiB" in out
    for title in ("Weight memory", "Fit and max concurrency", "Prefill time", "Decode step", "KV transfer", "Latency"):
        assert title in out
    assert "roofline (lower bound)" in out and "fitted, h100 profiles" in out
    assert "seed" not in out and "§" not in out


def test_plan_json_is_machine_readable(capsys):
    rc, out, _ = _run(capsys, *SEED_Q2, "--json")
    assert rc == 0
    plan = json.loads(out)
    kv = plan["results"]["kv"]
    assert kv["kv_bytes_per_token"] == 320 * KiB
    assert kv["kv_bytes_per_request"] == 20 * GiB
    transfer = plan["results"]["transfer"]["networks"]["400"]
    assert transfer["eager_exposed_s"] == pytest.approx(20 * GiB / 45e9)
    assert transfer["hidden"] is True
    assert transfer["layerwise_exposed_s"] == pytest.approx(transfer["per_layer_s"])
    assert plan["inputs"]["tp"] == 8
    assert [s["key"] for s in plan["steps"]][:4] == ["hardware", "weights", "kv", "fit"]


def test_plan_workload_gives_pd_ratio_and_gpu_count(capsys):
    rc, out, _ = _run(
        capsys,
        "plan",
        "--model",
        "llama-3-70b",
        "--gpu",
        "h100",
        "--decode-gpu",
        "h20",
        "--tp",
        "8",
        "--lin",
        "8000",
        "--lout",
        "500",
        "--qps",
        "10",
        "--slo-ttft-ms",
        "2000",
        "--slo-tpot-ms",
        "50",
        "--network-gbps",
        "400",
        "--json",
    )
    assert rc == 0
    r = json.loads(out)["results"]
    ratio = r["pd_ratio"]
    assert ratio["ratio_d_per_p"] == pytest.approx((500 / 8000) * ratio["theta_p"] / ratio["theta_d"])
    counts = r["gpu_count"]
    # Raw pool sizes stand in the P:D ratio the formula predicts.
    assert counts["decode"]["raw"] / counts["prefill"]["raw"] == pytest.approx(ratio["ratio_d_per_p"])
    assert counts["total_gpus"] == counts["prefill"]["gpus"] + counts["decode"]["gpus"]
    assert r["latency"]["tpot_s"] <= 0.050
    assert r["latency"]["slo_tpot_met"] is True
    assert list(r["transfer"]["networks"]) == ["400"]


def test_tpot_slo_lowers_the_decode_batch(capsys):
    base = ["plan", "--model", "llama-3-8b", "--gpu", "l4", "--context", "4096", "--json"]
    _, free, _ = _run(capsys, *base)
    _, capped, _ = _run(capsys, *base, "--slo-tpot-ms", "75")
    free_d = json.loads(free)["results"]["decode"]
    capped_d = json.loads(capped)["results"]["decode"]
    assert 1 < capped_d["batch"] < free_d["batch"]
    assert capped_d["tpot_s"] <= 0.075


def test_unreachable_tpot_slo_is_reported(capsys):
    # 16 GB of weights over 300 GB/s take 54 ms per step: 40 ms cannot be met.
    _, out, _ = _run(
        capsys, "plan", "--model", "llama-3-8b", "--gpu", "l4", "--context", "4096", "--slo-tpot-ms", "40", "--json"
    )
    plan = json.loads(out)
    assert plan["results"]["decode"]["batch"] == 1
    assert plan["results"]["latency"]["slo_tpot_met"] is False
    assert any("unreachable" in n for n in plan["notes"])


def test_7b_4k_on_a_24_gb_card_holds_fewer_than_20_requests(capsys):
    """7B, 4K context, 24 GB card: fewer than the 20 requests asked for."""
    rc, out, _ = _run(capsys, "plan", "--model", "mistral-7b", "--gpu", "rtx-4090", "--context", "4096", "--json")
    assert rc == 0
    assert json.loads(out)["results"]["fit"]["max_concurrency"] < 20


def test_model_that_does_not_fit_says_so_and_suggests_fixes(capsys):
    rc, out, _ = _run(
        capsys,
        "plan",
        "--model",
        "llama-3-70b",
        "--gpu",
        "rtx-4090",
        "--context",
        "4096",
        "--qps",
        "1",
        "--lin",
        "3000",
        "--lout",
        "500",
    )
    assert rc == 0
    assert "DOES NOT FIT" in out
    assert "try --weight-quant int4" not in out  # 35 GB of int4 weights still do not fit
    assert "try --tp 8" in out
    assert "not computed" in out


def test_context_beyond_the_model_window_is_noted(capsys):
    _, out, _ = _run(capsys, "plan", "--model", "llama-2-7b", "--gpu", "a100", "--context", "65536", "--json")
    assert any("4,096-token window" in n for n in json.loads(out)["notes"])


def test_list_names_every_model_and_gpu(capsys):
    rc, out, _ = _run(capsys, "plan", "--list")
    assert rc == 0
    for name in ("llama-3-405b", "deepseek-v3", "smollm2-135m", "h20", "ascend-910b", "cpu-local"):
        assert name in out
    rc, out, _ = _run(capsys, "plan", "--list", "--json")
    assert rc == 0 and "qwen2.5-72b" in json.loads(out)["models"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "gpt-5", "--gpu", "h100", "--context", "1"],
            ["unknown model 'gpt-5'", "llama-3-70b", "deepseek-v3"],
        ),
        (["--model", "llama-3-8b", "--gpu", "b200", "--context", "1"], ["unknown GPU 'b200'", "h100-sxm", "rtx-4090"]),
        (["--model", "llama-3-8b", "--gpu", "h100"], ["--context"]),
        (["--model", "llama-3-8b", "--gpu", "a100", "--context", "1", "--dtype", "fp8"], ["FP8"]),
        (["--model", "llama-3-8b", "--gpu", "h100", "--context", "1", "--qps", "3"], ["--lin"]),
        (["--model", "llama-3-8b", "--gpu", "h100", "--context", "0"], ["context_tokens"]),
        (["--model", "llama-3-8b", "--gpu", "h100", "--context", "9", "--tp", "0"], ["tp"]),
        (["--model", "/no/such/config.json", "--gpu", "h100", "--context", "1"], ["unknown model"]),
        (["--gpu", "h100", "--context", "1"], ["--model"]),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(capsys, argv, message):
    rc, out, err = _run(capsys, "plan", *argv)
    assert rc == 2
    assert out == ""
    for part in message:
        assert part in err


def test_bad_choice_is_rejected_by_argparse(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--model", "llama-3-8b", "--gpu", "h100", "--context", "1", "--units", "octal"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--link-gbps", "0"], "link speed"),
        (["--link-gbytes", "-1"], "link bandwidth"),
        (["--spec-k", "4"], "--spec-acceptance"),
        (["--spec-k", "4", "--spec-acceptance", "1"], "acceptance"),
        (["--decode-batch", "0"], "decode_batch"),
        (["--occupancy-s", "5"], "--concurrency-per-gpu"),
    ],
)
def test_new_flags_refuse_bad_values(capsys, argv, message):
    rc, out, err = _run(capsys, "plan", "--model", "llama-3-8b", "--gpu", "h100", "--context", "4096", *argv)
    assert rc == 2 and out == "" and message in err


def test_any_link_speed_is_accepted(capsys):
    rc, out, _ = _run(
        capsys,
        "plan",
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100",
        "--context",
        "4096",
        "--link-gbps",
        "10",
        "--link-gbps",
        "300",
        "--json",
    )
    assert rc == 0
    assert list(json.loads(out)["results"]["transfer"]["networks"]) == ["10", "300"]


def test_planner_imports_and_runs_without_torch():
    code = (
        "import sys, argparse; sys.modules['torch'] = None\n"
        "from pdserve.planner import cli\n"
        "p = argparse.ArgumentParser(); cli.add_arguments(p)\n"
        "rc = cli.run(p.parse_args(['--model', 'llama-3-8b', '--gpu', 'l4', "
        "'--context', '4096', '--json']))\n"
        "assert rc == 0 and 'torch' not in [m for m in sys.modules if sys.modules[m]]\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_reader_that_leaves_early_ends_the_command_quietly():
    # `pdserve plan ... | head -1`: the write that finds the pipe closed ends the command with the
    # shell's SIGPIPE status and no traceback (here the plan's own run raises as that write would)
    code = (
        "import sys\n"
        "from pdserve.planner import cli\n"
        "def run(args):\n"
        "    print('x' * 10)\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "cli.run = run\n"
        "from pdserve.cli import main\n"
        "sys.exit(main(['plan', '--list']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 141 and "Traceback" not in done.stderr, done.stderr


def test_a_server_command_reports_a_broken_pipe():
    # in serve, router or worker a BrokenPipeError is a fault, not a reader that left
    code = (
        "import sys\n"
        "from pdserve.server import cli\n"
        "def run(args):\n"
        "    raise BrokenPipeError(32, 'Broken pipe')\n"
        "cli.run = run\n"
        "from pdserve.cli import main\n"
        "sys.exit(main(['serve']))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1 and "BrokenPipeError" in done.stderr, done.stderr
