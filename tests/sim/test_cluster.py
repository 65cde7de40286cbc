"""The simulated cluster: the engine's scheduler and block manager under a latency model,
the router's placement and admission, and the interference scenario."""

import numpy as np
import pytest

from pdserve.config import SchedulerConfig
from pdserve.router.admission import AdmissionConfig
from pdserve.sim.cluster import Cluster, ClusterConfig, PoolConfig
from pdserve.sim.latency import ProfileLatency, TransferModel
from pdserve.sim.workload import SimRequest, mooncake_trace, seed_000_6_1
from tests.data import MOONCAKE_SAMPLE as TRACE

KV_70B = 327680  # bytes per token, llama 70B in bf16: 80 layers x 2 (K, V) x 8 KV heads x 128 x 2 bytes


def step_latency(prefill_tokens_per_s: float) -> ProfileLatency:
    """The interference scenario's hardware: a 25 ms decode step, prefill at a fixed token rate."""
    return ProfileLatency([0.025, 1 / prefill_tokens_per_s, 0, 0, 0], model_layers=80, kv_bytes_per_token_=KV_70B)


def one_pool(mode="collocated", lat=None, blocks=20_000, sched=None, ff=None, **kw):
    sched = sched or SchedulerConfig(
        max_num_batched_tokens=16384, max_num_seqs=64, enable_chunked_prefill=mode == "chunked"
    )
    lat = lat or ProfileLatency([0.01, 1e-4, 1e-4, 1e-7, 1e-9], model_layers=30, kv_bytes_per_token_=1e4)
    if mode == "disagg":
        pools = {"prefill": PoolConfig(1, lat, blocks, 1, sched), "decode": PoolConfig(1, lat, blocks, 1, sched)}
        kw.setdefault("transfer", TransferModel(45e9))
    else:
        pools = {"both": PoolConfig(1, lat, blocks, 1, sched)}
    c = Cluster(ClusterConfig(mode, pools, **kw))
    if ff is not None:
        for inst in c.instances.values():
            inst.ff_max_steps = ff
    return c


def test_interference_collocated_p99_step_in_seconds_disaggregated_near_p50():
    """The interference scenario: 20 requests, three 16,000-token prompts. Collocated, each long
    prefill freezes every running stream for ~4 s (P99 step 4,025 ms = 16,000 tokens at 4,000
    tokens/s + one 25 ms step; P50 25 ms); disaggregated, decode steps stay near the 25 ms base."""
    sched = SchedulerConfig(max_num_batched_tokens=16384, enable_chunked_prefill=False)
    col = one_pool("collocated", step_latency(4000), sched=sched).run(seed_000_6_1())
    dis = Cluster(
        ClusterConfig(
            "disagg",
            {
                "prefill": PoolConfig(1, step_latency(4500), 20_000, 8, sched),
                "decode": PoolConfig(1, step_latency(4000), 20_000, 8, sched),
            },
            transfer=TransferModel(45e9, layerwise=True),
        )
    ).run(seed_000_6_1())
    assert col["completed"] == dis["completed"] == 20
    assert col["median_itl_ms"] == pytest.approx(25.0)
    assert col["p99_itl_ms"] == pytest.approx(4025.0, rel=0.01)  # 16,000 / 4,000 tok/s + one decode step
    assert dis["median_itl_ms"] == pytest.approx(25.0)
    assert dis["p99_itl_ms"] < 2 * dis["median_itl_ms"]  # at most one step's wait for the KV to join
    assert dis["p99_tpot_ms"] < 30 < col["p99_tpot_ms"]


def _decode_heavy(n=24, seed=0):
    rng = np.random.default_rng(seed)
    return [
        SimRequest(
            i, int(rng.integers(50, 400)), int(rng.integers(20, 300)), float(i * 0.05), "chat", token_ids=[-1 - i] * 300
        )
        for i in range(n)
    ]


def _prompt_fix(reqs):
    for r in reqs:
        r.token_ids = r.token_ids[:1] * r.prompt_len
    return reqs


@pytest.mark.parametrize("mode,block_size", [("collocated", 16), ("chunked", 16), ("disagg", 16), ("disagg", 512)])
def test_fast_path_gives_the_same_token_times_as_stepping_one_by_one(mode, block_size):
    """The steady-decode fast path commits k steps at once; it must not change a single token time."""
    a = one_pool(mode, block_size=block_size).run(_prompt_fix(_decode_heavy()))
    b = one_pool(mode, ff=1, block_size=block_size).run(_prompt_fix(_decode_heavy()))
    assert a["completed"] == b["completed"] == 24
    for x, y in zip(a["itls"], b["itls"]):
        assert np.allclose(x, y, rtol=0, atol=1e-9)
    assert a["ttfts"] == pytest.approx(b["ttfts"], abs=1e-9)
    assert a["sim"]["events"] < b["sim"]["events"]


def test_preemption_under_a_small_kv_pool_still_finishes_everything():
    c = one_pool("collocated", blocks=60, block_size=16)
    res = c.run(_prompt_fix(_decode_heavy(16)))
    assert res["completed"] == 16
    assert c.instances["both-0"].sched.num_preemptions > 0
    assert c.instances["both-0"].bm.num_free_blocks == 60  # every block back when all is done


@pytest.mark.parametrize("mode", ["collocated", "disagg"])
def test_the_fast_path_declines_when_the_pool_is_short(mode):
    """Its free-block check once summed each sequence's need, negative for one that owned more
    blocks than it needed: a short pool passed the check, and the allocation then failed (disagg,
    60 blocks). Now the fast path declines and the steps run one by one."""
    c = one_pool(mode, blocks=60, block_size=16)
    res = c.run(_prompt_fix(_decode_heavy(16)))
    assert res["completed"] == 16


def test_prefix_cache_hits_from_mooncake_hash_ids():
    reqs = mooncake_trace(TRACE, 40)
    c = one_pool("chunked", block_size=512)
    res = c.run(reqs)
    assert res["completed"] == 40
    # upper bound: every 512-token block whose hash-id chain an earlier request already had
    seen, bound = set(), 0
    for r in reqs:
        full = r.prompt_len // 512
        chains = [tuple(r.hash_ids[: k + 1]) for k in range(min(full, len(r.hash_ids)))]
        bound += 512 * sum(1 for ch in chains[: (r.prompt_len - 1) // 512] if ch in seen)
        seen.update(chains)
    hits = c.instances["both-0"].bm.stats.hits_tokens
    assert bound > 0 and 0.5 * bound <= hits <= bound


def test_cache_aware_placement_finds_more_prefix_hits_than_round_robin():
    """The router's own policies on two prefill instances (cf. tests/router/test_cache_aware_e2e.py)."""
    prefixes = [[1000 + k] * 256 for k in range(8)]
    # consecutive pairs share a prefix: round robin splits every pair over both instances
    reqs = [SimRequest(i, 320, 4, i * 0.5, token_ids=prefixes[(i // 2) % 8] + [-1 - i] * 64) for i in range(48)]
    hit = {}
    for policy in ("cache_aware", "round_robin"):
        c = Cluster(
            ClusterConfig(
                "disagg",
                {
                    "prefill": PoolConfig(2, step_latency(4000), 10_000),
                    "decode": PoolConfig(1, step_latency(4000), 10_000),
                },
                transfer=TransferModel(45e9),
                policy=policy,
            )
        )
        assert c.run(reqs)["completed"] == 48
        bms = [c.instances[f"prefill-{i}"].bm for i in range(2)]
        hit[policy] = sum(b.stats.hits_tokens for b in bms) / sum(b.stats.queries_tokens for b in bms)
    assert hit["cache_aware"] > hit["round_robin"] + 0.05


def test_early_rejection_refuses_what_would_miss_the_ttft_slo():
    reqs = [SimRequest(i, 8000, 8, 0.0, token_ids=[-1 - i] * 8000) for i in range(12)]
    adm = AdmissionConfig(slo_ttft_s=5.0)
    c = Cluster(
        ClusterConfig(
            "disagg",
            {"prefill": PoolConfig(1, step_latency(4000), 10_000), "decode": PoolConfig(1, step_latency(4000), 10_000)},
            transfer=TransferModel(45e9),
            admission=adm,
        )
    )
    res = c.run(reqs, goodput={"ttft": 5000})
    assert 0 < res["completed"] < 12
    assert all("429" in e for e in res["errors"] if e)
    assert res["p99_ttft_ms"] <= 5000 * 1.05  # what was admitted met its SLO
    assert c.admitter.rejected["ttft_slo"] == res["failed"]


def test_eager_transfer_delays_the_second_token_more_than_layerwise():
    reqs = [SimRequest(0, 16000, 4, 0.0, token_ids=[-1] * 16000)]
    second = {}
    one_step = SchedulerConfig(max_num_batched_tokens=16384)
    for lw in (True, False):
        c = Cluster(
            ClusterConfig(
                "disagg",
                {
                    "prefill": PoolConfig(1, step_latency(4000), 10_000, 1, one_step),
                    "decode": PoolConfig(1, step_latency(4000), 10_000),
                },
                transfer=TransferModel(10e9, layerwise=lw),
            )
        )
        second[lw] = c.run(reqs)["itls"][0][0]
    # eager: 16,000 x 320 KiB over 10 GB/s = 0.524 s more before the decode instance starts
    assert second[False] - second[True] == pytest.approx(16000 * KV_70B / 10e9 * (1 - 1 / 80), rel=0.01)


def test_layerwise_transfer_of_chunked_prefill_overlaps_every_chunk():
    """Chunks of 2,048 tokens on a link a bit slower than the compute: each chunk's KV leaves during
    its own step, so only the last chunk's lag shows, not the whole prompt's."""
    reqs = [SimRequest(0, 16000, 4, 0.0, token_ids=[-1] * 16000)]
    c = Cluster(
        ClusterConfig(
            "disagg",
            {
                "prefill": PoolConfig(1, step_latency(4000), 10_000, 1, SchedulerConfig(max_num_batched_tokens=2048)),
                "decode": PoolConfig(1, step_latency(4000), 10_000),
            },
            transfer=TransferModel(4e9, layerwise=True),
        )
    )
    gap = c.run(reqs)["itls"][0][0] - 0.025  # second token: exposed transfer + one decode step
    whole_s = 16000 * KV_70B / 4e9
    assert gap < whole_s / 2


def test_roofline_pool_holds_what_the_planner_says_fits():
    """KV blocks of a 70B instance on 4 H100s: memory left after the weights at 90% utilisation,
    over the KV bytes each GPU keeps per token (8 KV heads split 4 ways)."""
    from pdserve.sim.deploy import Hardware

    pool = Hardware("llama-3-70b", "h100").pool(8, 4, 16, SchedulerConfig())
    weights_per_gpu = 70.55e9 * 2 / 4
    free = 80 * 2**30 * 0.9 - weights_per_gpu
    assert pool.num_blocks == pytest.approx(free / (KV_70B / 4) / 16, rel=0.02)
    assert (pool.count, pool.gpus_per_instance) == (8, 4)
    with pytest.raises(ValueError, match="does not fit"):
        Hardware("llama-3-70b", "h100").pool(1, 1, 16, SchedulerConfig())


def test_closed_loop_stops_sending_at_send_until_as_the_bench_client_does():
    """Chat users (no arrival time, 2 at a time) send the next chat when the last ends, until
    send_until_s; requests with their own arrival time are sent whatever the clock says."""
    chats = [SimRequest(i, 100, 20, None, "chat", token_ids=[-1 - i] * 100) for i in range(200)]
    late = SimRequest(200, 100, 5, 30.0, "long", token_ids=[-500] * 100)
    c = one_pool(tag_concurrency={"chat": 2})
    res = c.run(chats + [late], send_until_s=5.0)
    sent = res["request_indices"]
    assert 200 in sent and res["num_unsent"] == 201 - len(sent) > 0
    assert res["completed"] == len(sent)
    starts = dict(zip(sent, res["start_times"]))
    assert max(t for i, t in starts.items() if i != 200) <= 5.0 and starts[200] == pytest.approx(30.0)
    # two users, each with one chat in flight at a time, the next sent as the last one ends
    spans = [(t, t + e) for i, t, e in zip(sent, res["start_times"], res["e2els"]) if i < 200]
    overlap = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert overlap == 2
    ends = sorted(b for _, b in spans)
    assert sum(1 for a, _ in spans if a > 0) == len(spans) - 2  # after the first two, each start is an end
    assert all(any(abs(a - e) < 1e-9 for e in ends) for a, _ in spans if a > 0)


def test_speculative_decoding_makes_more_tokens_a_step_at_the_price_of_its_rows():
    """--speculative-config in the simulator: the engine's scheduler gives decoding sequences
    drafts, each accepted with the given chance. Every request still gets exactly its tokens;
    a stream's chunk of several tokens is one ITL sample; all accepted, a step makes k + 1
    tokens a sequence; none accepted, the drafts cost their rows and make nothing."""
    from pdserve.config import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3)
    reqs = _decode_heavy()
    want = sum(r.output_len for r in reqs)
    plain = one_pool("disagg").run(_decode_heavy())
    runs = {a: one_pool("disagg", speculative=spec, spec_acceptance=a).run(_decode_heavy()) for a in (0.0, 0.7, 1.0)}
    for r in (plain, *runs.values()):
        assert r["completed"] == len(reqs) and r["total_output_tokens"] == want, r
    # decode steps cost 10 ms + per-token terms here: 4 tokens a step all accepted, ~2.5 at 0.7
    assert runs[1.0]["mean_tpot_ms"] < 0.35 * plain["mean_tpot_ms"]
    assert runs[1.0]["mean_tpot_ms"] < runs[0.7]["mean_tpot_ms"] < 0.6 * plain["mean_tpot_ms"]
    assert runs[0.0]["mean_tpot_ms"] >= plain["mean_tpot_ms"]
    # the acceptance draws follow the run's seed: the same seed, the same run; another, another
    again = one_pool("disagg", speculative=spec, spec_acceptance=0.7).run(_decode_heavy())
    other = one_pool("disagg", speculative=spec, spec_acceptance=0.7).run(_decode_heavy(), seed=1)
    assert again["mean_tpot_ms"] == runs[0.7]["mean_tpot_ms"] != other["mean_tpot_ms"]
    with pytest.raises(ValueError, match="probability"):
        one_pool("disagg", speculative=spec, spec_acceptance=1.5)
    # placeholder outputs never enter the prefix cache, drafted or not
    cached = []
    for kw in ({}, dict(speculative=spec, spec_acceptance=1.0)):
        c = one_pool("collocated", **kw)
        c.run(_decode_heavy())
        cached.append(len(c.instances["both-0"].bm.cached))
    assert cached[0] == cached[1] > 0
