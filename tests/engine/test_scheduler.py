"""The real Scheduler with a real BlockManager, on synthetic sequences."""

from pdserve.config import SchedulerConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SampledToken, Scheduler
from pdserve.engine.sequence import FinishReason, Sequence
from pdserve.kv.block_manager import BlockManager


def make(num_blocks=32, block_size=4, **kw):
    return Scheduler(SchedulerConfig(**kw), BlockManager(num_blocks, block_size))


def seq(sid, n, priority=0, t=0.0, first=1):
    return Sequence(sid, list(range(first, first + n)), SamplingParams(), priority=priority, arrival_time=t)


def run_step(s, out, sample=True):
    """Pretend the model ran and sampled token 7 wherever a sequence's tokens are all computed;
    the scheduler does the step's bookkeeping, as for the engine."""
    sampled = [
        SampledToken(sc.seq, 7)
        for sc in out.scheduled
        if sample and sc.seq.num_computed_tokens + sc.num_new_tokens == sc.seq.num_tokens
    ]
    return s.update_from_output(out, sampled)


def test_budget_is_shared_by_decodes_and_prefill_chunks():
    s = make(max_num_batched_tokens=10, long_prefill_token_threshold=0)
    a, b = seq("a", 6), seq("b", 20)
    s.add(a)
    run_step(s, s.schedule())  # a prefilled (6 tokens)
    s.add(b)
    out = s.schedule()
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]
    assert out.num_tokens == 10


def test_chunk_threshold_limits_one_prompt_per_step():
    s = make(max_num_batched_tokens=64, long_prefill_token_threshold=8)
    a = seq("a", 20)
    s.add(a)
    sizes = []
    while a.num_computed_tokens < 20:
        out = s.schedule()
        sizes.append(out.scheduled[0].num_new_tokens)
        run_step(s, out)
    assert sizes == [8, 8, 4]


def fresh(sid, n):
    """A prompt no other shares a block with (seq's prompts all start 1, 2, 3, ...)."""
    base = 1000 * (1 + sum(map(ord, sid)))
    return Sequence(sid, list(range(base, base + n)), SamplingParams())


def _steps(s, *, until):
    """Run steps until `until()`; each step's [(id, tokens)]."""
    log = []
    while not until():
        out = s.schedule()
        log.append([(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled])
        run_step(s, out)
    return log


def test_long_prompts_are_prefilled_one_after_another():
    """max_num_partial_prefills=1 (the default): a second long prompt waits while the first is
    split over steps, instead of both advancing at half the pace; it starts in the step that
    finishes the first's prompt."""
    s = make(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    a, b = fresh("a", 20), fresh("b", 20)
    s.add(a)
    s.add(b)
    log = _steps(s, until=lambda: b.num_computed_tokens >= 20)
    assert log[:3] == [[("a", 8)], [("a", 8)], [("a", 4), ("b", 8)]]
    assert log[3:] == [[("a", 1), ("b", 8)], [("a", 1), ("b", 4)]]


def test_any_number_of_partial_prefills_when_unbounded():
    s = make(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=8, max_num_partial_prefills=0)
    a, b = fresh("a", 20), fresh("b", 20)
    s.add(a)
    s.add(b)
    assert _steps(s, until=lambda: b.num_computed_tokens >= 20)[0] == [("a", 8), ("b", 8)]


def test_a_short_prompt_passes_a_long_one_held_back_and_the_order_stays():
    """A prompt that finishes within the step goes ahead of a long one that would be split while
    another is; the long one keeps its place at the head of the queue."""
    s = make(num_blocks=64, max_num_batched_tokens=64, long_prefill_token_threshold=8, max_num_partial_prefills=1)
    a, b, c, d = fresh("a", 20), fresh("b", 20), fresh("c", 5), fresh("d", 30)
    for x in (a, b, c, d):
        s.add(x)
    out = s.schedule()
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [("a", 8), ("c", 5)]
    assert [x.seq_id for x in s.waiting] == ["b", "d"]
    run_step(s, out)
    out = s.schedule()  # c decodes; b still waits for a
    assert [(x.seq.seq_id, x.num_new_tokens) for x in out.scheduled] == [("a", 8), ("c", 1)]


def test_max_num_partial_prefills_is_checked():
    import pytest

    from pdserve.config import ConfigError

    with pytest.raises(ConfigError, match="max_num_partial_prefills"):
        SchedulerConfig(max_num_partial_prefills=-1)


def test_without_chunking_a_prompt_waits_for_a_whole_budget():
    s = make(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = seq("a", 10), seq("b", 10)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert [x.seq.seq_id for x in out.scheduled] == ["a"]  # b does not fit in the 6 left


def test_max_num_seqs_bounds_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(seq(f"s{i}", 3))
    out = s.schedule()
    assert len(out.scheduled) == 2 and len(s.running) == 2 and len(s.waiting) == 2


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=4, block_size=4)
    a, b = seq("a", 8), seq("b", 7, first=100)  # no common prefix
    s.add(a)
    s.add(b)
    run_step(s, s.schedule())  # a: 2 blocks + b: 2 blocks, pool full
    assert s.kv.num_free_blocks == 0
    out = s.schedule()  # a needs a 3rd block for token 9 -> b (last) is preempted
    assert [p.seq_id for p in out.preempted] == ["b"]
    assert b.num_computed_tokens == 0 and len(b.output_token_ids) == 1
    assert [x.seq.seq_id for x in out.scheduled] == ["a"]
    assert s.waiting.peek() is b


def test_priority_policy_orders_waiting_and_picks_victims():
    s = make(policy="priority", max_num_seqs=1)
    s.add(seq("low", 3, priority=5, t=0))
    s.add(seq("high", 3, priority=0, t=1))
    out = s.schedule()
    assert out.scheduled[0].seq.seq_id == "high"


def test_fcfs_keeps_arrival_order():
    s = make(max_num_seqs=1)
    for name in ("first", "second", "third"):
        s.add(seq(name, 3))
    assert [x.seq_id for x in s.waiting] == ["first", "second", "third"]


def test_finish_frees_blocks():
    s = make()
    a = seq("a", 9)
    s.add(a)
    run_step(s, s.schedule())
    s.finish(a)
    assert s.kv.num_free_blocks == 32 and not s.has_unfinished()


def test_aborting_waiting_sequences_keeps_the_order_of_the_rest():
    s = make(policy="priority", max_num_seqs=100)
    seqs = [seq(f"s{i}", 1, priority=i % 3, t=float(i)) for i in range(300)]
    for x in seqs:
        s.add(x)
    for x in seqs[::2]:
        s.finish(x)
    assert not s.waiting.remove(seqs[0])  # already gone
    rest = seqs[1::2]
    assert len(s.waiting) == len(rest) == 150
    want = sorted(rest, key=lambda x: (x.priority, x.arrival_time))
    assert list(s.waiting) == want
    assert [s.waiting.pop() for _ in range(150)] == want and len(s.waiting) == 0


def test_aborting_a_huge_fanout_is_not_quadratic():
    """One API request can become thousands of waiting sequences; aborting them all when
    its client leaves must not stall the engine thread (it used to rescan and re-heapify
    the whole queue per sequence: minutes for 250,000)."""
    import time

    s = make()
    group = [seq(f"g{i}", 2) for i in range(20_000)]
    other = seq("other", 2)
    for x in group:
        s.add(x)
    s.add(other)
    t0 = time.monotonic()
    for x in group:
        s.finish(x)
    elapsed_s = time.monotonic() - t0
    assert elapsed_s < 2.0, f"aborting 20,000 waiting sequences took {elapsed_s:.1f}s"
    assert len(s.waiting) == 1 and s.waiting.peek() is other
    assert [x.seq.seq_id for x in s.schedule().scheduled] == ["other"]


class _TierHolds:
    """A lower cache tier that holds every block it is asked about while `on`."""

    on = False

    def count_hits(self, hashes):
        return len(hashes) if self.on else 0


def test_loaded_sequences_waiting_behind_a_preempted_one_do_not_deadlock():
    """A sequence whose KV was loaded waits, holding its blocks, behind one that preempted
    itself for want of a block: nothing runs, so nothing would ever free a block. The
    scheduler frees the waiting sequence's blocks (they stay cached) and goes on."""
    s = make(num_blocks=6, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=0)
    s.external = tier = _TierHolds()
    r = seq("r", 8)
    s.add(r)
    run_step(s, s.schedule())
    w = Sequence("w", list(range(100, 116)), SamplingParams())
    tier.on = True
    s.add(w)
    out = s.schedule()
    tier.on = False
    assert [x[0].seq_id for x in out.loads] == ["w"] and s.kv.num_free_blocks == 0
    run_step(s, out)
    assert s.remote_kv_done("w", 12) is w  # loaded: waits with its 3 blocks
    for _ in range(6):  # r decodes until its 4th block does not fit, and preempts itself
        run_step(s, s.schedule())
        if r.num_preemptions:
            break
    assert r.num_preemptions == 1 and not s.running and w.num_computed_tokens == 12
    finished = set()
    for _ in range(40):
        out = s.schedule()
        run_step(s, out)
        for x in out.scheduled:
            if x.seq.num_tokens >= 16 + 2 and x.seq.seq_id not in finished:
                finished.add(x.seq.seq_id)
                s.finish(x.seq)
        if finished == {"r", "w"}:
            break
    assert finished == {"r", "w"}


def test_update_from_output_advances_caches_appends_and_finishes():
    """The step's bookkeeping: computed tokens, full blocks into the prefix cache, sampled
    tokens appended, stop conditions (EOS, max_tokens), finished sequences out with their blocks."""
    s = Scheduler(SchedulerConfig(), BlockManager(32, 4), eos_token_ids=[99])
    a = Sequence("a", list(range(1, 9)), SamplingParams(max_tokens=2))
    b = Sequence("b", list(range(20, 26)), SamplingParams(max_tokens=5))
    s.add(a)
    s.add(b)
    out = s.schedule()
    upd = s.update_from_output(out, [SampledToken(b, 99), SampledToken(a, 5, (-0.5, {6: -1.5}))], now=3.0)
    assert upd.num_prompt_tokens == 14 and upd.finished == [b]
    assert (a.num_computed_tokens, a.output_token_ids, a.first_token_time) == (8, [5], 3.0)
    assert a.logprobs == [{5: -0.5, 6: -1.5}] and a.cumulative_logprob == -0.5
    assert len(s.kv.seqs["a"].hashes) == 2 and s.kv.seqs["a"].num_cached_blocks == 2  # both full blocks
    assert b.is_finished and (b.finish_reason, b.stop_reason) == (FinishReason.STOP, None)
    assert "b" not in s.kv.seqs and s.running == [a]
    out = s.schedule()
    assert [(x.seq, x.num_new_tokens) for x in out.scheduled] == [(a, 1)]
    upd = s.update_from_output(out, [SampledToken(a, 6)], now=4.0)
    assert upd.num_prompt_tokens == 0 and upd.finished == [a] and a.finish_reason is FinishReason.LENGTH
    assert (a.num_computed_tokens, a.output_token_ids, a.last_token_time) == (9, [5, 6], 4.0)
    assert not s.has_unfinished() and s.kv.num_free_blocks == 32


def test_update_from_output_stop_strings_stop_ids_min_tokens_and_context():
    text = {1: "a", 2: "x", 3: "y", 4: "z"}
    s = Scheduler(SchedulerConfig(), BlockManager(32, 4), eos_token_ids=[2], max_model_len=10)

    def run(seq, tokens):
        s.add(seq)
        for t in tokens:
            out = s.schedule()
            s.update_from_output(out, [SampledToken(x.seq, t) for x in out.scheduled], detokenize=lambda q, k: text[k])
        return seq

    st = run(Sequence("st", [9, 9], SamplingParams(stop=["xy"], ignore_eos=True)), [1, 2, 3])
    assert st.is_finished and (st.output_text, st.stop_reason, st.finish_reason) == ("a", "xy", FinishReason.STOP)
    # a stop token's (or EOS's) text is left out unless include_stop_str_in_output, as in vLLM
    ids = run(Sequence("ids", [9, 9], SamplingParams(stop_token_ids=[4])), [1, 4])
    assert ids.is_finished and ids.stop_reason == 4 and ids.output_text == "a" and ids.output_token_ids == [1, 4]
    kept = run(Sequence("kept", [9, 9], SamplingParams(stop_token_ids=[4], include_stop_str_in_output=True)), [1, 4])
    assert kept.output_text == "az"
    eos = run(Sequence("eos", [9, 9], SamplingParams()), [1, 3, 2])
    assert (eos.output_text, eos.stop_reason, eos.finish_reason) == ("ay", None, FinishReason.STOP)
    # EOS (token 2) before min_tokens does not end it; the context (10 tokens) does
    ctx = run(Sequence("ctx", [9] * 6, SamplingParams(min_tokens=2, max_tokens=None)), [2, 1, 1, 1])
    assert ctx.is_finished and ctx.finish_reason is FinishReason.LENGTH and ctx.num_tokens == 10


def test_update_from_output_skips_a_sequence_aborted_while_its_step_ran():
    s = make()
    a, b = seq("a", 4), seq("b", 4)
    s.add(a)
    s.add(b)
    out = s.schedule()
    s.finish(b)
    upd = s.update_from_output(out, [SampledToken(a, 7)])
    assert upd.num_prompt_tokens == 4 and b.num_computed_tokens == 0 and a.output_token_ids == [7]


def test_update_from_output_caches_generated_blocks_unless_told_not_to():
    for cache_generated, cached in ((True, 7), (False, 4)):
        # blocks of one token: each is full the step its token is computed
        s = Scheduler(SchedulerConfig(), BlockManager(32, 1), cache_generated_blocks=cache_generated)
        a = Sequence("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
        s.add(a)
        for _ in range(4):  # the prompt, then three generated tokens computed
            out = s.schedule()
            s.update_from_output(out, [SampledToken(a, 7 + len(a.output_token_ids))])
        assert a.num_computed_tokens == 7 and len(s.kv.cached) == cached


def scheduled(out):
    return [(x.seq.seq_id, x.seq.num_computed_tokens, x.num_new_tokens) for x in out.scheduled]


def test_a_prompt_computed_now_is_not_computed_twice():
    # n > 1, or a burst of one prompt: the copies wait one step and hit the cache
    s = make(max_num_batched_tokens=64)
    for name in ("a", "b", "c"):
        s.add(seq(name, 10))
    s.add(seq("other", 10, first=100))
    out = s.schedule()
    assert scheduled(out) == [("a", 0, 10), ("other", 0, 10)]
    run_step(s, out)
    # the two waiting copies start from a's 8 cached tokens (2 blocks), in their order
    assert scheduled(s.schedule()) == [("a", 10, 1), ("other", 10, 1), ("b", 8, 2), ("c", 8, 2)]


def test_a_prompt_sharing_only_a_prefix_waits_for_that_prefix():
    s = make(max_num_batched_tokens=16, long_prefill_token_threshold=0, max_num_partial_prefills=2)
    a = seq("a", 20)  # computed over two steps
    b = Sequence("b", list(range(1, 5)) + list(range(200, 216)), SamplingParams())  # a's first block, then its own
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert scheduled(out) == [("a", 0, 16)]
    run_step(s, out)
    # a's first blocks are in the cache now: b goes on from the one it shares while a finishes
    assert scheduled(s.schedule()) == [("a", 16, 4), ("b", 4, 12)]


def test_a_copy_waits_no_longer_than_the_computation_it_waits_for():
    s = make()
    a, b = seq("a", 10), seq("b", 10)
    s.add(a)
    s.add(b)
    assert scheduled(s.schedule()) == [("a", 0, 10)]
    s.finish(a)  # aborted before its step ended: nothing will be cached
    assert scheduled(s.schedule()) == [("b", 0, 10)]


def test_without_prefix_caching_copies_are_computed_together():
    s = Scheduler(SchedulerConfig(), BlockManager(32, 4, enable_prefix_caching=False))
    s.add(seq("a", 10))
    s.add(seq("b", 10))
    assert scheduled(s.schedule()) == [("a", 0, 10), ("b", 0, 10)]
