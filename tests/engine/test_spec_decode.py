"""Speculative decoding by prompt lookup: drafts change how fast tokens come, never which.

The tiny random model repeats itself within a few dozen tokens, so its own history
predicts it well: the drafts are really accepted (each test checks the counters), and
each test compares with the same engine without drafts."""

import numpy as np
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import ConfigError, EngineConfig, SchedulerConfig, SpeculativeConfig
from pdserve.engine.sampler import Sampler, _top_k_top_p_min_p
from pdserve.engine.scheduler import SampledToken, Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import find_ngram_continuation, verify
from pdserve.kv.block_manager import BlockManager

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
PROMPTS = [
    "hello world hello world hello",
    "a much longer prompt that spans several kv blocks of four tokens",
    "x",
    "the quick brown fox jumps over the lazy dog " * 3,
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, num_gpu_blocks=256)


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir, **ENGINE)


@pytest.fixture
def spec(tiny_model_dir):
    return LLM(tiny_model_dir, speculative_config=SPEC, **ENGINE)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def accepted(llm) -> int:
    return llm.engine.stats()["spec_decode_num_accepted_tokens"]


def assert_idle(llm):
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


def test_lookup_takes_the_longest_then_the_latest_match():
    t = np.array([1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3])
    # suffix [1, 2, 3] occurs at 0 (followed by 9...); [2, 3] also at 4 (followed by 8): longest wins
    assert find_ngram_continuation(t, 1, 3, 2).tolist() == [9, 2]
    # only 2-grams: the latest [2, 3] is at 4
    assert find_ngram_continuation(t, 1, 2, 3).tolist() == [8, 7, 1]
    assert find_ngram_continuation(np.array([5, 6, 7]), 1, 3, 4).tolist() == []  # nothing repeats
    assert find_ngram_continuation(np.array([4, 4, 4, 4]), 1, 2, 5).tolist() == [4]  # ends at the end
    assert find_ngram_continuation(np.array([4]), 1, 2, 5).tolist() == []


def test_config_is_checked():
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}').prompt_lookup_min == 5
    one = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (2, 2)
    for bad, words in (
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "only 'ngram'"),
        ('{"method": "ngram"}', "needs"),
        ('{"method": "ngram", "num_speculative_tokens": 99}', "1..16"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "exceeds"),
        ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', ">= 1"),
    ):
        with pytest.raises(ConfigError, match=words):
            EngineConfig.from_kwargs(device="cpu", speculative_config=bad)


def test_greedy_output_is_unchanged_and_drafts_are_kept(plain, spec):
    ref = ids(plain.generate(PROMPTS, GREEDY))
    assert ids(spec.generate(PROMPTS, GREEDY)) == ref
    s = spec.engine.stats()
    assert (
        s["spec_decode_num_accepted_tokens"] > 20 and s["spec_decode_num_draft_tokens"] >= s["spec_decode_num_drafts"]
    )
    assert sum(s["spec_decode_num_accepted_tokens_per_pos"]) == s["spec_decode_num_accepted_tokens"]
    assert_idle(spec)
    # one at a time too (the batch above mixed drafted and plain rows)
    assert [ids(spec.generate(p, GREEDY))[0] for p in PROMPTS] == ref


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 23])
def test_stops_where_it_would_have(plain, spec, max_tokens):
    """max_tokens, a stop token and a stop string met inside an accepted draft end the
    sequence there: nothing past them is kept."""
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ref = plain.generate(PROMPTS, p)
    got = spec.generate(PROMPTS, p)
    assert ids(got) == ids(ref) and all(len(t) == max_tokens for t in ids(got))
    long = ids(plain.generate(PROMPTS[0], GREEDY))[0]
    stop_id = long[17]  # a token of the repeating part: met inside a draft
    by_id = SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id], ignore_eos=True)
    a, b = plain.generate(PROMPTS[0], by_id)[0].outputs[0], spec.generate(PROMPTS[0], by_id)[0].outputs[0]
    assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (a.token_ids, a.text, "stop", stop_id)
    text = plain.generate(PROMPTS[0], GREEDY)[0].outputs[0].text
    by_text = SamplingParams(temperature=0, max_tokens=40, stop=[text[20:24]], ignore_eos=True)
    a, b = plain.generate(PROMPTS[0], by_text)[0].outputs[0], spec.generate(PROMPTS[0], by_text)[0].outputs[0]
    assert (b.text, b.finish_reason) == (a.text, "stop") and b.token_ids == a.token_ids
    assert accepted(spec) > 0
    assert_idle(spec)


def test_context_limit_and_logprobs(tiny_model_dir, plain):
    """Drafts never reach past max_model_len; logprobs of every kept token are the model's."""
    limit = dict(ENGINE, max_model_len=60)
    a = LLM(tiny_model_dir, **limit)
    b = LLM(tiny_model_dir, speculative_config=SPEC, **limit)
    p = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=2)
    ra, rb = a.generate(PROMPTS[0], p)[0].outputs[0], b.generate(PROMPTS[0], p)[0].outputs[0]
    assert rb.token_ids == ra.token_ids and rb.finish_reason == "length"
    assert accepted(b) > 0
    for x, y in zip(ra.logprobs, rb.logprobs):
        assert list(x) == list(y)  # the chosen token, then the top 2, in order
        for tok in x:
            assert y[tok].logprob == pytest.approx(x[tok].logprob, abs=1e-4) and y[tok].rank == x[tok].rank
    assert rb.cumulative_logprob == pytest.approx(ra.cumulative_logprob, abs=1e-3)


def test_preemption_and_prefix_cache(tiny_model_dir, plain):
    """A pool too small for the batch preempts drafted sequences like any other; blocks filled by
    accepted drafts enter the prefix cache under the tokens they hold."""
    ref = ids(plain.generate(PROMPTS, GREEDY))
    small = LLM(
        tiny_model_dir, speculative_config=SPEC, dtype="float32", block_size=4, num_gpu_blocks=48,
        max_num_batched_tokens=64,
    )  # fmt: skip
    assert ids(small.generate(PROMPTS, GREEDY)) == ref
    assert small.engine.scheduler.num_preemptions > 0 and accepted(small) > 0
    assert_idle(small)
    spec = LLM(tiny_model_dir, speculative_config=SPEC, **ENGINE)
    first = spec.generate(PROMPTS[0], GREEDY)[0]
    longer = first.prompt_token_ids + first.outputs[0].token_ids[:30]
    again = spec.generate([longer], GREEDY)[0]
    assert again.num_cached_tokens >= 28  # the output's blocks were cached...
    assert again.outputs[0].token_ids == plain.generate([longer], GREEDY)[0].outputs[0].token_ids  # ...rightly


def test_requests_it_cannot_draft_for_decode_as_before(tiny_model_dir, plain):
    """Penalties read every earlier token: such requests get no drafts, in the same batches."""
    spec = LLM(tiny_model_dir, speculative_config=SPEC, **ENGINE)
    pen = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.3)
    assert ids(spec.generate(PROMPTS, pen)) == ids(plain.generate(PROMPTS, pen))
    assert spec.engine.stats()["spec_decode_num_drafts"] == 0
    mixed = [pen, GREEDY, pen, GREEDY]
    assert ids(spec.generate(PROMPTS, mixed)) == ids(plain.generate(PROMPTS, mixed))
    assert accepted(spec) > 0
    # logit_bias and allowed_token_ids are the same at every position: drafted, and applied to each
    before = accepted(spec)
    bias = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, logit_bias={101: 3.0, 32: -2.0})
    allowed = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, allowed_token_ids=list(range(64, 128)))
    for p in (bias, allowed):
        assert ids(spec.generate(PROMPTS, p)) == ids(plain.generate(PROMPTS, p))
    assert accepted(spec) > before


def test_disable_by_batch_size(tiny_model_dir, plain):
    cfg = dict(SPEC, disable_by_batch_size=2)
    spec = LLM(tiny_model_dir, speculative_config=cfg, **ENGINE)
    assert ids(spec.generate(PROMPTS, GREEDY)) == ids(plain.generate(PROMPTS, GREEDY))
    assert spec.engine.stats()["spec_decode_num_drafts"] == 0  # four ran together throughout
    spec.generate(PROMPTS[0], GREEDY)
    assert accepted(spec) > 0


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_verification_keeps_the_distribution(draft):
    """The token kept at a drafted position is distributed as the model's own distribution,
    whether the draft is likely, unlikely or impossible under it; so is the one after an
    accepted draft (top-k and temperature applied as the sampler applies them)."""
    logits = torch.tensor([[2.0, 1.1, -9.0, 1.6, 0.0, -30.0], [0.1, 1.9, 0.1, 0.1, 0.1, 0.0]])
    params = SamplingParams(temperature=0.8, top_k=5, max_tokens=10)
    probs = torch.softmax(_top_k_top_p_min_p(logits / 0.8, [params] * 2), dim=-1).numpy()
    sampler = Sampler(torch.device("cpu"))
    seq = Sequence("r", [1, 2, 3], params, output_token_ids=[4])
    n = 4000
    first, after = np.zeros(6), np.zeros(6)
    torch.manual_seed(0)
    for _ in range(n):
        (v,) = verify(sampler, logits, [seq], [[draft]])
        first[v.tokens[0]] += 1
        if v.num_accepted:
            after[v.tokens[1]] += 1
    sigma = np.sqrt(probs[0] * (1 - probs[0]) / n)
    assert np.all(np.abs(first / n - probs[0]) <= 5 * sigma + 1e-9), (first / n, probs[0])
    if after.sum():
        m = after.sum()
        assert np.all(np.abs(after / m - probs[1]) <= 5 * np.sqrt(probs[1] * (1 - probs[1]) / m) + 1e-9)
    assert first[5] == 0  # never a token top-k removed


def test_seeded_sampling_gives_the_same_tokens_with_drafts(plain, spec):
    """A seeded request draws each token from its seed and its position: drafts, batch
    neighbours and the number of tokens a step makes do not change what it samples."""
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=11)
    ref = ids(plain.generate(PROMPTS, p))
    assert ids(spec.generate(PROMPTS, p)) == ref
    assert [ids(spec.generate(x, p))[0] for x in PROMPTS] == ref
    assert accepted(spec) > 0


class Always:
    """A drafter that proposes k sevens for every sequence (the scheduler's side of drafting)."""

    num_speculative_tokens = 4
    disable_by_batch_size = None

    def __init__(self):
        self.asked: list[tuple[str, int, int]] = []  # (seq, tokens not yet computed, k)

    def propose(self, seq, k):
        self.asked.append((seq.seq_id, seq.num_tokens - seq.num_computed_tokens, k))
        return [7] * k


def decoding(sched, *lengths: int) -> list[Sequence]:
    """Sequences whose prompts (of these lengths) are computed and whose first tokens were sampled."""
    seqs = [
        Sequence(f"s{i}", list(range(100 * i + 1, 100 * i + 1 + n)), SamplingParams()) for i, n in enumerate(lengths)
    ]
    for s in seqs:
        sched.add(s)
    out = sched.schedule()
    assert out.num_tokens == sum(lengths)
    sched.update_from_output(out, [SampledToken(s, 5) for s in seqs])
    return seqs


def test_drafts_take_what_the_step_leaves_and_never_preempt():
    # 5 blocks of 4: a (4 + 1 tokens) takes 2 for its next step, b (8 + 1) 3; none is free
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(5, 4, False))
    decoding(sched, 4, 8)
    sched.drafter = Always()
    out = sched.schedule()
    assert not out.preempted  # drafts found no free block: as many as the blocks owned hold
    assert [x.num_new_tokens for x in out.scheduled] == [1 + 3, 1 + 3]
    # a small budget: every running sequence has its token before any draft
    sched2 = Scheduler(SchedulerConfig(max_num_batched_tokens=9), BlockManager(64, 4, False))
    seqs = decoding(sched2, 3, 3, 3)
    sched2.config.max_num_batched_tokens = 4
    sched2.drafter = Always()
    out = sched2.schedule()
    assert [x.num_new_tokens for x in out.scheduled] == [2, 1, 1] and out.num_tokens == 4
    assert all(s.status.value == "running" for s in seqs)


def test_no_drafts_for_a_context_being_recomputed():
    """A preempted sequence recomputing its prompt and output one token at a time is no decode."""
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, long_prefill_token_threshold=1), BlockManager(64, 4, False)
    )
    s = Sequence("a", [1, 2, 3], SamplingParams(), output_token_ids=[4, 5, 6])
    sched.add(s)
    sched.drafter = Always()
    for _ in range(5):
        out = sched.schedule()
        assert [x.num_new_tokens for x in out.scheduled] == [1] and not out.scheduled[0].spec_token_ids
        sched.update_from_output(out, [])
    assert sched.drafter.asked == []


def _run_all(drafter, shapes, num_blocks=15):
    """Run (prompt length, max_tokens) requests to the end on the real scheduler, every draft
    refused; the number of preemptions."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), BlockManager(num_blocks, 4, False))
    sched.drafter = drafter
    for i, (n, m) in enumerate(shapes):
        sched.add(Sequence(f"s{i}", list(range(100 * i + 1, 100 * i + 1 + n)), SamplingParams(max_tokens=m)))
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = []
        for x in out.scheduled:
            x.num_rejected = len(x.spec_token_ids)
            if x.spec_token_ids or x.seq.num_computed_tokens + x.num_new_tokens == x.seq.num_tokens:
                sampled.append(SampledToken(x.seq, 5))
        sched.update_from_output(out, sampled)
        assert sched.kv.num_free_blocks >= 0
    assert sched.kv.num_free_blocks == num_blocks
    return sched.num_preemptions


def test_refused_drafts_cost_no_preemptions_later():
    """Blocks taken for drafts stay with their sequence when the drafts are refused: they are
    taken only while every running sequence could still get a block for its next token."""
    shapes = [(5, 6), (8, 28), (5, 17), (3, 16), (9, 3), (5, 18)]
    assert _run_all(Always(), shapes) <= _run_all(None, shapes)
    rng = np.random.default_rng(0)
    worse = 0
    for _ in range(60):
        shapes = [(int(rng.integers(1, 12)), int(rng.integers(1, 30))) for _ in range(int(rng.integers(2, 8)))]
        worse += _run_all(Always(), shapes) > _run_all(None, shapes)
    assert worse == 0


def test_a_sequence_whose_guesses_fail_from_the_first_token_backs_off():
    """After a guess wrong from its first token, a sequence does not guess at its next chance,
    then at 2, 4, ... up to MAX_BACKOFF_STEPS chances; any kept token starts over. The tokens
    never change, only how many positions a step computes."""
    from pdserve.engine.spec_decode import MAX_BACKOFF_STEPS, NgramProposer

    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2, prompt_lookup_min=1))
    seq = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 1, 2], SamplingParams(), output_token_ids=[3])
    assert p.propose(seq, 4) == [4, 5, 6, 7]
    p.observe("a", 4, 1)  # partly kept: no back-off, the whole guess again
    assert p.propose(seq, 4) == [4, 5, 6, 7]
    skipped = []
    for _ in range(7):
        p.observe("a", 4, 0)
        n = 0
        while not p.propose(seq, 4):
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 16, 32, MAX_BACKOFF_STEPS]
    p.observe("a", 4, 1)  # kept again: the back-off starts over
    p.observe("a", 4, 0)
    assert p.propose(seq, 4) == [] and p.propose(seq, 4) == [4, 5, 6, 7]
    p.forget("a")
    p.observe("a", 4, 0)  # a forgotten sequence: nothing kept for it
    assert "a" not in p._histories
