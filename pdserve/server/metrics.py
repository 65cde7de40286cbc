"""Prometheus metrics with vLLM's meanings under a `pdserve:` prefix.

Latency histograms are fed per request by whoever sees the token stream (the
worker's server here, the router later); engine-wide gauges and counters
(running/waiting, KV usage, prefix-cache tokens, preemptions) are mirrored at
scrape time from the engine's latest stats snapshot, so the engine loop never
touches prometheus_client.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _geometric(start: float, factor: float, count: int) -> list[float]:
    return [round(start * factor ** i, 6) for i in range(count)]


# Our own bucket choices: wide enough for a CPU trial box (seconds per token)
# and a GPU node (milliseconds per token) alike.
LATENCY_BUCKETS_S = _geometric(0.001, 2.0, 22)  # 1 ms .. ~35 min
TOKEN_GAP_BUCKETS_S = _geometric(0.0005, 1.6, 24)  # 0.5 ms .. ~25 s
TOKEN_COUNT_BUCKETS = _geometric(1, 2.0, 20)  # 1 .. 512k tokens


class ServerMetrics:
    """One registry per server process; `render()` is the /metrics body."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        # `_created` series double the scrape size and no dashboard reads them
        disable_created_metrics()
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._stats: dict | None = None
        labels = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("pdserve:time_to_first_token_seconds",
                         "Time from arrival to the first generated token.", LATENCY_BUCKETS_S)
        self.itl = hist("pdserve:inter_token_latency_seconds",
                        "Time between consecutive generated tokens of a request.", TOKEN_GAP_BUCKETS_S)
        self.e2e = hist("pdserve:e2e_request_latency_seconds",
                        "Time from arrival to the last token of a request.", LATENCY_BUCKETS_S)
        self.queue = hist("pdserve:request_queue_time_seconds",
                          "Time a request waited before it was first scheduled.", LATENCY_BUCKETS_S)
        self.prefill = hist("pdserve:request_prefill_time_seconds",
                            "Time from first scheduled to first token.", LATENCY_BUCKETS_S)
        self.decode = hist("pdserve:request_decode_time_seconds",
                           "Time from first token to last token.", LATENCY_BUCKETS_S)
        self.req_prompt = hist("pdserve:request_prompt_tokens", "Prompt tokens per request.",
                               TOKEN_COUNT_BUCKETS)
        self.req_generation = hist("pdserve:request_generation_tokens", "Generated tokens per request.",
                                   TOKEN_COUNT_BUCKETS)
        self.prompt_tokens = Counter("pdserve:prompt_tokens", "Prompt tokens processed.", labels,
                                     registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("pdserve:generation_tokens", "Tokens generated.", labels,
                                         registry=self.registry).labels(model_name)
        self.success = Counter("pdserve:request_success", "Finished requests by finish reason.",
                               labels + ["finished_reason"], registry=self.registry)
        self.rejected = Counter("pdserve:request_rejected", "Requests refused by admission control.",
                                labels, registry=self.registry).labels(model_name)
        for reason in ("stop", "length", "abort"):  # present from the start, at zero
            self.success.labels(model_name, reason)
        self.registry.register(_EngineStatsCollector(self))

    # ---- fed by the request stream
    def on_first_token(self, arrival_s: float, scheduled_s: float | None, first_token_s: float,
                       num_prompt_tokens: int) -> None:
        self.ttft.observe(first_token_s - arrival_s)
        if scheduled_s is not None:
            self.queue.observe(max(0.0, scheduled_s - arrival_s))
            self.prefill.observe(max(0.0, first_token_s - scheduled_s))
        self.prompt_tokens.inc(num_prompt_tokens)
        self.req_prompt.observe(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        if gap_s is not None:
            self.itl.observe(gap_s)

    def on_finish(self, reason: str, arrival_s: float, first_token_s: float | None, last_token_s: float | None,
                  num_generated_tokens: int) -> None:
        self.success.labels(self.model_name, reason).inc()
        if last_token_s is not None:
            self.e2e.observe(last_token_s - arrival_s)
            if first_token_s is not None:
                self.decode.observe(last_token_s - first_token_s)
        self.req_generation.observe(num_generated_tokens)

    # ---- engine-wide state, mirrored at scrape time
    def set_engine_stats(self, stats: dict | None) -> None:
        self._stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineStatsCollector:
    """Gauges and counters the engine already keeps; re-reporting them avoids double bookkeeping."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []  # values appear only once an engine has reported

    def collect(self):
        s, name = self.m._stats, self.m.model_name
        if not s:
            return
        gauges = (("pdserve:num_requests_running", "Requests in the running batch.", s["num_running"]),
                  ("pdserve:num_requests_waiting", "Requests waiting to be scheduled.", s["num_waiting"]),
                  ("pdserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", s["kv_usage"]),
                  ("pdserve:kv_cache_free_blocks", "KV-cache blocks free or evictable.", s["num_free_blocks"]))
        for metric, doc, value in gauges:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            yield g
        counters = (("pdserve:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                     s["prefix_cache_queries_tokens"]),
                    ("pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     s["prefix_cache_hits_tokens"]),
                    ("pdserve:num_preemptions", "Sequences preempted for lack of KV blocks.", s["num_preemptions"]))
        for metric, doc, value in counters:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            yield c
