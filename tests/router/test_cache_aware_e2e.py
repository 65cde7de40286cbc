"""Real processes: 2 prefill workers, 1 decode; shared-prefix conversations placed by
`cache_aware` hit the prefill workers' prefix caches more often than `round_robin`."""

import time

import httpx
import pytest

from tests.transfer.cluster import Cluster

pytestmark = pytest.mark.integration

ENGINE = ["--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", "512"]
# three conversations, so round robin over two workers sends a conversation's turns to alternating workers
CONVOS = [f"conversation {i}: " + " ".join(f"fact{i}_{j}" for j in range(40)) for i in range(3)]


def _prefill_hit_rate(c: Cluster, policy: str) -> tuple[float, dict]:
    model = httpx.get(c.url + "/v1/models").json()["data"][0]["id"]
    for turn in range(3):
        for convo in CONVOS:
            r = httpx.post(
                c.url + "/v1/completions",
                timeout=60,
                json={"model": model, "prompt": convo + f" turn {turn}", "max_tokens": 2, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            time.sleep(0.4)  # a heartbeat (0.3 s) carries the new blocks to the router
    c.wait_idle()
    time.sleep(0.4)
    states = [c.worker_state(f"prefill{i}")["stats"] for i in range(2)]
    hits = sum(s["prefix_cache_hits_tokens"] for s in states)
    queries = sum(s["prefix_cache_queries_tokens"] for s in states)
    return hits / queries, c.status()


def test_cache_aware_beats_round_robin_on_prefix_hits(tiny_model_dir):
    rates = {}
    for policy in ("round_robin", "cache_aware"):
        with Cluster(tiny_model_dir, prefill=2, decode=1, worker_args=ENGINE, router_args=["--policy", policy]) as c:
            rates[policy], status = _prefill_hit_rate(c, policy)
            index = status["prefix_index"]
            assert set(index) >= {"prefill0", "prefill1"}
            assert all(w["synced"] for w in index.values()), index
            prefill_stats = [w["stats"] for w in status["workers"] if w["role"] == "prefill"]
            assert all(len(s["prefill_cost_s"]) == 3 for s in prefill_stats)  # calibrated at start-up
    print(rates)
    assert rates["cache_aware"] >= 1.5 * rates["round_robin"], rates
