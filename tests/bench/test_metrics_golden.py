"""Golden test of the metric arithmetic: SSE lines with hand-made arrival times, worked out by hand."""

import json

import pytest

from pdserve.bench import metrics
from pdserve.bench.client import RequestOutput, StreamParser


def _sse(obj) -> str:
    return "data: " + json.dumps(obj)


def _text(t, finish=None):
    return _sse({"choices": [{"index": 0, "text": t, "finish_reason": finish}]})


def _usage(p, c):
    return _sse({"choices": [], "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})


def _replay(lines_at, start, chat=False, prompt_len=0, tag="default"):
    out = RequestOutput(prompt_len=prompt_len, tag=tag)
    out.start_s = start
    p = StreamParser(out, start, chat)
    for t, line in lines_at:
        p.feed(line, t)
    p.finish()
    return out


def _three_requests():
    # A: sent at 0; output chunks at 0.10, 0.15, 0.25, 0.30; usage says 4 tokens, 10 prompt tokens.
    a = _replay(
        [
            (0.10, _text("a")),
            (0.15, _text("b")),
            (0.25, ""),
            (0.25, _text("c")),
            (0.30, _text("d", "length")),
            (0.31, _usage(10, 4)),
            (0.31, "data: [DONE]"),
        ],
        0.0,
    )
    # B (chat): sent at 0.5; the role chunk at 0.51 is not a token; content at 0.70 and 0.80.
    b = _replay(
        [
            (0.51, _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})),
            (0.70, _sse({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}]})),
            (0.80, _sse({"choices": [{"index": 0, "delta": {"content": "y"}, "finish_reason": "stop"}]})),
            (0.80, _usage(20, 2)),
        ],
        0.5,
        chat=True,
        tag="chat",
    )
    c = RequestOutput(prompt_len=99, error="HTTP 500: boom")  # failed: counted, never averaged
    return [a, b, c]


def test_stream_timing_by_hand():
    a, b, _ = _three_requests()
    assert a.success and a.ttft_s == pytest.approx(0.10)
    assert a.itl_s == pytest.approx([0.05, 0.10, 0.05])
    assert a.latency_s == pytest.approx(0.30)  # to the last output chunk, not the usage chunk
    assert (a.output_tokens, a.prompt_len) == (4, 10)
    assert b.ttft_s == pytest.approx(0.20) and b.itl_s == pytest.approx([0.10])
    assert b.latency_s == pytest.approx(0.30) and b.output_tokens == 2


def test_summary_by_hand():
    outs = _three_requests()
    r = metrics.result(outs, duration_s=1.0, percentiles=[50, 90, 99, 99.9], goodput={"ttft": 150, "tpot": 90})
    assert (r["completed"], r["failed"]) == (2, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (30, 6)  # the failed prompt is not counted
    assert r["request_throughput"] == pytest.approx(2.0)
    assert r["output_throughput"] == pytest.approx(6.0)
    assert r["total_token_throughput"] == pytest.approx(36.0)
    # TTFT samples 100, 200 ms
    assert r["mean_ttft_ms"] == pytest.approx(150) and r["median_ttft_ms"] == pytest.approx(150)
    assert r["std_ttft_ms"] == pytest.approx(50)  # population std, as numpy and vLLM
    assert r["p90_ttft_ms"] == pytest.approx(190) and r["p99_ttft_ms"] == pytest.approx(199)
    assert r["p99.9_ttft_ms"] == pytest.approx(199.9)
    # TPOT: A (300-100)/(4-1) = 66.67 ms, B (300-200)/(2-1) = 100 ms
    assert r["mean_tpot_ms"] == pytest.approx((200 / 3 + 100) / 2)
    assert r["p99_tpot_ms"] == pytest.approx(200 / 3 + 0.99 * (100 - 200 / 3))
    # ITL samples 50, 100, 50, 100 ms
    assert r["mean_itl_ms"] == pytest.approx(75) and r["median_itl_ms"] == pytest.approx(75)
    assert r["p50_itl_ms"] == pytest.approx(75) and r["p99_itl_ms"] == pytest.approx(100)
    assert r["mean_e2el_ms"] == pytest.approx(300) and r["std_e2el_ms"] == pytest.approx(0)
    # goodput: A meets ttft<=150 and tpot<=90; B misses ttft; C failed
    assert r["request_goodput"] == pytest.approx(1.0)
    assert r["slo_attainment_pct"] == pytest.approx(100 / 3)
    assert r["max_concurrent_requests"] == 1  # A ends at 0.30, B starts at 0.50
    # per-request arrays in vLLM's names, failed requests included
    assert r["input_lens"] == [10, 20, 99] and r["output_lens"] == [4, 2, 0]
    assert r["ttfts"][:2] == pytest.approx([0.10, 0.20]) and r["errors"] == ["", "", "HTTP 500: boom"]
    assert r["error_counts"] == {"HTTP 500: boom": 1}
    assert set(r["by_tag"]) == {"default", "chat"}
    assert r["by_tag"]["chat"]["mean_ttft_ms"] == pytest.approx(200)
    assert r["by_tag"]["default"]["failed"] == 1


def test_one_token_request_has_no_tpot_but_passes_the_tpot_slo():
    one = _replay([(0.2, _text("z", "stop")), (0.2, _usage(5, 1))], 0.0)
    r = metrics.summary([one], 2.0, goodput={"tpot": 1})
    assert r["mean_tpot_ms"] is None and r["mean_itl_ms"] is None  # no sample: None, not 0
    assert r["request_goodput"] == pytest.approx(0.5) and r["slo_attainment_pct"] == 100


def test_without_usage_output_tokens_are_output_chunks():
    out = _replay([(0.1, _text("a")), (0.2, _text("b")), (0.3, _text("", "length"))], 0.0)
    assert out.output_tokens == 3 and not out.usage_reported


@pytest.mark.parametrize(
    "lines, message",
    [
        ([_text("a"), _sse({"error": {"message": "the server shut down", "type": "x"}})], "the server shut down"),
        (["data: [DONE]"], "without any output"),
    ],
)
def test_stream_errors(lines, message):
    from pdserve.bench.client import _StreamError

    out = RequestOutput()
    p = StreamParser(out, 0.0, False)
    with pytest.raises(_StreamError, match=message):
        for i, line in enumerate(lines):
            p.feed(line, 0.1 * (i + 1))
        p.finish()
    assert not out.success


def test_empty_run_reports_none_not_zero():
    r = metrics.result([RequestOutput(error="cannot connect")], 0.5, goodput={"ttft": 1})
    assert r["completed"] == 0 and r["failed"] == 1
    assert r["mean_ttft_ms"] is None and r["p99_tpot_ms"] is None
    assert r["request_goodput"] == 0 and r["slo_attainment_pct"] == 0


@pytest.mark.parametrize("bad", [["ttft"], ["ttfb:10"], ["tpot:x"], ["e2el:-1"]])
def test_goodput_parse_errors(bad):
    with pytest.raises(ValueError, match="--goodput"):
        metrics.parse_goodput(bad)


def test_flag_parsing():
    assert metrics.parse_goodput(["ttft:500", "e2el:1e4"]) == {"ttft": 500.0, "e2el": 10000.0}
    assert metrics.parse_percentiles("50,99.9") == [50.0, 99.9]
    assert metrics.percentile_key(99.0) == "99" and metrics.percentile_key(99.9) == "99.9"
    with pytest.raises(ValueError):
        metrics.parse_percentiles("0,101")
    with pytest.raises(ValueError):
        metrics.parse_metric_names("ttft,foo")
