"""--vllm-metric-names: the families vLLM has, exported again under its `vllm:` names (same
type, help, labels and values), so what was written for vLLM's /metrics reads pdserve's."""

from prometheus_client.parser import text_string_to_metric_families

from pdserve.server.metrics import VLLM_NAMES, ServerMetrics

STATS = {
    "num_running": 3,
    "num_waiting": 2,
    "kv_usage": 0.25,
    "num_free_blocks": 90,
    "num_fenced_blocks": 6,
    "prefix_cache_queries_tokens": 100,
    "prefix_cache_hits_tokens": 40,
    "num_preemptions": 1,
    "prompt_tokens_computed": 60,
    # an engine with speculative decoding on
    "spec_decode_num_drafts": 5,
    "spec_decode_num_draft_tokens": 20,
    "spec_decode_num_accepted_tokens": 9,
    "spec_decode_num_accepted_tokens_per_pos": [5, 3, 1, 0],
    # ... and LoRA adapters
    "lora": {"running": ["sql", "chat"], "waiting": [], "max_lora": 2},
}


def scrape(m: ServerMetrics) -> dict:
    m.on_first_token(0.0, 0.1, 0.3, num_prompt_tokens=12)
    m.on_tokens(4, 0.02)
    m.on_finish("stop", 0.0, 0.3, 0.5, num_generated_tokens=5)
    m.set_engine_stats(STATS)
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def samples(family) -> list:
    return sorted((s.name.split(":", 1)[1], tuple(sorted(s.labels.items())), s.value) for s in family.samples)


def test_vllm_names_repeat_the_families_vllm_has():
    got = scrape(ServerMetrics("tiny", vllm_names=True))
    vllm = {n.removeprefix("vllm:") for n in got if n.startswith("vllm:")}
    assert vllm == VLLM_NAMES
    for name in VLLM_NAMES:
        ours, theirs = got["pdserve:" + name], got["vllm:" + name]
        assert theirs.type == ours.type and theirs.documentation == ours.documentation
        assert samples(theirs) == samples(ours) and samples(ours)
    assert got["vllm:num_requests_waiting"].samples[0].value == 2
    assert got["vllm:request_success"].samples[0].labels == {"model_name": "tiny", "finished_reason": "stop"}
    # pdserve's own families have no vLLM twin
    assert "vllm:request_rejected" not in got and "vllm:kv_cache_free_blocks" not in got
    assert got["pdserve:kv_cache_fenced_blocks"].samples[0].value == 6


def test_off_by_default():
    assert not [n for n in scrape(ServerMetrics("tiny")) if n.startswith("vllm:")]
