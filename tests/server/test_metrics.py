"""/metrics parses as Prometheus text and its histograms fill up as requests run."""

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import API_KEY

pytestmark = pytest.mark.integration

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_time_per_output_token_seconds",
]


def scrape(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(family, suffix="", **labels):
    return sum(
        s.value
        for s in family.samples
        if s.name == family.name + suffix and all(s.labels.get(k) == v for k, v in labels.items())
    )


def test_metrics_populated_after_requests(tiny_server):
    before = scrape(tiny_server)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=tiny_server.url, headers=auth, timeout=30) as c:
        for stream in (False, True):
            r = c.post(
                "/v1/completions",
                json={"prompt": "metrics please", "max_tokens": 6, "ignore_eos": True, "stream": stream},
            )
            assert r.status_code == 200
    after = scrape(tiny_server)

    for name in HISTOGRAMS:
        h = after[f"pdserve:{name}"]
        assert h.type == "histogram"
        buckets = [s for s in h.samples if s.name.endswith("_bucket")]
        assert buckets[-1].labels["le"] == "+Inf"
        assert [s.value for s in buckets] == sorted(s.value for s in buckets)  # cumulative
        count = value(h, "_count")
        assert buckets[-1].value == count > 0 and value(h, "_sum") > 0
        assert count >= value(before.get(f"pdserve:{name}", h), "_count")
    assert value(after["pdserve:inter_token_latency_seconds"], "_count") >= 10  # 5 gaps per request
    # one mean time per output token for each of the two requests (each has 5 gaps)
    tpot = "pdserve:request_time_per_output_token_seconds"
    assert value(after[tpot], "_count") - value(before.get(tpot, after[tpot]), "_count") == 2

    assert (
        value(after["pdserve:generation_tokens"], "_total") - value(before["pdserve:generation_tokens"], "_total") == 12
    )
    assert value(after["pdserve:prompt_tokens"], "_total") > value(before["pdserve:prompt_tokens"], "_total")
    success = after["pdserve:request_success"]
    assert (
        value(success, "_total", finished_reason="length")
        - value(before["pdserve:request_success"], "_total", finished_reason="length")
        == 2
    )
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"pdserve:{gauge}"].type == "gauge"
    assert 0.0 <= value(after["pdserve:kv_cache_usage_perc"]) <= 1.0
    assert value(after["pdserve:prefix_cache_queries"], "_total") > 0
    assert after["pdserve:prefix_cache_hits"].type == "counter"
    assert all(s.labels.get("model_name") == "tiny" for f in after.values() for s in f.samples)
