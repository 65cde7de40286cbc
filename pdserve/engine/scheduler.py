"""One scheduler for every role: it hands out tokens from a per-step budget.

There is no prefill phase and no decode phase. Each step, every running
sequence asks for the tokens it has not computed yet (one for a decoding
sequence, many for a prompt), and gets what the budget and the KV pool allow;
then waiting sequences are admitted the same way. Chunked prefill, the
collocated role and the prefill-only / decode-only roles are settings of
this one loop (idea from vLLM V1's scheduler).

KV that arrives from outside goes through this scheduler too (in the spirit of
vLLM V1's KV connector): a request whose prompt KV a prefill worker computes
(`admit_remote`), or whose prefix a lower cache tier holds (`external`), gets
its blocks from this scheduler's admission, waits as WAITING_FOR_REMOTE_KV
while the KV is copied in, and rejoins the queue once it is (`remote_kv_done`).
Admitting remote KV keeps headroom for the sequences already running and never
takes blocks that a queued request is waiting for.

What a step did comes back through this scheduler as well (vLLM's
`update_from_output`): computed tokens, newly full blocks into the prefix cache,
sampled tokens appended, stop conditions, finished sequences out. The engine
calls it with what its model sampled, the simulator with placeholder tokens.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.sequence import FinishReason, Sequence, Status, TokenIds
from pdserve.kv.block_manager import BlockManager

# waiting prompts one step may pass over, held back by max_num_partial_prefills, to reach
# shorter ones behind them (bounds the scan of a long queue)
MAX_HELD = 16


# At most this many prompt tokens a step for a prompt whose logprobs are wanted: its logits
# are kept for every position (512 x a 128K vocabulary in fp32: 256 MiB).
PROMPT_LOGPROBS_CHUNK = 512


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # speculative decoding: the drafted tokens computed after the sequence's last one
    # (num_new_tokens counts them), and how many of them verification refused (set after
    # the step; their KV is left in the blocks, past the sequence's end, to be overwritten)
    spec_token_ids: list[int] = field(default_factory=list)
    num_rejected: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # sequences admitted this step to load (first token, number of tokens) from a lower tier
    loads: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    """A token sampled for a sequence whose tokens were all computed (one row of the model's output)."""

    seq: Sequence
    token: int
    # the sampler's (logprob of the token, {token id: logprob} of the top others, the token's rank),
    # when asked for; a token another worker sampled comes without its rank
    logprobs: tuple | None = None


@dataclass
class StepUpdate:
    """What `Scheduler.update_from_output` did with one step."""

    num_prompt_tokens: int = 0  # prompt tokens computed by the step (not cached, not loaded)
    finished: list[Sequence] = field(default_factory=list)  # in the order their last tokens came


class WaitingQueue:
    """FCFS, or ordered by (priority, arrival) under the priority policy.

    Removal is lazy: an aborted sequence's heap entry is marked dead and dropped
    when it reaches the top, so removing k of n waiting sequences costs
    O(k log n), not O(k n): one API request may fan out into hundreds of
    sequences, and its client may leave before any of them starts.
    """

    def __init__(self, by_priority: bool):
        self.by_priority = by_priority
        self._heap: list[list] = []  # [key..., order, seq]; seq is None once removed
        self._entries: dict[int, list] = {}  # id(seq) -> its live heap entry
        self._count = itertools.count()

    def _entry(self, seq: Sequence, front: bool) -> list:
        # `order` is unique, so comparisons never reach the sequence (or a dead None)
        order = -next(self._count) if front else next(self._count)
        if self.by_priority:
            return [seq.priority, seq.arrival_time, order, seq]
        return [order, 0, 0, seq]

    def push(self, seq: Sequence, front: bool = False) -> None:
        entry = self._entry(seq, front)
        self._entries[id(seq)] = entry
        heapq.heappush(self._heap, entry)

    def _drop_dead_top(self) -> None:
        while self._heap and self._heap[0][-1] is None:
            heapq.heappop(self._heap)

    def peek(self) -> Sequence:
        self._drop_dead_top()
        return self._heap[0][-1]

    def pop(self) -> Sequence:
        self._drop_dead_top()
        seq = heapq.heappop(self._heap)[-1]
        del self._entries[id(seq)]
        return seq

    def hold(self) -> list:
        """Take the head out for the rest of a step; `restore` puts it back exactly where it was."""
        self._drop_dead_top()
        entry = heapq.heappop(self._heap)
        del self._entries[id(entry[-1])]
        return entry

    def restore(self, entry: list) -> None:
        self._entries[id(entry[-1])] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, seq: Sequence) -> bool:
        entry = self._entries.pop(id(seq), None)
        if entry is None:
            return False
        entry[-1] = None
        # Rebuild once the dead outnumber the living, so memory follows the live
        # count; the O(n) rebuild is paid for by the n removals before it.
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._heap = [e for e in self._heap if e[-1] is not None]
            heapq.heapify(self._heap)
        return True

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self):
        return (entry[-1] for entry in sorted(self._entries.values()))

    def unordered(self):
        """The waiting sequences without sorting them (for sums over the queue)."""
        return (entry[-1] for entry in self._entries.values())


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        *,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int | None = None,
        cache_generated_blocks: bool = True,
    ):
        """`eos_token_ids` and `max_model_len` end sequences (`update_from_output`).
        `cache_generated_blocks`: blocks full of generated tokens go into the prefix cache
        too; the simulator turns it off (its placeholder outputs match no later prompt)."""
        self.config = config
        self.kv = block_manager
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.cache_generated_blocks = cache_generated_blocks
        self.waiting = WaitingQueue(by_priority=config.policy == "priority")
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Lower cache tiers: anything with `count_hits(block_hashes) -> int` (kvstore.TieredKVStore)
        self.external = None
        self.remote: dict[str, Sequence] = {}  # WAITING_FOR_REMOTE_KV, by id
        self.loading: set[str] = set()  # of those, the ones loading from a tier (this worker copies)
        self._abandoned: set[str] = set()  # aborted while loading: blocks freed when the copy ends
        # speculative decoding: anything with `propose(seq, k) -> list[int]` (up to k drafted
        # tokens), `num_speculative_tokens` and `disable_by_batch_size` (spec_decode.NgramProposer)
        self.drafter = None
        # LoRA: at most this many distinct adapters among the running sequences (vLLM's
        # max_loras); a waiting sequence with another adapter waits for one of them to finish
        self.max_loras: int | None = None

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        """Work the step loop must turn for (a P->D transfer is finished by a call, not a step)."""
        return bool(self.running) or len(self.waiting) > 0 or bool(self.loading) or bool(self._abandoned)

    # ---- KV from outside
    def _headroom_blocks(self) -> int:
        return math.ceil(self.config.kv_transfer_headroom * self.kv.num_blocks)

    def _blocks_waiting_needs(self) -> int:
        """Blocks the queued sequences still need before they can run."""
        need = 0
        for seq in self.waiting.unordered():
            sb = self.kv.seqs.get(seq.seq_id)
            have = len(sb.blocks) if sb is not None else 0
            need += max(0, self.kv.blocks_needed(seq.num_tokens + 1) - have)
        return need

    def admit_remote(self, seq: Sequence) -> bool:
        """Allocate blocks for a prompt whose KV another worker computes; False if not now.

        Admitted only if, after it, the pool still has room for every queued request
        and `kv_transfer_headroom` of the pool for the running sequences to grow
        into: a burst of transfers must not starve the work already here. Full
        blocks this worker caches are kept (seq.num_computed_tokens says how many
        tokens need not be sent)."""
        cached, num_cached = [], 0
        if not seq.needs_prompt_logprobs:  # one that does computes its whole prompt, if the KV never comes
            cached, num_cached = self.kv.find_cached_prefix(seq.seq_id, seq.prompt_token_ids, seq.hash_root)
        revived = sum(1 for b in cached if b.ref_cnt == 0)
        need = self.kv.blocks_needed(seq.num_tokens) - len(cached) + revived
        spare = self.kv.num_free_blocks - need - self._headroom_blocks() - self._blocks_waiting_needs()
        if spare < 0 or not self.kv.allocate(seq.seq_id, seq.num_tokens, cached):
            self.kv.free(seq.seq_id)
            return False
        seq.num_computed_tokens = num_cached
        seq.num_external_tokens = seq.num_tokens - num_cached
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached  # the rest comes from the worker that computes it
        seq.status = Status.WAITING_FOR_REMOTE_KV
        self.remote[seq.seq_id] = seq
        return True

    def remote_kv_done(self, seq_id: str, num_tokens: int) -> Sequence | None:
        """A tier load ended with `num_tokens` more tokens of KV in place (0: nothing usable
        came; the rest is recomputed). The sequence rejoins the queue at the front, where it
        was when it was admitted; one aborted meanwhile has its blocks freed now."""
        self.loading.discard(seq_id)
        if seq_id in self._abandoned:
            self._abandoned.discard(seq_id)
            self.kv.free(seq_id)
            return None
        seq = self.remote.pop(seq_id, None)
        if seq is None:
            return None
        seq.num_computed_tokens += num_tokens
        self.kv.cache_full_blocks(seq_id, seq.all_token_ids, seq.num_computed_tokens, seq.hash_root)
        seq.status = Status.WAITING
        self.waiting.push(seq, front=True)
        return seq

    def _external_hit(self, seq: Sequence, computed: int) -> int:
        """Tokens after `computed` that a lower tier can load (whole blocks; one token is left
        to compute, for the logits)."""
        sb = self.kv.seqs.get(seq.seq_id)
        if self.external is None or sb is None:
            return 0
        bs = self.kv.block_size
        first, last = computed // bs, (seq.num_tokens - 1) // bs
        if first >= last or len(sb.hashes) < last:
            return 0
        return self.external.count_hits(sb.hashes[first:last]) * bs

    def _chunk_limit(self, budget: int, seq: Sequence | None = None) -> int:
        limit = self.config.long_prefill_token_threshold
        n = min(budget, limit) if limit else budget
        if seq is not None and seq.needs_prompt_logprobs:
            # every position of the chunk keeps its logits over the whole vocabulary
            n = min(n, PROMPT_LOGPROBS_CHUNK)
        return n

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        # 1. Running sequences, in order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, self._chunk_limit(budget, seq))
            if n <= 0:
                i += 1
                continue
            while not self.kv.allocate(seq.seq_id, seq.num_computed_tokens + n):
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
                i += 1
        # 2. Waiting sequences, unless this step had to preempt (the pool is full). At most
        # max_num_partial_prefills prompts are split over steps at once (vLLM's setting of
        # that name): a prompt that would be split while that many are, waits, and shorter
        # prompts behind it that finish this step go first (up to MAX_HELD passed over).
        cap = self.config.max_num_partial_prefills if self.config.enable_chunked_prefill else 0
        partial = sum(1 for s in out.scheduled if s.seq.num_computed_tokens + s.num_new_tokens < s.seq.num_tokens)
        held: list[list] = []
        # Prompt blocks being computed now (by running sequences, and by those this loop starts):
        # a prompt whose next uncached block is one of them waits for it and hits the cache
        # then, rather than computing it a second time (n > 1, a burst of one system prompt).
        inflight = {h for s in self.running for h in self.kv.pending_hashes(s.seq_id)} if len(self.waiting) else set()
        adapters = self._running_adapters() if self.max_loras is not None and len(self.waiting) else set()
        adapter_held = False  # a request waits for an adapter slot: none with an adapter passes it
        while len(self.waiting) and budget > 0 and not out.preempted and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if cap and partial >= cap and seq.num_tokens - seq.num_computed_tokens > self._chunk_limit(budget):
                # its prompt would be split (even a cached prefix is checked below): pass it over
                if not self._fits_this_step(seq, budget):
                    if len(held) >= MAX_HELD:
                        break
                    held.append(self.waiting.hold())
                    continue
            adapter = seq.params.lora_adapter
            if (
                adapter is not None
                and self.max_loras is not None
                and (adapter_held or adapter not in adapters and len(adapters) >= self.max_loras)
            ):
                # another adapter while max_loras run: it waits, and so does every request with an
                # adapter behind it, even one that runs already (else a busy adapter's stream of
                # requests would keep its slot forever); requests for the base model pass
                adapter_held = True
                if len(held) >= MAX_HELD:
                    break
                held.append(self.waiting.hold())
                continue
            cached, num_cached = [], 0
            # a request whose KV was imported (or is being recomputed) already owns blocks; one
            # that wants its prompt's logprobs computes the whole prompt (no cache, no tier)
            fresh = seq.num_computed_tokens == 0 and not self.kv.owns_blocks(seq.seq_id)
            if fresh and seq.needs_prompt_logprobs:
                fresh = False
            elif (
                fresh
                and inflight
                and self.kv.first_uncached_hash(seq.seq_id, seq.all_token_ids, seq.hash_root) in inflight
            ):
                if len(held) >= MAX_HELD:
                    break
                held.append(self.waiting.hold())
                continue
            elif fresh:
                cached, num_cached = self.kv.find_cached_prefix(seq.seq_id, seq.all_token_ids, seq.hash_root)
            computed = max(num_cached, seq.num_computed_tokens)
            loadable = self._external_hit(seq, computed) if fresh else 0
            if loadable:
                if not self.kv.allocate(seq.seq_id, computed + loadable, cached):
                    if self._release_waiting_blocks(seq):
                        continue
                    break
                self.waiting.pop()
                seq.num_computed_tokens = computed
                seq.status = Status.WAITING_FOR_REMOTE_KV
                self.remote[seq.seq_id] = seq
                self.loading.add(seq.seq_id)
                out.loads.append((seq, computed, loadable))
                continue
            n = seq.num_tokens - computed
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, self._chunk_limit(budget, seq))
            if not self.kv.allocate(seq.seq_id, computed + n, cached):
                if self._release_waiting_blocks(seq):
                    continue
                break
            self.waiting.pop()
            seq.num_computed_tokens = computed
            if seq.num_cached_tokens is None:  # its first schedule: what the cache and tiers gave
                # (of the prompt: a resumed request's output is in the cache too)
                seq.num_cached_tokens = min(computed, seq.num_prompt_tokens)
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            if adapter is not None:
                adapters.add(adapter)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            partial += computed + n < seq.num_tokens
            inflight.update(self.kv.pending_hashes(seq.seq_id))
        for entry in held:
            self.waiting.restore(entry)
        # 3. Speculative decoding: drafts take what the step has left, after every running
        # sequence has its token and the waiting ones their chunks; they never preempt.
        if self.drafter is not None and budget > 0:
            self._add_drafts(out, budget)
        return out

    def _running_adapters(self) -> set[str]:
        return {s.params.lora_adapter for s in self.running if s.params.lora_adapter is not None}

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> None:
        """Give decoding entries of `out` drafted tokens, within `budget`, the context, max_tokens
        and the free blocks (a step keeps at most drafts + 1 tokens of a sequence)."""
        d = self.drafter
        if out.preempted or (d.disable_by_batch_size is not None and len(self.running) >= d.disable_by_batch_size):
            return  # the pool is short (or the batch large): no tokens past what is needed
        bs = self.kv.block_size
        for s in out.scheduled:
            if budget <= 0:
                break
            seq = s.seq
            # a decode: its one token is its last (not a prompt, nor a context being recomputed)
            if s.num_new_tokens != 1 or not seq.output_token_ids or seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            k = min(d.num_speculative_tokens, budget)
            if self.max_model_len is not None:
                k = min(k, self.max_model_len - seq.num_tokens)
            if seq.params.max_tokens is not None:
                k = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1)
            drafts = d.propose(seq, k) if k > 0 else []
            if not drafts:
                continue
            # a free block goes to drafts only while every running sequence could still take one
            # for its next token: blocks kept after refused drafts must not cost a preemption later
            extra = self.kv.blocks_needed(seq.num_tokens + len(drafts)) - len(self.kv.seqs[seq.seq_id].blocks)
            if (
                extra > 0
                and self.kv.num_free_blocks - extra < len(self.running)
                or not self.kv.allocate(seq.seq_id, seq.num_tokens + len(drafts))
            ):
                # only as many as the blocks it owns hold
                room = len(self.kv.seqs[seq.seq_id].blocks) * bs - seq.num_tokens
                drafts = drafts[: max(0, room)]
                if not drafts:
                    continue
            s.spec_token_ids = drafts
            s.num_new_tokens = 1 + len(drafts)
            budget -= len(drafts)

    def _fits_this_step(self, seq: Sequence, budget: int) -> bool:
        """Whether the rest of a waiting prompt, less the prefix the cache holds, fits one step."""
        if seq.num_computed_tokens or self.kv.owns_blocks(seq.seq_id):
            return False
        if seq.needs_prompt_logprobs:  # computed whole: the cache does not count
            return seq.num_tokens <= self._chunk_limit(budget)
        _, num_cached = self.kv.find_cached_prefix(seq.seq_id, seq.all_token_ids, seq.hash_root)
        return seq.num_tokens - num_cached <= self._chunk_limit(budget)

    def _release_waiting_blocks(self, head: Sequence) -> bool:
        """The head of the queue cannot get blocks while nothing runs or loads: the blocks
        are held by sequences behind it whose KV was loaded (or imported) and that wait
        for their turn, which cannot come. Free theirs, as a preemption would (the full
        blocks stay in the prefix cache, so most come back as hits). True if any were freed."""
        if self.running or self.loading:
            return False
        freed = False
        for seq in list(self.waiting.unordered()):
            if seq is not head and self.kv.owns_blocks(seq.seq_id):
                self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
                seq.num_preemptions += 1
                self.num_preemptions += 1
                freed = True
        return freed

    def _pick_victim(self) -> Sequence:
        if self.config.policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_time))
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Recompute-style preemption: drop its KV, send it back to the head of the queue.

        Returns the budget it had been given earlier in this step."""
        self.running.remove(seq)
        refund = sum(s.num_new_tokens for s in out.scheduled if s.seq is seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.push(seq, front=True)
        out.preempted.append(seq)
        self.num_preemptions += 1
        return refund

    # ---- after the step
    def update_from_output(
        self,
        out: SchedulerOutput,
        sampled: Iterable[SampledToken],
        now: float | None = None,
        detokenize: Callable[[Sequence, int], str] | None = None,
    ) -> StepUpdate:
        """The bookkeeping of a step that ran `out` and sampled `sampled`.

        First every scheduled sequence advances by the tokens the step computed (in
        schedule order) and its newly full blocks go into the prefix cache; then each
        sampled token, in the order given, is appended (`append_token`): a sequence
        that meets a stop condition finishes and its blocks are freed. `now` stamps
        the tokens (default: the monotonic clock); `detokenize(seq, token)` gives a
        token's text, for stop strings (without it there is no text)."""
        upd = StepUpdate()
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished:  # aborted while its step ran
                continue
            start = seq.num_computed_tokens
            upd.num_prompt_tokens += max(0, min(start + s.num_new_tokens, seq.num_prompt_tokens) - start)
            seq.num_computed_tokens = start + s.num_new_tokens - s.num_rejected
            if s.spec_token_ids:
                # the accepted drafts' KV is in place and may have filled blocks (the drafts are
                # appended below, as the sampled tokens they turned out to be); the token list is
                # copied only when a block did fill
                full = seq.num_computed_tokens // self.kv.block_size
                if (
                    self.cache_generated_blocks
                    and self.kv.enable_prefix_caching
                    and full > self.kv.seqs[seq.seq_id].num_cached_blocks
                ):
                    accepted = s.spec_token_ids[: len(s.spec_token_ids) - s.num_rejected]
                    tokens = TokenIds(seq.prompt_token_ids, seq.output_token_ids + accepted)
                    self.kv.cache_full_blocks(seq.seq_id, tokens, seq.num_computed_tokens, seq.hash_root)
            elif self.cache_generated_blocks:
                self.kv.cache_full_blocks(seq.seq_id, seq.all_token_ids, seq.num_computed_tokens, seq.hash_root)
            elif start < seq.num_prompt_tokens:
                self.kv.cache_full_blocks(
                    seq.seq_id,
                    seq.prompt_token_ids,
                    min(seq.num_computed_tokens, seq.num_prompt_tokens),
                    seq.hash_root,
                )
        now = time.monotonic() if now is None else now
        ended: set[int] = set()  # a verified sequence's later tokens after one that ended it
        for x in sampled:
            if ended and id(x.seq) in ended:
                continue
            if self.append_token(x.seq, x.token, x.logprobs, now, detokenize):
                upd.finished.append(x.seq)
                ended.add(id(x.seq))
        return upd

    def append_token(
        self,
        seq: Sequence,
        token: int,
        logprobs: tuple | None = None,
        now: float | None = None,
        detokenize: Callable[[Sequence, int], str] | None = None,
    ) -> bool:
        """Append one token to `seq` (sampled by a step, or by the prefill worker that
        computed its prompt) and check the stop conditions; a sequence that meets one
        is finished here. True if it finished."""
        seq.output_token_ids.append(token)
        now = time.monotonic() if now is None else now
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        if logprobs is not None:
            seq.cumulative_logprob += logprobs[0]
            seq.logprobs.append({token: logprobs[0], **logprobs[1]})
            seq.logprob_ranks.append(logprobs[2] if len(logprobs) > 2 else None)  # not sent between workers
        self._check_stop(seq, token, detokenize(seq, token) if detokenize is not None else "")
        if seq.finish_reason is not None and not seq.is_finished:
            self.finish(seq)
            return True
        return False

    def _check_stop(self, seq: Sequence, token: int, delta: str) -> None:
        """Set finish_reason (and stop_reason) when `token`, whose text is `delta`, ends `seq`."""
        p = seq.params
        n_out = len(seq.output_token_ids)
        len_before = len(seq.text)
        seq.text.append(delta)
        if n_out >= p.min_tokens:
            eos = not p.ignore_eos and token in self.eos_token_ids
            if eos or token in p.stop_token_ids:
                # the stop token's text is not part of the output unless asked for (as vLLM)
                if not p.include_stop_str_in_output:
                    seq.text.truncate(len_before)
                seq.finish_reason, seq.stop_reason = FinishReason.STOP, None if eos else token
                return
            if p.stop and delta:
                # only the tail can hold a new match: look back one stop-string length
                window_start = max(0, len_before - max(len(s) for s in p.stop) + 1)
                window = seq.text.tail(window_start)
                for stop in p.stop:
                    i = window.find(stop)
                    if i != -1:
                        cut = window_start + i + (len(stop) if p.include_stop_str_in_output else 0)
                        seq.text.truncate(cut)
                        seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop
                        return
        if (p.max_tokens is not None and n_out >= p.max_tokens) or (
            self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        ):
            seq.finish_reason = FinishReason.LENGTH

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status is Status.RUNNING:
            # by identity: Sequence is a dataclass, and == compares every field
            del self.running[next(i for i, s in enumerate(self.running) if s is seq)]
        elif seq.status is Status.WAITING_FOR_REMOTE_KV:
            self.remote.pop(seq.seq_id, None)
            if seq.seq_id in self.loading:
                # a tier is still copying into its blocks: they are freed when the copy ends
                self._abandoned.add(seq.seq_id)
                seq.status = Status.FINISHED
                return
        else:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = Status.FINISHED
