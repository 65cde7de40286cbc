"""Profiles from served steps: the step trace a server writes, and the fit on it."""

import asyncio
import json
import time

import pytest

from pdserve.bench.tokens import TokenSource
from pdserve.cli import main
from pdserve.engine.step_trace import read
from pdserve.sim.calibrate import _busy_share, drive_grid, fit_trace, trace_samples
from pdserve.sim.latency import ProfileLatency
from tests.server.serverproc import ServerProcess
from tests.tiny import write_tiny_model


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail)


def test_trace_reader_skips_a_torn_last_line_and_names_any_other_bad_line(tmp_path):
    p = tmp_path / "steps.jsonl"
    recs = [
        {"t0": 1.0, "t1": 1.2, "idle": True, "seqs": [[0, 32, 0]]},
        {"t0": 1.25, "t1": 1.3, "idle": False, "seqs": [[32, 1, 1]]},
    ]
    _write(p, recs, tail='{"t0": 1.4, "t1"')  # a server killed mid-write
    assert [r["t0"] for r in read(str(p))] == [1.0, 1.25]
    assert [r["t0"] for r in read(str(p), since=1.1)] == [1.25]
    _write(p, [recs[0], {"t0": 2.0, "t1": 1.0, "seqs": []}, recs[1]])
    with pytest.raises(ValueError, match=r"steps.jsonl:2: .*t1 before t0"):
        read(str(p))


def test_a_step_lasts_until_the_next_one_starts_unless_the_engine_went_idle():
    recs = [
        {"t0": 10.0, "t1": 10.5, "idle": True, "seqs": [[0, 100, 0]]},
        {"t0": 10.6, "t1": 10.65, "idle": False, "seqs": [[100, 1, 1], [0, 20, 0]]},
        {"t0": 10.7, "t1": 10.74, "idle": False, "seqs": [[101, 1, 1], [20, 1, 1]]},
        {"t0": 20.0, "t1": 20.03, "idle": True, "seqs": [[5, 1, 1]]},
    ]
    samples = trace_samples(recs)
    # the server's work between two steps is part of what a stream waits between two tokens
    assert [round(t, 3) for _, t in samples] == [0.6, 0.1, 0.04, 0.03]
    shape = samples[1][0]
    assert (shape.prefill_tokens, shape.decode_seqs, shape.decode_context) == (20, 1, 100)
    assert (samples[2][0].decode_seqs, samples[2][0].decode_context) == (2, 121)


def test_a_prefill_profile_beside_a_decode_pool_keeps_only_the_steps_it_served_beside(tmp_path):
    """fit_trace(beside=...): steps taken while the other engine was idle are left out, except
    steps of few rows."""
    prefill, decode = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    p_recs, d_recs = [], []
    for i in range(40):  # prompts of 64 tokens; the first 20 alone, the rest beside decoding
        t0 = 100.0 + i
        slow = i >= 20
        p_recs.append({"t0": t0, "t1": t0 + (0.40 if slow else 0.30), "idle": True, "seqs": [[0, 64 + i % 4, 0]]})
        if slow:
            d_recs += [
                {"t0": t0 + k * 0.05, "t1": t0 + k * 0.05 + 0.045, "idle": False, "seqs": [[70, 1, 1]]}
                for k in range(10)
            ]
    # a few 8-token prompts (the tiled kernels' rows) with the decode worker idle: kept all the same,
    # the only samples of that regime
    p_recs += [{"t0": 200.0 + i, "t1": 200.08 + i, "idle": True, "seqs": [[0, 8, 0]]} for i in range(3)]
    _write(prefill, p_recs)
    _write(decode, d_recs)
    assert _busy_share(p_recs[19:21], d_recs) == [0.0, pytest.approx(0.9)]
    alone = fit_trace([str(prefill)], since=0, until=1e9, log=lambda m: None)
    served = fit_trace([str(prefill)], since=0, until=1e9, beside=[str(decode)], log=lambda m: None)
    shape = trace_samples(p_recs[:1])[0][0]
    assert alone.step_s(shape) == pytest.approx(0.35, rel=0.05)  # an average of both kinds
    assert served.step_s(shape) == pytest.approx(0.40, rel=0.02) and len(served.samples) == 23
    assert served.step_s(trace_samples(p_recs[-1:])[0][0]) == pytest.approx(0.08, rel=0.05)


@pytest.mark.parametrize("limit", [2, 16])
def test_a_trace_fit_finds_where_the_engine_left_its_gguf_kernels(tmp_path, limit):
    """A trace does not say the engine's dtype, so not where its steps leave the GGUF kernels
    (16 rows in float32, 2 in bfloat16): the fit tries both and keeps the one the steps follow."""
    truth = ProfileLatency(
        [0.004, 0.0, 0.002, 0.0, 0.0, 0.0, 0.006, 0.020], row_tile=4, tile_max_rows=limit, model_layers=1
    )
    recs, t = [], 100.0
    for batch in list(range(1, 17)) * 3:
        shape = trace_samples([{"t0": 0, "t1": 1, "idle": True, "seqs": [[50, 1, 1]] * batch}])[0][0]
        dt = truth.step_s(shape)
        recs.append({"t0": t, "t1": t + dt, "idle": True, "seqs": [[50, 1, 1]] * batch})
        t += dt + 1.0
    path = tmp_path / "steps.jsonl"
    _write(path, recs)
    said = []
    prof = fit_trace([str(path)], since=0, until=1e9, log=said.append)
    assert prof.tile_max_rows == limit, said
    assert any("kept" in m for m in said)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-cal")), max_pos=1024)


@pytest.mark.integration
def test_served_grid_is_traced_by_the_server_and_fitted(tiny_dir, tmp_path, capsys):
    trace = tmp_path / "steps.jsonl"
    with ServerProcess(
        "--model", tiny_dir, "--threads", "1", "--max-num-batched-tokens", "256", "--step-trace", str(trace)
    ) as server:
        since = time.monotonic()
        asyncio.run(drive_grid(server.url, TokenSource.from_path(tiny_dir), log=lambda m: None, background_streams=2))
        until = time.monotonic()
    recs = read(str(trace), since, until)
    # the background streams decode beside the grid's prompts, and stop for its decode batches,
    # which therefore run at their own sizes: 1 sequence alone for the (1, 64) and (1, 512) batches
    decode_only = [len(r["seqs"]) for r in recs if r["seqs"] and all(d for _, _, d in r["seqs"])]
    assert decode_only.count(1) >= 10
    assert any(
        sum(d for _, _, d in r["seqs"]) >= 2 and [0, 128, 0] in r["seqs"] for r in recs
    )  # the grid's 128-token prompt prefilled beside both streams
    # every prompt of the grid was computed, in the server, inside the window (chunked by the budget)
    prefilled = sum(n for r in recs for _, n, decode in r["seqs"] if not decode)
    assert prefilled >= 2 * (32 + 128 + 512 + 999) + 8 * 64
    assert max(sum(n for _, n, _ in r["seqs"]) for r in recs) <= 256
    assert any(len(r["seqs"]) == 8 and all(d for _, _, d in r["seqs"]) for r in recs)  # a decode batch of 8
    assert all(r["t1"] >= r["t0"] for r in recs) and any(not r["idle"] for r in recs)
    # the engine thread's own CPU time: one torch thread runs the step on it, so it is most of the
    # step, and never much more than the wall time
    assert all(0 <= r["cpu"] <= (r["t1"] - r["t0"]) * 1.05 + 2e-3 for r in recs)
    assert sum(r["cpu"] for r in recs) > 0.3 * sum(r["t1"] - r["t0"] for r in recs)

    out = tmp_path / "prof.json"
    assert (
        main(
            [
                "sim",
                "--calibrate",
                "--from-trace",
                str(trace),
                "--model",
                tiny_dir,
                "--threads",
                "1",
                "--profile",
                str(out),
            ]
        )
        == 0
    )
    prof = ProfileLatency.load(str(out))
    assert prof.model_layers == 2 and len(prof.samples) >= 50
    assert prof.decode_steps_s(8, 8 * 512, 1)[0] >= prof.decode_steps_s(1, 64, 1)[0] > 0
    capsys.readouterr()
    assert (
        main(
            [
                "sim",
                "--profile",
                str(out),
                "--mode",
                "collocated",
                "--dataset-name",
                "random",
                "--num-prompts",
                "8",
                "--random-input-len",
                "64",
                "--random-output-len",
                "8",
                "--json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["completed"] == 8


@pytest.mark.integration
def test_step_trace_path_that_cannot_be_written_is_refused_at_start(tmp_path):
    server = ServerProcess("--step-trace", str(tmp_path / "missing" / "steps.jsonl"), wait_ready=False)
    try:
        assert server.proc.wait(60) == 2
        assert "--step-trace" in server.log() and "No such file" in server.log()
    finally:
        server.stop()


def test_from_trace_with_too_few_steps_says_so(tmp_path, capsys):
    p = tmp_path / "steps.jsonl"
    _write(p, [{"t0": 1.0, "t1": 1.1, "idle": True, "seqs": [[0, 8, 0]]}])
    assert main(["sim", "--calibrate", "--from-trace", str(p), "--profile", str(tmp_path / "x.json")]) == 2
    assert "a fit needs at least 8" in capsys.readouterr().err
