"""Speculative decoding in a disaggregated deployment: the decode worker drafts, the API's
answers are those of an engine without drafts, and the router's /metrics counts them."""

import json
import time

import httpx
import pytest

from pdserve import LLM, SamplingParams
from tests.server.deployment import Deployment, metric

openai = pytest.importorskip("openai")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = ["hello world hello world hello", "the quick brown fox jumps over the lazy dog the quick brown"]


@pytest.mark.integration
def test_drafted_decode_through_router_and_workers(tiny_model_dir):
    ref = LLM(tiny_model_dir, dtype="float32", block_size=16, num_gpu_blocks=128)
    want = [
        o.outputs[0].text for o in ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    ]
    # a seeded sampled request: its first token sampled by the prefill worker, the rest by the
    # decode worker with drafts; each drawn from the seed and its position, as offline
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=48, ignore_eos=True)
    want_seeded = ref.generate(PROMPTS[0], seeded)[0].outputs[0].text
    dep = Deployment(tiny_model_dir, "--served-model-name", "tiny", "--speculative-config", json.dumps(SPEC))
    try:
        with openai.OpenAI(base_url=dep.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
            args = dict(model="tiny", max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
            for prompt, text in zip(PROMPTS, want):
                assert c.completions.create(prompt=prompt, **args).choices[0].text == text
                chunks = c.completions.create(prompt=prompt, stream=True, **args)
                assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
            sampled = (
                c.completions.create(prompt=PROMPTS[0], **dict(args, temperature=0.9, top_p=0.95, seed=5))
                .choices[0]
                .text
            )
            assert sampled == want_seeded
        deadline, accepted = time.monotonic() + 20, 0.0
        while time.monotonic() < deadline and not accepted:  # the workers' counters come with heartbeats
            text = httpx.get(dep.url + "/metrics", timeout=5).text
            accepted = metric(text, "pdserve:spec_decode_num_accepted_tokens_total")
            time.sleep(0.3)
        assert accepted > 0, text
        assert metric(text, "pdserve:spec_decode_num_draft_tokens_total") >= accepted
        decode_url = dep.workers()["decode-1"]["url"]
        worker = httpx.get(decode_url + "/metrics", timeout=5).text
        assert metric(worker, "pdserve:spec_decode_num_accepted_tokens_per_pos_total") == metric(
            worker, "pdserve:spec_decode_num_accepted_tokens_total"
        )
    finally:
        assert dep.stop() == 0
