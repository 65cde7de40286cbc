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


def test_cache_salt_keeps_tenants_caches_apart_across_the_deployment(tiny_model_dir):
    """Router, 2 prefill workers and a decode worker: a salted prompt is found cached (and the
    usage says so, with vLLM's --enable-prompt-tokens-details) only under its own salt; the
    router hashes the prompt under the salt to place it where that salt's blocks are."""
    openai = pytest.importorskip("openai")
    router = ["--policy", "cache_aware", "--enable-prompt-tokens-details"]
    with (
        Cluster(tiny_model_dir, prefill=2, decode=1, worker_args=ENGINE, router_args=router) as c,
        openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=60) as client,
    ):
        model = client.models.list().data[0].id
        prompt = CONVOS[0]

        def cached(salt=None, stream=False):
            extra = {"ignore_eos": True} | ({"cache_salt": salt} if salt else {})
            kw = dict(model=model, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
            if stream:
                chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
                u = chunks[-1].usage
            else:
                u = client.completions.create(**kw).usage
            time.sleep(0.4)  # a heartbeat carries the new blocks to the router
            return u.prompt_tokens_details.cached_tokens, u.prompt_tokens

        first, n = cached("tenant-a")
        assert first == 0 and n > 64
        hit = cached("tenant-a")[0]
        assert hit >= 64 and hit % 16 == 0  # whole blocks, on the prefill worker that has them
        assert cached("tenant-b")[0] == 0
        assert cached()[0] == 0
        assert cached("tenant-b", stream=True)[0] == hit
        assert cached(stream=True)[0] == hit
