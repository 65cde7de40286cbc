"""Greedy output is token-identical to Hugging Face `transformers` on the same weights.

transformers loads the GGUF with its own dequantizer and its own Llama code, so
this checks our loader (incl. the q/k un-permutation) and our model together.
Every engine mode must agree: one at a time, batched, chunked prefill with a
small chunk, and prefix-cache hits.
"""

import pytest
import torch

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.integration

MAX_TOKENS = 12

_TEXT = (
    "The history of computing is a story of people building tools to think faster. "
    "Charles Babbage designed engines of brass; Ada Lovelace saw that they could compose music. "
    "Later, vacuum tubes gave way to transistors, and transistors to integrated circuits. "
)


def _prompts(tok):
    short = [
        "Hi there, how are you?",
        "What is the capital of France? Answer in one sentence.",
        "List three primary colours:",
        "def fibonacci(n):\n    ",
    ]
    ids = [tok.encode(p) for p in short]
    for target in (120, 400, 900, 1500):  # long prompts made of varied sentences
        words = []
        i = 0
        while len(tok.encode(" ".join(words))) < target:
            words.append(_TEXT.split(". ")[i % 3] + f" (note {i}).")
            i += 1
        ids.append(tok.encode(" ".join(words))[:target])
    return ids


@pytest.fixture(scope="module")
def hf_reference(real_model_path):
    transformers = pytest.importorskip("transformers")
    import os

    d, f = os.path.split(real_model_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", block_size=16, max_num_batched_tokens=2048)


@pytest.fixture(scope="module")
def cases(llm, hf_reference):
    prompts = _prompts(llm.tokenizer)
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = hf_reference.generate(
                torch.tensor([p]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                pad_token_id=2,
                eos_token_id=None,
            )
            refs.append(out[0, len(p) :].tolist())
    return prompts, refs


def _greedy():
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def test_prompt_lengths_cover_5_to_1500(cases):
    prompts, _ = cases
    assert len(prompts) >= 8
    assert min(map(len, prompts)) >= 5 and max(map(len, prompts)) == 1500


def test_one_at_a_time(llm, cases):
    prompts, refs = cases
    llm.engine.block_manager.reset_prefix_cache()
    for p, ref in zip(prompts, refs):
        assert llm.generate(p, _greedy())[0].outputs[0].token_ids == ref


def test_batched_together(llm, cases):
    prompts, refs = cases
    llm.engine.block_manager.reset_prefix_cache()
    outs = llm.generate(prompts, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_chunked_prefill_small_chunks(cases):
    prompts, refs = cases
    small = LLM(
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=40,
        enable_prefix_caching=False,
    )
    outs = small.generate(prompts, _greedy())
    assert [o.outputs[0].token_ids for o in outs] == refs


def test_prefix_cache_hits(llm, cases):
    prompts, refs = cases
    bm = llm.engine.block_manager
    llm.generate(prompts, _greedy())  # warm the cache
    hits_before = bm.stats.hits_tokens
    outs = llm.generate(prompts, _greedy())
    assert bm.stats.hits_tokens - hits_before >= sum(len(p) // 16 - 1 for p in prompts) * 16
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert bm.num_free_blocks == bm.num_blocks


def test_kv_tier_hits(cases, tmp_path):
    """Prefixes evicted from a pool too small for them come back from host memory and disk,
    and the tokens are still transformers' own."""
    prompts, refs = cases
    with LLM(
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=2048,
        num_gpu_blocks=112,
        kv_offload_bytes=20 << 20,
        kv_disk_dir=str(tmp_path / "kv"),
        kv_disk_bytes=256 << 20,
    ) as tiered:
        first = [tiered.generate(p, _greedy())[0].outputs[0].token_ids for p in prompts]
        # the long prompts share their start: ~93 distinct blocks; a prompt of 88 other blocks
        # pushes most of them out of the pool, down to the tiers
        tiered.generate(list(range(1000, 2400)), SamplingParams(max_tokens=1))
        again = [tiered.generate(p, _greedy())[0].outputs[0].token_ids for p in prompts]
        tiers = tiered.engine.stats()["kv_store"]["tiers"]
    assert first == refs and again == refs
    assert tiers["host"]["hits"] + tiers["disk"]["hits"] >= 40, tiers
    assert tiers["host"]["errors"] == tiers["disk"]["errors"] == 0
