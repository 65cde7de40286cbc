"""The table, the JSON file, the plots and an interrupted run's result, from hand-made outputs."""

import json
import math

import pytest

from pdserve.bench import metrics, report
from pdserve.bench.client import RequestOutput
from pdserve.bench.runner import Progress, RunState, finish


def _outputs():
    outs = []
    for i in range(6):
        o = RequestOutput(
            prompt_len=10,
            output_tokens=5,
            success=True,
            ttft_s=0.05 + 0.01 * i,
            itl_s=[0.02, 0.02, 0.5 if i == 2 else 0.02, 0.02],
            start_s=0.1 * i,
            tag="chat",
        )
        o.latency_s = o.ttft_s + sum(o.itl_s)
        outs.append(o)
    outs.append(
        RequestOutput(prompt_len=400, output_tokens=1, success=True, ttft_s=0.4, latency_s=0.4, start_s=0.2, tag="long")
    )
    outs.append(RequestOutput(prompt_len=400, error="HTTP 400: too long", tag="long", start_s=0.3))
    return outs


def test_summary_table_and_json(tmp_path):
    r = metrics.result(_outputs(), 2.0, percentiles=[50, 99], goodput={"tpot": 100})
    r["request_rate"] = math.inf
    text = report.format_summary(r)
    assert "Successful requests:                     7" in text
    assert "P99 TPOT (ms):" in text and "SLO attainment (%):" in text
    assert "chat" in text and "long" in text and "1 x HTTP 400: too long" in text
    path = report.save_json(r, str(tmp_path / "sub" / "r.json"))
    back = json.loads(open(path).read())
    assert back["request_rate"] == "inf" and back["completed"] == 7 and back["by_tag"]["long"]["failed"] == 1
    assert (
        report.default_filename({"model_id": "/m/smollm/", "request_rate": 2.0, "max_concurrency": 4}, "mixed", "D")
        == "pdserve-mixed-2.0qps-concurrency4-smollm-D.json"
    )


def test_plots_are_pngs(tmp_path):
    pytest.importorskip("matplotlib")
    from pdserve.bench.plots import save_plots, token_times

    r = metrics.result(_outputs(), 2.0)
    times = token_times(r)
    assert times[0].tolist() == pytest.approx([0.05, 0.07, 0.09, 0.11, 0.13])
    assert times[-1].size == 0  # the failed request never streamed
    for p in save_plots(r, str(tmp_path), "x", "title"):
        assert open(p, "rb").read(4) == b"\x89PNG"


def test_interrupted_run_keeps_what_finished():
    outs = _outputs()[:3] + [RequestOutput(tag="chat"), RequestOutput(tag="chat", error="HTTP 503: x")]
    state = RunState(outs, start=0.0, end=1.5, interrupted=True, config={"model_id": "m"})
    r = finish(state)
    assert r["interrupted"] and r["completed"] == 3 and r["failed"] == 2 and r["duration"] == 1.5
    assert r["errors"][3:] == ["interrupted before it finished", "HTTP 503: x"]
    assert "INTERRUPTED" in report.format_summary(r)


def test_plain_progress_line(capsys, monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr(
        builtins,
        "__import__",
        lambda name, *a, **k: (_ for _ in ()).throw(ImportError()) if name == "tqdm" else real_import(name, *a, **k),
    )
    bar = Progress(2, enabled=True)
    bar.update(RequestOutput(success=True))
    bar.update(RequestOutput(error="x"))
    bar.close()
    assert "2/2 requests done, 1 failed" in capsys.readouterr().err
