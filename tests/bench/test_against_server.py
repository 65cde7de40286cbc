"""`pdserve bench` against a real `pdserve serve` (tiny model): results, workloads and bad input."""

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench import RunState, TokenSource, datasets, run_benchmark
from pdserve.bench.client import BenchError
from pdserve.cli import main
from pdserve.ports import free_port
from tests.bench.conftest import Server
from tests.data import MOONCAKE_SAMPLE

VLLM_FIELDS = [
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "errors",
] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el") for s in ("mean", "median", "std", "p90", "p99")]


@pytest.fixture(scope="module")
def tokens(tiny_model_dir):
    return TokenSource.from_path(tiny_model_dir)


def _prefix_cache_hits(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5, trust_env=False).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdserve:prefix_cache_hits") and "_created" not in line
    )


@pytest.mark.integration
def test_cli_random_run_writes_json_and_plots(bench_server, tiny_model_dir, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc = main(
        [
            "bench",
            "--base-url",
            bench_server.url,
            "--tokenizer",
            tiny_model_dir,
            "--num-prompts",
            "12",
            "--random-input-len",
            "24",
            "--random-output-len",
            "8",
            "--ignore-eos",
            "--request-rate",
            "40",
            "--max-concurrency",
            "4",
            "--goodput",
            "ttft:60000",
            "tpot:60000",
            "--disable-tqdm",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            "r.json",
            "--plot",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "Serving Benchmark Result" in out and "P99 ITL (ms):" in out
    r = json.loads((tmp_path / "r.json").read_text())
    assert all(f in r for f in VLLM_FIELDS)
    assert (r["completed"], r["failed"], r["errors"]) == (12, 0, [""] * 12)
    assert r["input_lens"] == [24] * 12 and r["output_lens"] == [8] * 12  # ids sent as is; usage counts
    assert r["total_output_tokens"] == 96 and r["request_goodput"] == pytest.approx(r["request_throughput"])
    assert r["slo_attainment_pct"] == 100 and 1 <= r["max_concurrent_requests"] <= 4
    assert r["model_id"] == "tiny" and r["request_rate"] == 40 and r["dataset_name"] == "random"
    assert all(t > 0 for t in r["ttfts"]) and all(len(x) >= 1 for x in r["itls"])
    for name in ("r_cdf.png", "r_timeline.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    os.remove(tmp_path / "r_cdf.png")
    assert main(["bench", "--replot", str(tmp_path / "r.json")]) == 0
    assert (tmp_path / "r_cdf.png").exists()


@pytest.mark.integration
def test_chat_endpoint_with_text_prompts(bench_server, tokens):
    reqs = datasets.random(4, 16, 6, tokens, seed=1, as_text=True)
    r = run_benchmark(reqs, bench_server.url, endpoint="/v1/chat/completions", ignore_eos=True)
    assert r["completed"] == 4 and r["output_lens"] == [6] * 4
    assert all(n > 16 for n in r["input_lens"])  # the server's count, chat template included


@pytest.mark.integration
def test_mixed_workload_limits_chat_streams_and_keeps_burst_times(bench_server, tokens):
    cfg = datasets.MixedConfig(
        num_chats=10,
        chat_input_len=12,
        chat_output_len=12,
        chat_streams=3,
        long_input_len=300,
        long_output_len=2,
        burst_size=1,
        num_bursts=2,
        burst_interval_s=0.2,
        first_burst_s=0.1,
    )
    r = run_benchmark(
        datasets.mixed(cfg, tokens),
        bench_server.url,
        tag_concurrency=cfg.tag_concurrency(),
        ignore_eos=True,
        goodput={"tpot": 60000},
    )
    assert r["completed"] == 12 and set(r["by_tag"]) == {"chat", "long"}
    assert r["by_tag"]["chat"]["completed"] == 10 and r["by_tag"]["long"]["completed"] == 2
    assert r["by_tag"]["chat"]["max_concurrent_requests"] <= 3
    long_starts = sorted(s for s, t in zip(r["start_times"], r["tags"]) if t == "long")
    # on their own clock (0.1 s, 0.3 s), never early and not queued behind the chats (a loaded
    # 2-core machine may delay the client's sends by a few hundred ms: CI once saw 0.34 s for 0.1 s)
    for start, due in zip(long_starts, (0.1, 0.3)):
        assert due - 0.01 <= start < due + 0.5, long_starts
    assert [n for n, t in zip(r["input_lens"], r["tags"]) if t == "long"] == [300, 300]


@pytest.mark.integration
def test_closed_loop_runs_for_a_duration_not_a_count(bench_server, tokens):
    """send_until_s: chat users stop sending after it; the unsent are left out and the arrays
    say which requests they describe (the bursts, which have their own times, still go)."""
    cfg = datasets.MixedConfig(
        num_chats=500,
        chat_input_len=12,
        chat_output_len=12,
        chat_streams=2,
        long_input_len=50,
        long_output_len=2,
        num_bursts=1,
        first_burst_s=0.3,
    )
    reqs = datasets.mixed(cfg, tokens)
    r = run_benchmark(reqs, bench_server.url, tag_concurrency=cfg.tag_concurrency(), ignore_eos=True, send_until_s=0.6)
    assert r["failed"] == 0 and 0 < r["num_unsent"] < 500
    assert len(r["request_indices"]) == r["completed"] == len(r["ttfts"]) == 500 + 1 - r["num_unsent"]
    assert [reqs[i].tag for i in r["request_indices"]] == r["tags"] and r["tags"].count("long") == 1
    assert max(s for s, t in zip(r["start_times"], r["tags"]) if t == "chat") <= 0.6 + 0.05


@pytest.mark.integration
def test_mooncake_replay_shares_prefixes_and_counts_server_errors(bench_server, tokens, tmp_path):
    lines = Path(MOONCAKE_SAMPLE).read_text().splitlines(keepends=True)[:8]
    huge = json.loads(lines[3])
    huge["input_length"] = 10**6  # beyond the tiny model's 512 positions: the server refuses this one
    lines[3] = json.dumps(huge) + "\n"
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(lines))
    sc = datasets.MooncakeScaling(block_tokens=4, output_scale=0.01, time_scale=0.001)
    reqs = datasets.mooncake(str(path), 8, tokens, scaling=sc)
    before = _prefix_cache_hits(bench_server.url)
    r = run_benchmark(reqs, bench_server.url, ignore_eos=True)
    assert (r["completed"], r["failed"]) == (7, 1)
    assert r["errors"][3].startswith("HTTP 400") and "HTTP 400" in next(iter(r["error_counts"]))
    assert r["output_lens"][3] == 0 and r["total_input_tokens"] == sum(q.prompt_len for q in reqs) - reqs[3].prompt_len
    assert _prefix_cache_hits(bench_server.url) > before  # hash id 0 opens every conversation


def test_unreachable_endpoint_is_a_clear_error(capsys):
    rc = main(["bench", "--base-url", f"http://127.0.0.1:{free_port()}", "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 1
    assert "cannot connect to http://127.0.0.1:" in capsys.readouterr().err


@pytest.mark.integration
def test_unknown_model_and_bad_flags(bench_server, tiny_model_dir, tmp_path, capsys):
    with pytest.raises(BenchError, match="does not serve 'nope'"):
        run_benchmark(datasets.random(1, 4, 2, TokenSource()), bench_server.url, model="nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 2, "hash_ids": [0]}\n{"timestamp": 1,\n')
    rc = main(["bench", "--base-url", bench_server.url, "--dataset-name", "mooncake", "--dataset-path", str(bad)])
    assert rc == 2 and f"{bad}:2: not valid JSON" in capsys.readouterr().err
    rc = main(["bench", "--base-url", bench_server.url, "--goodput", "ttft=5"])
    assert rc == 2 and "--goodput" in capsys.readouterr().err


@pytest.mark.integration
def test_api_key_and_server_going_away_mid_run(tiny_model_dir, tokens):
    # no grace: whatever is in flight at SIGTERM is cut at once (with any grace, a fast
    # machine finishes the streams inside it and nothing is cut)
    server = Server(tiny_model_dir, "--shutdown-timeout", "0", "--api-key", "k")
    state = RunState([])
    result = {}
    try:
        reqs = datasets.random(16, 8, 400, tokens, seed=2)
        with pytest.raises(BenchError, match="wants an API key"):
            run_benchmark(reqs, server.url)
        t = threading.Thread(
            target=lambda: result.update(
                run_benchmark(reqs, server.url, api_key="k", ignore_eos=True, max_concurrency=2, state=state)
            )
        )
        t.start()
        deadline = time.monotonic() + 60

        def streaming() -> bool:  # a request is in flight, mid-stream, when the server goes
            return any(o.ttft_s > 0 and not o.success and not o.error for o in state.outputs)

        while not (sum(o.success for o in state.outputs) >= 2 and streaming()) and time.monotonic() < deadline:
            time.sleep(0.005)
        server.stop()  # SIGTERM mid-run
        t.join(60)
        assert not t.is_alive()
    finally:
        server.stop()
    assert result["completed"] >= 2 and result["failed"] >= 1
    assert result["completed"] + result["failed"] == 16
    errors = " | ".join(result["error_counts"])
    # in flight: the server's error event or a cut connection, depending on how it shuts down
    assert any(
        m in errors
        for m in (
            "error event mid-stream",
            "connection to the server broke",
            "closed the connection before the response ended",
        )
    ), errors
    assert "cannot connect" in errors or "HTTP 503" in errors, errors  # the ones sent after
    assert all(n == 400 for n, e in zip(result["output_lens"], result["errors"]) if not e)


@pytest.mark.integration
def test_mixed_against_disaggregated_serving(tiny_model_dir, tokens):
    """The interference experiment's case (c): the same client against router + 1 prefill + 1 decode worker."""
    server = Server(tiny_model_dir, "--prefill", "1", "--decode", "1", mode="disaggregated")
    try:
        cfg = datasets.MixedConfig(
            num_chats=6,
            chat_input_len=12,
            chat_output_len=8,
            chat_streams=3,
            long_input_len=300,
            long_output_len=2,
            num_bursts=1,
            first_burst_s=0.05,
        )
        r = run_benchmark(
            datasets.mixed(cfg, tokens), server.url, tag_concurrency=cfg.tag_concurrency(), ignore_eos=True
        )
    finally:
        server.stop()
    assert (r["completed"], r["failed"]) == (7, 0), r["error_counts"]
    assert r["by_tag"]["chat"]["completed"] == 6 and r["output_lens"].count(8) == 6
