"""One simulated worker: the engine's own Scheduler and BlockManager, with the model
runner replaced by a latency model.

A step is what LLMEngine.step does (pdserve/engine/llm_engine.py), minus the
tensors: `scheduler.schedule()`, a latency-model duration instead of the
forward pass, then the same bookkeeping when the step ends, by the same
`scheduler.update_from_output` (computed tokens, full blocks into the prefix
cache, one new token for each sequence whose tokens are all computed, stop
conditions, finished sequences out).

Fast path (same results, fewer Python calls): when every running sequence is
decoding, nothing waits and the pool has the blocks, the next k steps are
exactly k one-token steps for the same batch. They are committed at once (one
`allocate` per sequence for k tokens, one duration per step from the latency
model) and cut short, at a step boundary, if new work arrives meanwhile.
Generated tokens are not registered in the prefix cache: simulated outputs are
placeholder ids that no later prompt can match.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field

from pdserve.config import SchedulerConfig, SpeculativeConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import SampledToken, Scheduler, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import NgramProposer
from pdserve.kv.block_manager import BlockManager, SeqBlocks
from pdserve.kv.hashing import params_root
from pdserve.sim.events import EventLoop
from pdserve.sim.latency import LatencyModel, StepShape

OUTPUT_TOKEN = 0  # placeholder id of every simulated output token


class SimBlockManager(BlockManager):
    """The engine's block manager plus one hook: hashes computed once per request are
    handed over (`prime`) so `find_cached_prefix` does not hash the prompt again."""

    def prime(self, seq_id: str, hashes: list[int]) -> None:
        if self.enable_prefix_caching:
            self.seqs.setdefault(seq_id, SeqBlocks()).hashes = list(hashes)


@dataclass
class Timing:
    """What a client would see of one request, in simulated seconds."""

    start_s: float
    first_s: float | None = None
    last_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    tokens: int = 0
    done: bool = False
    error: str = ""

    def token(self, t: float, count: int = 1) -> None:
        """`count` tokens arrived at `t` in one chunk of the stream: one ITL sample, as a client
        measures it (vLLM's definition: speculative decoding's several tokens a step are one)."""
        if self.first_s is None:
            self.first_s = t
        else:
            self.itl_s.append(t - self.last_s)
        self.last_s = t
        self.tokens += count


class _PlaceholderDrafter(NgramProposer):
    """The engine's drafter (its eligibility and per-sequence back-off) with placeholder drafts:
    a lookup always finds the k it may have; whether they are kept is drawn at the step's end."""

    def _lookup(self, seq: Sequence, hist, k: int) -> list[int]:
        return [OUTPUT_TOKEN] * k


@dataclass
class _FastForward:
    seqs: list[Sequence]
    start_s: float
    ends_s: list[float]  # end of each planned step
    k: int


class SimInstance:
    """role: "both" (collocated), "prefill" or "decode". Callbacks into the cluster:
    `on_prefilled(inst, seq, t, step_s)` (prefill role, first token sampled) and
    `on_finished(inst, seq)`; `on_step(inst)` after every step (KV events, retries);
    `on_chunk(inst, seq, start, n, step_s)` for each prompt chunk computed."""

    def __init__(
        self,
        worker_id: str,
        role: str,
        latency: LatencyModel,
        sched: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        loop: EventLoop,
        *,
        enable_prefix_caching: bool = True,
        record_events: bool = False,
        ff_max_steps: int | None = None,
        speculative: SpeculativeConfig | None = None,
        spec_acceptance: float = 0.0,
        seed: int = 0,
    ):
        self.worker_id, self.role, self.latency, self.loop = worker_id, role, latency, loop
        self.bm = SimBlockManager(num_blocks, block_size, enable_prefix_caching, record_events)
        # generated tokens are placeholders: their blocks are not cached (see above)
        self.sched = Scheduler(sched, self.bm, cache_generated_blocks=False)
        # speculative decoding: the engine's scheduler gives decoding sequences drafts (placeholders
        # here) within its budget and blocks; each is accepted with probability spec_acceptance
        self.spec_acceptance = spec_acceptance
        self._rng = random.Random(seed)
        if speculative is not None:
            self.sched.drafter = _PlaceholderDrafter(speculative)
        self.timing: dict[str, Timing] = {}
        self.on_prefilled = self.on_finished = self.on_step = self.on_chunk = None
        # a cut-short run has allocated up to k tokens ahead: k <= a block keeps that to one block
        self.ff_max_steps = ff_max_steps or max(64, block_size)
        self.busy = False
        self.busy_s = 0.0
        self.num_steps = 0
        self.link_free_s = 0.0  # when this instance's NICs finish the KV sends queued on them
        self._ff: _FastForward | None = None
        self._version = 0

    # ---- work arriving

    def reseed(self, seed) -> None:
        """Start this instance's random draws (which drafts are accepted) from `seed` (an int or a
        str: random.Random's seeding of both is the same in every process)."""
        self._rng = random.Random(seed)

    def add(self, seq: Sequence, timing: Timing, hashes: list[int] | None = None) -> None:
        self.timing[seq.seq_id] = timing
        if hashes is not None:
            self.bm.prime(seq.seq_id, hashes)
        self.sched.add(seq)
        self.kick()

    def reserve(
        self, rid: str, prompt: list[int], hashes: list[int], params: SamplingParams, arrival_s: float
    ) -> Sequence | None:
        """Decode role: blocks for a prompt whose KV another instance computes, keeping the
        prefix cached here (as LLMEngine.reserve_for_transfer). None when the pool is short."""
        self.bm.prime(rid, hashes)
        cached, num_cached = self.bm.find_cached_prefix(rid, prompt, root=params_root(params))
        if not self.bm.allocate(rid, len(prompt), cached):
            self.bm.free(rid)
            return None
        seq = Sequence(rid, prompt, params, arrival_time=arrival_s)
        seq.num_computed_tokens = num_cached
        seq.num_external_tokens = len(prompt) - num_cached
        return seq

    def activate(self, seq: Sequence, timing: Timing) -> None:
        """The KV arrived: the prefill worker's first token is appended and decoding goes on."""
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.bm.cache_full_blocks(seq.seq_id, seq.prompt_token_ids, seq.num_prompt_tokens, seq.hash_root)
        self.timing[seq.seq_id] = timing
        if self.sched.append_token(seq, OUTPUT_TOKEN, now=self.loop.now):
            self._done(seq)
            return
        self.sched.add(seq)
        self.kick()

    # ---- stepping
    def kick(self) -> None:
        if self.busy:
            if self._ff is not None:
                self._cut_fast_forward()
            return
        if self.sched.has_unfinished():
            self._step()

    def _step(self) -> None:
        if self._fast_forward():
            return
        out = self.sched.schedule()
        for seq in out.preempted:  # its blocks (and primed hashes) are gone; it will look again
            self.bm.prime(seq.seq_id, [])
        if out.empty:
            return  # blocked on KV blocks: a finish elsewhere frees some and kicks again
        shape = StepShape()
        for s in out.scheduled:
            seq, n, done = s.seq, s.num_new_tokens, s.seq.num_computed_tokens
            # a sequence with drafts computes n positions over its context: a short prefill chunk
            shape.add(done, n, decode=n == 1 and done == seq.num_tokens - 1 and done >= seq.num_prompt_tokens)
        dur = self.latency.step_s(shape)
        self.busy = True
        self.busy_s += dur
        self.num_steps += 1
        self.loop.after(dur, self._step_done, out, dur)

    def _step_done(self, out, dur: float) -> None:
        # still busy while the step's tokens go out: a request finishing here may bring the next
        # one (a closed loop), which must wait for this bookkeeping, not start a step inside it
        now = self.loop.now
        # One sequence at a time, each one's callbacks before the next one's bookkeeping: a
        # client whose request finishes may send its next one at once, and the router places it
        # by these instances' stats as they stand then. (The order this simulator has always
        # had; the engine does the whole step's bookkeeping before anyone hears of it.)
        for s in out.scheduled:
            seq, before, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            if seq.is_finished:
                continue
            if s.spec_token_ids:  # verified: the drafts accepted from the first, then one more
                a = 0
                while a < len(s.spec_token_ids) and self._rng.random() < self.spec_acceptance:
                    a += 1
                s.num_rejected = len(s.spec_token_ids) - a
                self.sched.drafter.observe(seq.seq_id, len(s.spec_token_ids), a)
                had = len(seq.output_token_ids)
                self.sched.update_from_output(SchedulerOutput([s]), [SampledToken(seq, OUTPUT_TOKEN)] * (a + 1), now)
                self._emitted(seq, now, dur, len(seq.output_token_ids) - had)
                continue
            samples = before + n == seq.num_tokens  # as the model runner decides: its last token was computed
            self.sched.update_from_output(
                SchedulerOutput([s]), [SampledToken(seq, OUTPUT_TOKEN)] if samples else (), now
            )
            if before < seq.num_prompt_tokens and self.on_chunk is not None:
                self.on_chunk(self, seq, before, n, dur)  # prefill role: this chunk's KV leaves layer by layer
            if samples:
                self._emitted(seq, now, dur)
        self.busy = False
        if self.on_step:
            self.on_step(self)
        self.kick()

    def _emitted(self, seq: Sequence, now: float, dur: float, count: int = 1) -> None:
        """`seq` got `count` tokens (one chunk of a stream) in the step that ended at `now`."""
        if self.role == "prefill":
            if not seq.is_finished:  # (its max_tokens is 1) the decode side goes on from here
                self.sched.finish(seq)
            self.timing.pop(seq.seq_id, None)
            self.on_prefilled(self, seq, now, dur)
            return
        self.timing[seq.seq_id].token(now, count)
        if seq.is_finished:
            self._done(seq)

    def _done(self, seq: Sequence) -> None:
        """A finished sequence (the scheduler has let it go): its client sees the end."""
        t = self.timing.pop(seq.seq_id)
        t.done = True
        if self.sched.drafter is not None:
            self.sched.drafter.forget(seq.seq_id)
        if self.on_finished:
            self.on_finished(self, seq)

    # ---- fast path for steady decoding
    def _fast_forward(self) -> bool:
        sched, bm = self.sched, self.bm
        running = sched.running
        if (
            self.role == "prefill"
            or sched.drafter is not None  # steps with drafts: each its own
            or len(sched.waiting)
            or not running
            or len(running) > sched.config.max_num_batched_tokens
        ):
            return False
        k = self.ff_max_steps
        context0 = 0
        for seq in running:
            done = seq.num_computed_tokens
            if seq.num_tokens - done != 1:
                return False
            k = min(k, seq.params.max_tokens - len(seq.output_token_ids))
            context0 += done
        if k < 2:
            return False
        bs, need = bm.block_size, 0
        for seq in running:
            # a sequence that owns more blocks than it needs frees none for the others
            need += max(0, -(-(seq.num_computed_tokens + k) // bs) - len(bm.seqs[seq.seq_id].blocks))
        if need > bm.num_free_blocks:
            return False
        for seq in running:
            if not bm.allocate(seq.seq_id, seq.num_computed_tokens + k):
                raise AssertionError("fast path: allocation failed after the free-block check")
        durs = self.latency.decode_steps_s(len(running), context0, k)
        ends, t = [], self.loop.now
        for d in durs.tolist():
            t += d
            ends.append(t)
        self._ff = _FastForward(list(running), self.loop.now, ends, k)
        self.busy = True
        self._version += 1
        self.loop.at(ends[-1], self._ff_done, self._version)
        return True

    def _cut_fast_forward(self) -> None:
        """New work: stop after the step in flight (it cannot be taken back)."""
        ff, now = self._ff, self.loop.now
        starts = [ff.start_s] + ff.ends_s[:-1]
        j = max(1, bisect.bisect_left(starts, now))
        if j < ff.k:
            ff.k = j
            self._version += 1
            self.loop.at(ff.ends_s[j - 1], self._ff_done, self._version)

    def _ff_done(self, version: int) -> None:
        if version != self._version:
            return
        ff, self._ff = self._ff, None
        k, ends = ff.k, ff.ends_s
        self.busy_s += ends[k - 1] - ff.start_s
        self.num_steps += k
        gaps = [ends[i] - ends[i - 1] for i in range(1, k)]
        for seq in ff.seqs:
            # k one-token steps: only the last token can meet a stop condition (k <= the
            # tokens left), so it alone goes through the scheduler's stop check
            seq.num_computed_tokens += k
            seq.output_token_ids.extend([OUTPUT_TOKEN] * (k - 1))
            finished = self.sched.append_token(seq, OUTPUT_TOKEN, now=ends[k - 1])
            t = self.timing[seq.seq_id]
            t.itl_s.append(ends[0] - t.last_s)
            t.itl_s.extend(gaps)
            t.last_s = ends[k - 1]
            t.tokens += k
            if finished:
                self._done(seq)
        self.busy = False
        if self.on_step:
            self.on_step(self)
        self.kick()

    # ---- what the router sees (heartbeat stats)
    def stats(self) -> dict:
        bm = self.bm
        return {
            "num_running": len(self.sched.running),
            "num_waiting": len(self.sched.waiting),
            "kv_usage": bm.usage,
            "num_free_blocks": bm.num_free_blocks,
            "num_blocks": bm.num_blocks,
            "kv_block_size": bm.block_size,
        }
