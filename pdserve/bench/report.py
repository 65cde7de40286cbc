"""The result as a terminal table (the layout of `vllm bench serve`) and as a JSON file."""

from __future__ import annotations

import json
import math
import os

from pdserve.bench.metrics import percentile_key

_TITLES = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}
_W = 50


def _line(label: str, value, fmt: str = ".2f") -> str:
    if value is None:
        text = "n/a"
    elif isinstance(value, float):
        text = format(value, fmt)
    else:
        text = str(value)
    return f"{label:<40} {text:<10}"


def format_summary(result: dict, percentile_metrics=("ttft", "tpot", "itl", "e2el")) -> str:
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_W, c="=")]
    if result.get("interrupted"):
        lines.append("INTERRUPTED: partial results, unfinished requests count as failed")
    lines += [
        _line("Successful requests:", result["completed"]),
        _line("Failed requests:", result["failed"]),
        _line("Benchmark duration (s):", result["duration"]),
        _line("Total input tokens:", result["total_input_tokens"]),
        _line("Total generated tokens:", result["total_output_tokens"]),
        _line("Request throughput (req/s):", result["request_throughput"]),
    ]
    if result.get("goodput_slos_ms"):
        slos = " ".join(f"{k}:{v:g}" for k, v in result["goodput_slos_ms"].items())
        lines += [
            _line(f"Request goodput (req/s) [{slos}]:", result["request_goodput"]),
            _line("SLO attainment (%):", result["slo_attainment_pct"]),
        ]
    lines += [
        _line("Output token throughput (tok/s):", result["output_throughput"]),
        _line("Total token throughput (tok/s):", result["total_token_throughput"]),
        _line("Max concurrent requests:", result["max_concurrent_requests"]),
    ]
    for name in percentile_metrics:
        if f"mean_{name}_ms" not in result:
            continue
        lines.append("{s:{c}^{n}}".format(s=_TITLES[name], n=_W, c="-"))
        up = name.upper()
        lines += [
            _line(f"Mean {up} (ms):", result[f"mean_{name}_ms"]),
            _line(f"Median {up} (ms):", result[f"median_{name}_ms"]),
        ]
        for p in result.get("percentiles", []):
            k = percentile_key(p)
            lines.append(_line(f"P{k} {up} (ms):", result[f"p{k}_{name}_ms"]))
    lines.append("=" * _W)
    if result.get("by_tag"):
        lines += _tag_table(result)
    if result.get("error_counts"):
        lines.append(f"errors ({result['failed']} failed requests):")
        for msg, n in list(result["error_counts"].items())[:5]:
            lines.append(f"  {n:>6} x {msg}")
        if len(result["error_counts"]) > 5:
            lines.append(f"  ... and {len(result['error_counts']) - 5} other messages (see 'errors' in the JSON)")
    return "\n".join(lines)


def _tag_table(result: dict) -> list[str]:
    cols = [
        ("done", "completed", "d"),
        ("failed", "failed", "d"),
        ("TTFT mean", "mean_ttft_ms", ".1f"),
        ("TTFT P99", "p99_ttft_ms", ".1f"),
        ("TPOT P50", "median_tpot_ms", ".1f"),
        ("TPOT P99", "p99_tpot_ms", ".1f"),
        ("ITL P50", "median_itl_ms", ".1f"),
        ("ITL P99", "p99_itl_ms", ".1f"),
    ]
    if result.get("goodput_slos_ms"):
        cols.append(("SLO %", "slo_attainment_pct", ".1f"))
    head = f"{'per tag (ms)':<12}" + "".join(f"{c[0]:>11}" for c in cols)
    rows = [head]
    for tag, s in result["by_tag"].items():
        cells = []
        for _, key, fmt in cols:
            v = s.get(key)
            cells.append(f"{'n/a' if v is None else format(v, fmt):>11}")
        rows.append(f"{tag:<12}" + "".join(cells))
    return rows


def default_filename(result: dict, dataset_name: str, date: str) -> str:
    """`pdserve-<dataset>-<rate>qps[-concurrency<N>]-<model>-<date>.json`, after vLLM's naming."""
    model = os.path.basename(str(result.get("model_id", "model")).rstrip("/")) or "model"
    conc = f"-concurrency{result['max_concurrency']}" if result.get("max_concurrency") else ""
    return f"pdserve-{dataset_name}-{result.get('request_rate')}qps{conc}-{model}-{date}.json"


def save_json(result: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_finite(result), f, indent=1, allow_nan=False)
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def _finite(obj):
    """inf/nan are not JSON: write them as strings, as vLLM writes an infinite request rate."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
