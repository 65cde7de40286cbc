"""The metric arithmetic of `vllm bench serve`, on measured `RequestOutput`s.

Only completed requests enter the latency statistics and the token counts;
failed ones are counted in `failed`. Per request: TTFT is the time to the
first output chunk; TPOT = (E2E - TTFT) / (output_tokens - 1), defined for
requests with more than one output token; each gap between output chunks is
one ITL sample; E2E is send to last output chunk. Throughputs divide by the
benchmark duration (first send to last completion). A request is "good" when
it meets every SLO given to `--goodput`; for that test a one-token request's
TPOT counts as 0. Percentiles interpolate linearly (numpy's default, as vLLM).
Statistics of an empty sample are None, not 0: no data is not a fast server.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90, 99)  # besides mean, median and std, which are always there


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput {item!r}: expected NAME:MS with NAME one of {', '.join(GOODPUT_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0:
            raise ValueError(f"--goodput {item!r}: the SLO must be >= 0 ms")
        slos[name] = ms
    return slos


def parse_percentiles(text: str) -> list[float]:
    try:
        ps = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--metric-percentiles {text!r}: expected numbers like 50,90,99") from None
    if not ps or not all(0 < p < 100 or p == 100 for p in ps):
        raise ValueError(f"--metric-percentiles {text!r}: each percentile must be in (0, 100]")
    return ps


def parse_metric_names(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in METRICS]
    if bad or not names:
        raise ValueError(f"--percentile-metrics {text!r}: choose from {', '.join(METRICS)}")
    return names


def percentile_key(p: float) -> str:
    """99 -> "99", 99.9 -> "99.9": the `p99_ttft_ms` / `p99.9_ttft_ms` naming of vLLM."""
    return str(int(p)) if int(p) == p else str(p)


def tpot_s(out) -> float | None:
    return (out.latency_s - out.ttft_s) / (out.output_tokens - 1) if out.output_tokens > 1 else None


def summary(
    outputs: list,
    duration_s: float,
    *,
    percentiles=DEFAULT_PERCENTILES,
    percentile_metrics=METRICS,
    goodput: dict[str, float] | None = None,
) -> dict:
    """Aggregate metrics with vLLM's field names (times in ms, throughputs per second)."""
    done = [o for o in outputs if o.success]
    samples = {
        "ttft": [o.ttft_s for o in done],
        "tpot": [t for o in done if (t := tpot_s(o)) is not None],
        "itl": [x for o in done for x in o.itl_s],
        "e2el": [o.latency_s for o in done],
    }
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    res = {
        "duration": duration_s,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": per_s(len(done)),
        "request_goodput": None,
        "output_throughput": per_s(total_out),
        "total_token_throughput": per_s(total_in + total_out),
        "goodput_slos_ms": dict(goodput) if goodput else None,
        "slo_attainment_pct": None,
        "max_concurrent_requests": _max_concurrent(done),
    }
    if goodput:
        good = sum(_meets(o, goodput) for o in done)
        res["request_goodput"] = per_s(good)
        res["slo_attainment_pct"] = 100.0 * good / len(outputs) if outputs else None
    for name in percentile_metrics:
        ms = np.asarray(samples[name], dtype=float) * 1000.0
        empty = ms.size == 0
        res[f"mean_{name}_ms"] = None if empty else float(ms.mean())
        res[f"median_{name}_ms"] = None if empty else float(np.median(ms))
        res[f"std_{name}_ms"] = None if empty else float(ms.std())
        for p in percentiles:
            res[f"p{percentile_key(p)}_{name}_ms"] = None if empty else float(np.percentile(ms, p))
    return res


def _meets(out, slos_ms: dict[str, float]) -> bool:
    values_s = {"ttft": out.ttft_s, "tpot": tpot_s(out) or 0.0, "e2el": out.latency_s}
    return all(values_s[name] * 1000.0 <= limit for name, limit in slos_ms.items())


def _max_concurrent(done: list) -> int:
    """Most requests in flight at once (send to last output), a check on the arrival settings."""
    events = sorted(
        [(o.start_s, 1) for o in done] + [(o.start_s + o.latency_s, -1) for o in done], key=lambda e: (e[0], e[1])
    )
    best = cur = 0
    for _, step in events:
        cur += step
        best = max(best, cur)
    return best


def result(
    outputs: list,
    duration_s: float,
    *,
    percentiles=DEFAULT_PERCENTILES,
    percentile_metrics=METRICS,
    goodput: dict[str, float] | None = None,
) -> dict:
    """`summary` plus vLLM's per-request arrays, ours (start times, tags), an error
    count by message, and a summary per tag when the workload has several."""
    kw = dict(percentiles=percentiles, percentile_metrics=percentile_metrics, goodput=goodput)
    res = summary(outputs, duration_s, **kw)
    res.update(
        input_lens=[o.prompt_len for o in outputs],
        output_lens=[o.output_tokens if o.success else 0 for o in outputs],
        ttfts=[o.ttft_s for o in outputs],
        itls=[o.itl_s for o in outputs],
        e2els=[o.latency_s for o in outputs],
        start_times=[o.start_s for o in outputs],
        tags=[o.tag for o in outputs],
        errors=[o.error for o in outputs],
        error_counts=dict(Counter(o.error for o in outputs if not o.success).most_common()),
        percentiles=list(percentiles),
    )
    tags = list(dict.fromkeys(o.tag for o in outputs))
    if len(tags) > 1:
        res["by_tag"] = {t: summary([o for o in outputs if o.tag == t], duration_s, **kw) for t in tags}
    return res
