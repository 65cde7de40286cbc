"""One scheduler for every role: it hands out tokens from a per-step budget.

There is no prefill phase and no decode phase. Each step, every running
sequence asks for the tokens it has not computed yet (one for a decoding
sequence, many for a prompt), and gets what the budget and the KV pool allow;
then waiting sequences are admitted the same way. Chunked prefill, the
collocated role and the prefill-only / decode-only roles are settings of
this one loop (idea from vLLM V1's scheduler).
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig
from pdserve.engine.sequence import Sequence, Status
from pdserve.kv.block_manager import BlockManager


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    num_cached_tokens: int = 0  # prefix-cache hit found when the sequence was admitted


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


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


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.kv = block_manager
        self.waiting = WaitingQueue(by_priority=config.policy == "priority")
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.push(seq)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def _chunk_limit(self, budget: int) -> int:
        limit = self.config.long_prefill_token_threshold
        return min(budget, limit) if limit else budget

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        # 1. Running sequences, in order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, self._chunk_limit(budget))
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
        # 2. Waiting sequences, unless this step had to preempt (the pool is full).
        while (len(self.waiting) and budget > 0 and not out.preempted
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting.peek()
            cached, num_cached = [], 0
            # a request whose KV was imported (or is being recomputed) already owns blocks
            if seq.num_computed_tokens == 0 and not self.kv.owns_blocks(seq.seq_id):
                cached, num_cached = self.kv.find_cached_prefix(seq.seq_id, seq.all_token_ids)
            computed = max(num_cached, seq.num_computed_tokens)
            n = seq.num_tokens - computed
            if not self.config.enable_chunked_prefill and n > budget:
                break
            n = min(n, self._chunk_limit(budget))
            if not self.kv.allocate(seq.seq_id, computed + n, cached):
                break
            self.waiting.pop()
            seq.num_computed_tokens = computed
            seq.status = Status.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n, num_cached))
            budget -= n
        return out

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

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and free its blocks."""
        if seq.status is Status.RUNNING:
            # by identity: Sequence is a dataclass, and == compares every field
            del self.running[next(i for i, s in enumerate(self.running) if s is seq)]
        else:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)
        seq.status = Status.FINISHED
