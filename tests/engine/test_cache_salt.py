"""cache_salt: a salted request reuses only KV cached for the same salt, in the pool and in
the lower tiers, and its output does not change."""

from __future__ import annotations

import pytest

from pdserve import SamplingParams
from pdserve.engine.sampling_params import MAX_CACHE_SALT_CHARS, InvalidRequest
from pdserve.kv.hashing import ROOT_HASH, block_hashes, salt_root

PROMPT = list(range(20, 57))  # 37 tokens: 9 full blocks of 4


def test_a_salt_changes_every_block_hash_and_only_the_same_salt_matches():
    plain = block_hashes(PROMPT, 4)
    a, a2, b = (block_hashes(PROMPT, 4, root=salt_root(s)) for s in ("tenant-a", "tenant-a", "tenant-b"))
    assert a == a2
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)
    assert salt_root(None) == salt_root("") == ROOT_HASH and salt_root("x") != ROOT_HASH
    # continuing a salted chain needs no salt: the parent carries it
    assert block_hashes(PROMPT, 4, start=a[:3]) == a


def _gen(llm, prompt, salt=None, **kw):
    p = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
    out = llm.generate([p], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, **kw))[0]
    return out.outputs[0].token_ids, out.num_cached_tokens


def test_salted_requests_share_the_cache_only_with_their_own_salt(tiny_llm):
    ref, cached = _gen(tiny_llm, PROMPT)
    assert cached == 0
    assert _gen(tiny_llm, PROMPT) == (ref, 36)  # 9 blocks; the last token is always computed
    assert _gen(tiny_llm, PROMPT, "tenant-a") == (ref, 0)
    assert _gen(tiny_llm, PROMPT, "tenant-a") == (ref, 36)
    assert _gen(tiny_llm, PROMPT, "tenant-b") == (ref, 0)
    # the salt in the sampling parameters (how the servers carry it) is the same salt
    assert _gen(tiny_llm, PROMPT, cache_salt="tenant-b") == (ref, 36)
    # a salted prompt that extends a cached salted one hits that prefix
    longer = PROMPT + [60, 61, 62, 63, 64]
    assert _gen(tiny_llm, longer, "tenant-a")[1] == 36
    assert _gen(tiny_llm, longer, "tenant-c")[1] == 0


def test_the_same_prompt_under_two_salts_in_one_batch_is_computed_twice(tiny_llm):
    """The scheduler makes a prompt wait for the identical prompt being computed beside it, to
    hit its cache; under another salt the blocks are other blocks, so nothing waits."""
    prompts = [{"prompt_token_ids": PROMPT, "cache_salt": s} for s in ("a", "b")]
    outs = tiny_llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert [o.num_cached_tokens for o in outs] == [0, 0]
    same = tiny_llm.generate(
        [{"prompt_token_ids": PROMPT + [70], "cache_salt": "c"}] * 2,
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
    )
    assert sorted(o.num_cached_tokens for o in same) == [0, 36]


@pytest.mark.parametrize("salt", ["", 7, "x" * (MAX_CACHE_SALT_CHARS + 1)])
def test_bad_salts_are_refused(tiny_llm, salt):
    with pytest.raises(ValueError, match="cache_salt"):
        tiny_llm.generate([{"prompt": "hi", "cache_salt": salt}])
    with pytest.raises(InvalidRequest, match="cache_salt"):
        SamplingParams(cache_salt=salt)


def test_cached_tokens_of_a_resumed_request_count_its_prompt_only(tiny_llm):
    """A request resumed elsewhere brings its output, which the cache may hold too: only the
    prompt's cached tokens are reported, never more than the prompt."""
    eng = tiny_llm.engine
    prompt = PROMPT[:10]
    out = tiny_llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    eng.add_request("resumed", prompt, SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                    resume_token_ids=out.outputs[0].token_ids)  # fmt: skip
    final = None
    while eng.has_unfinished_requests():
        final = next((o for o in eng.step() if o.finished), final)
    assert final.num_cached_tokens == 10  # all of the prompt (its output was cached after it: 20 were found)
