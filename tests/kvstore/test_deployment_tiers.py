"""`pdserve serve` with every tier on, disaggregated: the same tokens as an engine that caches
nothing, with the second round's prefixes loaded from the tiers (host, disk, Mooncake Store)."""

from __future__ import annotations

import time

import httpx
import pytest

from pdserve.kvstore.master import mooncake_missing
from tests.server.deployment import Deployment, metric

pytestmark = pytest.mark.integration

PROMPTS = [list(range(20 + 7 * i, 20 + 7 * i + 100)) for i in range(8)]  # 6 full blocks of 16 each
MAX = 8


@pytest.mark.skipif(mooncake_missing() is not None, reason=mooncake_missing() or "")
def test_disaggregated_outputs_with_all_tiers_equal_no_caching(sharp_model, tmp_path):
    from pdserve import LLM, SamplingParams

    ref_llm = LLM(sharp_model, dtype="float32", block_size=16, num_gpu_blocks=256, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=MAX, temperature=0.0, ignore_eos=True)
    reference = [o.outputs[0].text for o in ref_llm.generate(PROMPTS, params)]
    ref_llm.close()
    # 24 blocks a worker: the 48 blocks of these prompts do not stay in the pool between rounds,
    # and the host tier holds ~23 of them: the rest spill to disk
    dep = Deployment(
        sharp_model,
        "--served-model-name",
        "tiny",
        "--kv-store",
        "mooncake",
        "--kv-offload-bytes",
        str(200_000),
        "--kv-disk-dir",
        str(tmp_path / "kv"),
        "--kv-store-segment-bytes",
        str(32 << 20),
        num_gpu_blocks=24,
    )
    try:

        def tokens(prompt):
            r = httpx.post(
                dep.url + "/v1/completions",
                timeout=60,
                json={"model": "tiny", "prompt": prompt, "max_tokens": MAX, "temperature": 0, "ignore_eos": True},
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        for round_ in range(2):
            for prompt, want in zip(PROMPTS, reference):
                assert tokens(prompt)["text"] == want, f"round {round_}"
        deadline = time.monotonic() + 10
        while True:  # the router sums what the workers' heartbeats report, once a second
            text = httpx.get(dep.url + "/metrics", timeout=10).text
            hits = {
                t: metric(text, f'pdserve:kv_tier_hits_total{{model_name="tiny",tier="{t}"}}') for t in ("host", "disk")
            }
            if all(hits.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        # the second round's prefixes came from host memory and, past its bound, from disk
        assert hits["host"] > 0 and hits["disk"] > 0, (hits, dep.log())
        errors = {
            t: metric(text, f'pdserve:kv_tier_errors_total{{model_name="tiny",tier="{t}"}}')
            for t in ("host", "disk", "mooncake")
        }
        # the shared store may refuse a put while it evicts (a cache may decline); the local tiers may not
        assert errors["host"] == errors["disk"] == 0, errors
        assert metric(text, 'pdserve:kv_tier_stores_total{model_name="tiny",tier="mooncake"}') > 0
    finally:
        assert dep.stop() == 0
