"""Prometheus metrics with vLLM's meanings under a `pdserve:` prefix.

Latency histograms are fed per request by whoever sees the token stream (the
worker's server, the router); engine-wide gauges and counters (running and
waiting requests, KV usage, prefix-cache tokens, preemptions) are mirrored at
scrape time from the engine's latest stats snapshot, so the engine loop never
touches prometheus_client.

Observations arrive once per generated token, on the event loop. prometheus_client's
own Histogram takes a lock and walks every bucket per observation, which
measured as the largest per-token cost of the server; so values are kept
here in plain lists (bisect into the bucket, no lock: one thread writes and
the scrape runs on that same thread) and handed to prometheus_client only
when /metrics is read.
"""

from __future__ import annotations

import time
from bisect import bisect_left

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _geometric(start: float, factor: float, count: int) -> list[float]:
    return [round(start * factor**i, 6) for i in range(count)]


# Our own bucket choices: wide enough for a CPU trial box (seconds per token)
# and a GPU node (milliseconds per token) alike.
LATENCY_BUCKETS_S = _geometric(0.001, 2.0, 22)  # 1 ms .. ~35 min
TOKEN_GAP_BUCKETS_S = _geometric(0.0005, 1.6, 24)  # 0.5 ms .. ~25 s
TOKEN_COUNT_BUCKETS = _geometric(1, 2.0, 20)  # 1 .. 512k tokens
KV_TRANSFER_BUCKETS_S = _geometric(0.0001, 2.0, 20)  # 0.1 ms (shared memory) .. ~52 s


class Histogram:
    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, bounds: list[float]):
        self.name, self.doc, self.bounds = name, doc, bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket i holds bounds[i-1] < v <= bounds[i]
        self.sum += value

    def family(self, model: str) -> HistogramMetricFamily:
        h = HistogramMetricFamily(self.name, self.doc, labels=["model_name"])
        cumulative, buckets = 0, []
        for bound, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += n
            buckets.append((bound, cumulative))
        h.add_metric([model], buckets, self.sum)
        return h


class Counter:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


# The families vLLM exports under the same names and meanings: with `vllm_names` they are
# exported again as `vllm:...`, so dashboards, alerts and autoscalers written for vLLM (the
# Grafana dashboard, KEDA on vllm:num_requests_waiting, schedulers reading
# vllm:kv_cache_usage_perc) read pdserve unchanged
VLLM_NAMES = frozenset(
    {
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_time_per_output_token_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "num_preemptions",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
        "spec_decode_num_accepted_tokens_per_pos",
        "lora_requests_info",
    }
)


class ServerMetrics:
    """One per server process; `render()` is the /metrics body. `vllm_names`: the families
    vLLM has are exported under its `vllm:` names too."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, vllm_names: bool = False):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.vllm_names = vllm_names
        self._stats: dict | None = None
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds", "Time from arrival to the first generated token.", LATENCY_BUCKETS_S
        )
        self.itl = Histogram(
            "pdserve:inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request.",
            TOKEN_GAP_BUCKETS_S,
        )
        self.e2e = Histogram(
            "pdserve:e2e_request_latency_seconds",
            "Time from arrival to the last token of a request.",
            LATENCY_BUCKETS_S,
        )
        self.queue = Histogram(
            "pdserve:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            LATENCY_BUCKETS_S,
        )
        self.prefill = Histogram(
            "pdserve:request_prefill_time_seconds", "Time from first scheduled to first token.", LATENCY_BUCKETS_S
        )
        self.decode = Histogram(
            "pdserve:request_decode_time_seconds", "Time from first token to last token.", LATENCY_BUCKETS_S
        )
        self.tpot = Histogram(
            "pdserve:request_time_per_output_token_seconds",
            "A request's mean time per output token after the first (decode time / (tokens - 1)).",
            TOKEN_GAP_BUCKETS_S,
        )
        self.req_prompt = Histogram("pdserve:request_prompt_tokens", "Prompt tokens per request.", TOKEN_COUNT_BUCKETS)
        self.req_generation = Histogram(
            "pdserve:request_generation_tokens", "Generated tokens per request.", TOKEN_COUNT_BUCKETS
        )
        self.prompt_tokens = Counter()
        self.generation_tokens = Counter()
        self.rejected = Counter()
        self.success = {reason: Counter() for reason in ("stop", "length", "abort")}  # present from the start
        self.registry.register(_Collector(self))

    # ---- fed by the request stream
    def on_first_token(
        self, arrival_s: float, scheduled_s: float | None, first_token_s: float, num_prompt_tokens: int
    ) -> None:
        self.ttft.observe(first_token_s - arrival_s)
        if scheduled_s is not None:
            self.queue.observe(max(0.0, scheduled_s - arrival_s))
            self.prefill.observe(max(0.0, first_token_s - scheduled_s))
        self.prompt_tokens.inc(num_prompt_tokens)
        self.req_prompt.observe(num_prompt_tokens)

    def on_tokens(self, num_tokens: int, gap_s: float | None) -> None:
        self.generation_tokens.value += num_tokens
        if gap_s is not None:
            self.itl.observe(gap_s)

    def on_finish(
        self,
        reason: str,
        arrival_s: float,
        first_token_s: float | None,
        last_token_s: float | None,
        num_generated_tokens: int,
    ) -> None:
        self.success.setdefault(reason, Counter()).inc()
        if last_token_s is not None:
            self.e2e.observe(last_token_s - arrival_s)
            if first_token_s is not None:
                self.decode.observe(last_token_s - first_token_s)
                if num_generated_tokens > 1:
                    self.tpot.observe((last_token_s - first_token_s) / (num_generated_tokens - 1))
        self.req_generation.observe(num_generated_tokens)

    # ---- engine-wide state, mirrored at scrape time
    def set_engine_stats(self, stats: dict | None) -> None:
        self._stats = stats

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Collector:
    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []  # families are built at scrape time; nothing to check at registration

    def collect(self):
        for family in self._families():
            yield family
            if self.m.vllm_names and family.name.removeprefix("pdserve:") in VLLM_NAMES:
                yield _renamed(family, "vllm:" + family.name.removeprefix("pdserve:"))

    def _families(self):
        m, name = self.m, self.m.model_name
        for h in (m.ttft, m.itl, m.e2e, m.queue, m.prefill, m.decode, m.tpot, m.req_prompt, m.req_generation):
            yield h.family(name)
        yield _counter("pdserve:prompt_tokens", "Prompt tokens processed.", name, m.prompt_tokens.value)
        yield _counter("pdserve:generation_tokens", "Tokens generated.", name, m.generation_tokens.value)
        yield _counter("pdserve:request_rejected", "Requests refused by admission control.", name, m.rejected.value)
        success = CounterMetricFamily(
            "pdserve:request_success", "Finished requests by finish reason.", labels=["model_name", "finished_reason"]
        )
        for reason, c in m.success.items():
            success.add_metric([name, reason], c.value)
        yield success
        yield from self._engine(m._stats, name)

    @staticmethod
    def _engine(s: dict | None, name: str):
        """Gauges and counters the engine already keeps; re-reporting them avoids double bookkeeping."""
        if not s:
            return
        for metric, doc, key in (
            ("pdserve:num_requests_running", "Requests in the running batch.", "num_running"),
            ("pdserve:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
            ("pdserve:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", "kv_usage"),
            ("pdserve:kv_cache_free_blocks", "KV-cache blocks free or evictable.", "num_free_blocks"),
            (
                "pdserve:kv_cache_fenced_blocks",
                "KV-cache blocks given up but held until a prefill worker that writes into them may no longer.",
                "num_fenced_blocks",
            ),
        ):
            if key not in s:  # a stats dict from before the field (the simulator's, a router's)
                continue
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], s[key])
            yield g
        yield _counter(
            "pdserve:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            name,
            s["prefix_cache_queries_tokens"],
        )
        yield _counter(
            "pdserve:prefix_cache_hits", "Prompt tokens found in the prefix cache.", name, s["prefix_cache_hits_tokens"]
        )
        yield _counter(
            "pdserve:num_preemptions", "Sequences preempted for lack of KV blocks.", name, s["num_preemptions"]
        )
        yield _counter(
            "pdserve:prompt_tokens_computed",
            "Prompt tokens the model computed (not found in the "
            "prefix cache, not loaded from a KV tier or another worker).",
            name,
            s.get("prompt_tokens_computed", 0),
        )
        if "spec_decode_num_drafts" in s:
            yield from _spec_decode(s, name)
        if s.get("kv_store"):
            yield from _kv_tiers(s["kv_store"], name)
        if isinstance(s.get("lora"), dict):
            yield _lora_info(s["lora"])


def _lora_info(lora: dict):
    """vLLM's lora_requests_info: the adapters of the running and of the waiting requests
    (comma-separated names) and max_lora as labels; the value is when it was read (Unix time)."""
    g = GaugeMetricFamily(
        "pdserve:lora_requests_info",
        "Running stats on LoRA requests.",
        labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
    )
    g.add_metric(
        [",".join(lora.get("running") or ()), ",".join(lora.get("waiting") or ()), str(lora.get("max_lora", ""))],
        time.time(),
    )
    return g


def _spec_decode(s: dict, name: str):
    """Speculative decoding's counters, as vLLM's: acceptance rate = accepted / draft tokens,
    mean tokens per drafted step = 1 + accepted / drafts."""
    for key, doc in (
        ("num_drafts", "Steps in which a sequence brought drafted tokens."),
        ("num_draft_tokens", "Drafted tokens computed."),
        ("num_accepted_tokens", "Drafted tokens accepted."),
    ):
        yield _counter(f"pdserve:spec_decode_{key}", doc, name, s[f"spec_decode_{key}"])
    per_pos = CounterMetricFamily(
        "pdserve:spec_decode_num_accepted_tokens_per_pos",
        "Drafted tokens accepted, by position in the draft (0: the first).",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(s.get("spec_decode_num_accepted_tokens_per_pos") or ()):
        per_pos.add_metric([name, str(pos)], value)
    yield per_pos


_TIER_COUNTERS = (
    ("hits", "KV blocks loaded from the tier instead of recomputed."),
    ("misses", "KV blocks looked for in the tier and not usable there (absent, corrupt or foreign)."),
    ("bytes_in", "Bytes written to the tier."),
    ("bytes_out", "Bytes read from the tier."),
    ("stores", "KV blocks written to the tier."),
    ("evictions", "KV blocks the tier dropped to stay within its bound."),
    ("errors", "Failed tier calls, corrupt or foreign blocks, refused writes."),
    ("load_seconds", "Seconds spent loading blocks from the tier (read, check, copy in)."),
)


def _kv_tiers(kv: dict, name: str):
    """Per-tier counters of the KV store (host, disk, mooncake): `pdserve:kv_tier_*_total{tier=...}`."""
    for key, doc in _TIER_COUNTERS:
        c = CounterMetricFamily(f"pdserve:kv_tier_{key}", doc, labels=["model_name", "tier"])
        for tier, t in kv["tiers"].items():
            c.add_metric([name, tier], t[key])
        yield c
    up = GaugeMetricFamily(
        "pdserve:kv_tier_healthy", "1 while the tier's backend answers.", labels=["model_name", "tier"]
    )
    for tier, t in kv["tiers"].items():
        up.add_metric([name, tier], 1.0 if t["healthy"] else 0.0)
    yield up
    yield _counter(
        "pdserve:kv_tier_queried_blocks",
        "Blocks beyond the pool's own prefix hits looked up in the tiers.",
        name,
        kv["queried_blocks"],
    )
    yield _counter("pdserve:kv_tier_hit_blocks", "Of those, blocks some tier held.", name, kv["hit_blocks"])
    yield _counter(
        "pdserve:kv_tier_dropped_saves",
        "Blocks not written down because the tiers fell behind.",
        name,
        kv["dropped_saves"],
    )


def _renamed(family: Metric, name: str) -> Metric:
    """`family` under another name: the same type, help and samples."""
    out = Metric(name, family.documentation, family.type)
    out.samples = [s._replace(name=name + s.name[len(family.name) :]) for s in family.samples]
    return out


def _counter(metric: str, doc: str, model: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(metric, doc, labels=["model_name"])
    c.add_metric([model], value)
    return c
