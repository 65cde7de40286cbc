"""A simulated deployment: clients, the router's own decisions, and instances.

Modes: "collocated" (N instances of role both), "chunked" (the same with
chunked prefill) and "disagg" (N prefill + M decode instances, KV moved
eager or layer-wise over a bandwidth). Placement is the router's `Placer`
(pdserve/router/placement.py) and early rejection its `Admitter`
(admission.py), fed with the instances' exact stats at the simulated clock
and a prefix index fed by the block managers' own KV events; the simulator
adds no policy of its own.

Clients follow pdserve bench: send times from pdserve/bench/arrivals.py,
per-tag and global concurrency limits, and the metrics of
pdserve/bench/metrics.py over the same `RequestOutput` records.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from pdserve.bench import arrivals, metrics
from pdserve.bench.client import RequestOutput
from pdserve.config import SchedulerConfig, SpeculativeConfig
from pdserve.costmodel import fit_decode_cost, fit_prefill_cost
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.router.admission import AdmissionConfig, Admitter
from pdserve.router.placement import Placer
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.sim.events import EventLoop
from pdserve.sim.instance import SimInstance, Timing
from pdserve.sim.latency import LatencyModel, StepShape, TransferModel
from pdserve.sim.workload import HashCache, SimRequest

MODES = ("collocated", "chunked", "disagg")
RESERVE_HEADROOM = 0.05  # share of a decode pool kept free of reservations


@dataclass
class PoolConfig:
    """Identical instances: how many, the latency model of one, its KV pool and scheduler."""

    count: int
    latency: LatencyModel
    num_blocks: int
    gpus_per_instance: int = 1
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class ClusterConfig:
    mode: str
    pools: dict[str, PoolConfig]  # "both", or "prefill" and "decode"
    block_size: int = 16
    enable_prefix_caching: bool = True
    transfer: TransferModel | None = None
    policy: str = "cache_aware"
    admission: AdmissionConfig | None = None
    max_concurrency: int | None = None
    tag_concurrency: dict[str, int] = field(default_factory=dict)
    # client <-> engine round trip (HTTP, the server's event loop, a router hop): half delays a
    # request's arrival at the router, half every token's arrival at the client. A closed-loop
    # user's next request then reaches a busy engine after the next step has begun and waits it
    # out, as on a real server. Measured by `pdserve sim --calibrate --served` (request_rtt_s).
    client_rtt_s: float = 0.0
    # speculative decoding on the instances that decode (config.SpeculativeConfig), and the
    # chance that each drafted token is accepted (independently, from the first until one is not)
    speculative: SpeculativeConfig | None = None
    spec_acceptance: float = 0.0

    def __post_init__(self):
        if not 0.0 <= self.spec_acceptance <= 1.0:
            raise ValueError("spec_acceptance is a probability, in [0, 1]")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        want = {"prefill", "decode"} if self.mode == "disagg" else {"both"}
        if set(self.pools) != want:
            raise ValueError(f"mode {self.mode} needs pools {sorted(want)}, got {sorted(self.pools)}")
        if self.mode == "disagg" and self.transfer is None:
            raise ValueError("disaggregated mode needs a transfer model")

    @property
    def gpus(self) -> int:
        return sum(p.count * p.gpus_per_instance for p in self.pools.values())


@dataclass
class _Handoff:
    """Disaggregated: a prompt on its prefill instance, and where its KV goes."""

    d_seq: Sequence  # the request's sequence on its decode instance (reserved there)
    d_id: str  # that decode instance
    kv_done_s: float = 0.0  # layer-wise: when the KV sent so far has all left the prefill instance


class _Gate:
    """A concurrency limit: requests over it wait, in order, for a slot."""

    def __init__(self, limit: int | None):
        self.limit, self.busy, self.queue = limit, 0, deque()


class Cluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.send_until_s: float | None = None
        self.loop = EventLoop()
        self.registry = Registry()
        self.index = PrefixIndex()
        self.hashes = HashCache(cfg.block_size)
        self.placer = Placer(cfg.policy, self.index, clock=lambda: self.loop.now)
        self.admitter = Admitter(cfg.admission) if cfg.admission and cfg.admission.enabled else None
        self.instances: dict[str, SimInstance] = {}
        self._event_seq: dict[str, int] = {}
        # disagg: placed requests waiting for room on their decode instance
        self._pending_d: dict[str, deque] = {}
        # ... and requests being prefilled, by id
        self._handoffs: dict[str, _Handoff] = {}
        for role, pool in cfg.pools.items():
            static = _cost_stats(pool.latency, cfg)
            for i in range(pool.count):
                wid = f"{role}-{i}"
                inst = SimInstance(
                    wid,
                    role,
                    pool.latency,
                    pool.scheduler,
                    pool.num_blocks,
                    cfg.block_size,
                    self.loop,
                    enable_prefix_caching=cfg.enable_prefix_caching,
                    record_events=cfg.policy == "cache_aware" and role != "decode",
                    speculative=cfg.speculative if role != "prefill" else None,
                    spec_acceptance=cfg.spec_acceptance,
                    seed=i + (1000 if role == "decode" else 0),
                )
                inst.on_prefilled, inst.on_finished, inst.on_step = self._prefilled, self._finished, self._stepped
                if role == "prefill":
                    inst.on_chunk = self._chunk_sent
                inst.static_stats = static
                self.instances[wid] = inst
                self._event_seq[wid] = 0
                self.registry.register(WorkerInfo(wid, f"sim://{wid}", role, stats={}))

    # ---- running a workload
    def run(
        self,
        requests: list[SimRequest],
        request_rate: float = math.inf,
        burstiness: float = 1.0,
        *,
        seed: int = 0,
        use_trace_times: bool = True,
        goodput: dict[str, float] | None = None,
        percentiles=metrics.DEFAULT_PERCENTILES,
        percentile_metrics=metrics.METRICS,
        send_until_s: float | None = None,
    ) -> dict:
        """Simulate every request; the result has pdserve bench's fields plus a "sim" section.

        `send_until_s`, as `pdserve bench`'s: a request without its own arrival time
        (a closed loop's) whose turn comes later than this is not sent, and the
        result describes the requests sent (`request_indices`)."""
        wall0 = time.perf_counter()
        self.send_until_s = send_until_s
        for wid, inst in self.instances.items():  # its draws (draft acceptance) follow the run's seed
            inst.reseed(f"{seed}:{wid}")
        times = arrivals.schedule(requests, request_rate, burstiness, seed=seed, use_trace_times=use_trace_times)
        self.outputs = [RequestOutput(prompt_len=r.prompt_len, tag=r.tag) for r in requests]
        self.gates = {t: _Gate(n) for t, n in self.cfg.tag_concurrency.items()}
        self.overall = _Gate(self.cfg.max_concurrency)
        self._live: dict[str, tuple[SimRequest, Timing]] = {}
        for r, t in sorted(zip(requests, times), key=lambda rt: rt[1]):
            self.loop.at(t, self._arrive, r)
        self.loop.run()
        for rid in list(self._live):  # nothing left to happen, yet not finished: say so
            _, t = self._live[rid]
            t.error = "never finished: the simulated cluster stalled (decode KV held by reservations)"
            self._done(rid)
        sent = [i for i, o in enumerate(self.outputs) if o.sent]
        outs = [self.outputs[i] for i in sent]
        end = max((o.start_s + o.latency_s for o in outs if o.success), default=0.0)
        start = min(times) if times else 0.0
        res = metrics.result(
            outs, end - start, percentiles=percentiles, percentile_metrics=percentile_metrics, goodput=goodput
        )
        if len(sent) < len(self.outputs):
            res.update(request_indices=sent, num_unsent=len(self.outputs) - len(sent))
        wall = time.perf_counter() - wall0
        res["sim"] = self._summary(len(requests), wall)
        return res

    def _summary(self, n: int, wall_s: float) -> dict:
        insts = self.instances.values()
        span = self.loop.now or 1.0
        return {
            "mode": self.cfg.mode,
            "gpus": self.cfg.gpus,
            "simulated_s": self.loop.now,
            "wall_s": wall_s,
            "requests_per_wall_s": n / wall_s if wall_s > 0 else None,
            "events": self.loop.num_events,
            "policy": self.cfg.policy,
            "instances": {
                i.worker_id: {
                    "steps": i.num_steps,
                    "busy_pct": 100.0 * i.busy_s / span,
                    "preemptions": i.sched.num_preemptions,
                    "prefix_hit_pct": 100.0 * i.bm.stats.hit_rate,
                }
                for i in insts
            },
            "rejected": dict(self.admitter.rejected) if self.admitter else {},
        }

    # ---- clients
    def _arrive(self, r: SimRequest) -> None:
        gate = self.gates.get(r.tag)
        if gate is not None and gate.limit is not None and gate.busy >= gate.limit:
            gate.queue.append(r)
            return
        self._through_tag(r)

    def _through_tag(self, r: SimRequest) -> None:
        gate = self.gates.get(r.tag)
        if gate is not None:
            gate.busy += 1
        if self.overall.limit is not None and self.overall.busy >= self.overall.limit:
            self.overall.queue.append(r)
            return
        self._send(r)

    def _send(self, r: SimRequest) -> None:
        self.overall.busy += 1
        out = self.outputs[r.rid]
        if self.send_until_s is not None and r.arrival_s is None and self.loop.now > self.send_until_s:
            out.sent = False  # a closed loop past its duration: this user stops
            self.loop.at(self.loop.now, self._release, r)  # an event, not a call: a long queue must not recurse
            return
        out.start_s = self.loop.now
        timing = Timing(self.loop.now)
        self._live[str(r.rid)] = (r, timing)
        if self.cfg.client_rtt_s > 0:
            self.loop.at(self.loop.now + self.cfg.client_rtt_s / 2, self._route, r, timing)
        else:
            self._route(r, timing)

    def _done(self, rid: str) -> None:
        r, t = self._live.pop(rid)
        out = self.outputs[r.rid]
        if t.error:
            out.error = t.error
        else:
            back = self.cfg.client_rtt_s / 2  # every token reaches the client this much later
            out.success = True
            out.output_tokens = t.tokens
            out.ttft_s = t.first_s - t.start_s + back
            out.itl_s = t.itl_s
            out.latency_s = t.last_s - t.start_s + back
            if back > 0:  # the user sees the end (and sends the next request) then
                self.loop.at(self.loop.now + back, self._release, r)
                return
        self._release(r)

    def _release(self, r: SimRequest) -> None:
        """A request's client slots are free: the next one waiting for them goes."""
        self.overall.busy -= 1
        if self.overall.queue:
            self._send(self.overall.queue.popleft())
        gate = self.gates.get(r.tag)
        if gate is not None:
            gate.busy -= 1
            if gate.queue:
                self._through_tag(gate.queue.popleft())

    # ---- the router
    def _refresh_stats(self) -> None:
        for wid, inst in self.instances.items():
            w = self.registry.get(wid)
            s = inst.stats()
            s.update(inst.static_stats)
            s["running_context_tokens"] = sum(q.num_computed_tokens for q in inst.sched.running)
            w.stats = s

    def _route(self, r: SimRequest, timing: Timing) -> None:
        prompt = r.prompt_ids()
        # the router gets the prompt as int32: it hashes it (cache_aware) and int32 slices hash fast
        arr = r.prompt_array(prompt)
        hashes = self.hashes.prompt_hashes(r, arr) if self.cfg.enable_prefix_caching else []
        need = -(-(r.prompt_len + r.output_len) // self.cfg.block_size)
        smallest = min(p.num_blocks for p in self.cfg.pools.values())
        if need > smallest:
            return self._fail(
                str(r.rid), timing, f"prompt + max_tokens needs {need} KV blocks; the pool holds {smallest}"
            )
        for pool in self.cfg.pools.values():
            sc = pool.scheduler
            if (
                not sc.enable_chunked_prefill
                and r.prompt_len > sc.max_num_batched_tokens
                and (self.cfg.mode == "collocated" or pool is self.cfg.pools.get("prefill"))
            ):
                return self._fail(
                    str(r.rid),
                    timing,
                    f"the prompt has {r.prompt_len} tokens, more than max_num_batched_tokens with chunked prefill off",
                )
        self._refresh_stats()
        if self.admitter is not None:
            d = self.admitter.check(self.registry, self.placer, arr, r.output_len)
            if not d.admitted:
                return self._fail(str(r.rid), timing, f"429 refused to protect the SLOs ({d.reason})")
        p, dw = self.placer.pick(self.registry, arr)
        rid = str(r.rid)
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0)
        if self.cfg.mode != "disagg":
            seq = Sequence(rid, prompt, params, arrival_time=self.loop.now)
            self.instances[p.worker_id].add(seq, timing, hashes)
            return
        if hasattr(self.placer, "book_decode"):
            self.placer.book_decode(dw.worker_id, rid, r.prompt_len, r.output_len)
        self._reserve_then_prefill(rid, prompt, hashes, params, timing, p.worker_id, dw.worker_id)

    def _reserve_then_prefill(self, rid, prompt, hashes, params, timing, p_id, d_id) -> None:
        d = self.instances[d_id]
        pending = self._pending_d.setdefault(d_id, deque())
        seq = (
            None if pending or not self._room(d, len(prompt)) else d.reserve(rid, prompt, hashes, params, self.loop.now)
        )
        if seq is None:  # no room on that decode instance now: wait, in order, for room there
            pending.append((rid, prompt, hashes, params, timing, p_id, d_id))
            return
        self._start_prefill(seq, rid, prompt, hashes, params, timing, p_id, d_id)

    def _start_prefill(self, seq, rid, prompt, hashes, params, timing, p_id, d_id) -> None:
        p = self.instances[p_id]
        pseq = Sequence(
            rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0), arrival_time=self.loop.now
        )
        self._handoffs[rid] = _Handoff(seq, d_id)
        p.add(pseq, Timing(timing.start_s), hashes)

    def _room(self, d: SimInstance, prompt_tokens: int) -> bool:
        """A decode instance takes a reservation only when nothing waits there for blocks and
        RESERVE_HEADROOM of its pool stays free for the running sequences to grow into: the engine's
        reservations bypass its scheduler, so without this a preempted sequence could starve."""
        bm = d.bm
        need = bm.blocks_needed(prompt_tokens)
        if not d.sched.has_unfinished():
            return True
        return not d.sched.waiting and bm.num_free_blocks - need >= RESERVE_HEADROOM * bm.num_blocks

    def _retry_pending(self, d: SimInstance) -> None:
        pending = self._pending_d.get(d.worker_id)
        while pending and self._room(d, len(pending[0][1])):
            item = pending.popleft()
            seq = d.reserve(item[0], item[1], item[2], item[3], self.loop.now)
            if seq is None:
                pending.appendleft(item)
                return
            self._start_prefill(seq, *item)

    def _chunk_sent(self, p: SimInstance, pseq: Sequence, start: int, n: int, step_s: float) -> None:
        """Layer-wise: a prompt chunk's KV leaves layer by layer while the step computes, on the
        prefill instance's link (shared by all its transfers). Tokens the decode side caches stay."""
        tr = self.cfg.transfer
        h = self._handoffs[pseq.seq_id]
        tokens = start + n - max(start, h.d_seq.num_computed_tokens)
        if not tr.layerwise or tokens <= 0:
            return
        now = self.loop.now
        busy_s, exposed_s = tr.exposed_s(tokens * p.latency.kv_bytes_per_token(), p.latency.layers(), step_s)
        done = max(now + exposed_s - tr.latency_s, p.link_free_s + busy_s)
        p.link_free_s = h.kv_done_s = done

    def _prefilled(self, p: SimInstance, pseq: Sequence, now: float, step_s: float) -> None:
        """The prefill instance sampled the first token (it streams at once); the KV follows:
        already on its way (layer-wise) or all of it now (eager)."""
        rid = pseq.seq_id
        _, timing = self._live[rid]
        timing.token(now)
        h = self._handoffs.pop(rid)
        tr = self.cfg.transfer
        if tr.layerwise:
            done = max(now, h.kv_done_s) + tr.latency_s
        else:
            tokens = h.d_seq.num_external_tokens
            busy_s = tr.exposed_s(tokens * p.latency.kv_bytes_per_token(), p.latency.layers(), step_s)[0]
            done = max(now, p.link_free_s) + busy_s
            p.link_free_s = done
            done += tr.latency_s
        self.loop.at(done, self._kv_arrived, h.d_id, h.d_seq, timing)

    def _kv_arrived(self, d_id: str, d_seq: Sequence, timing: Timing) -> None:
        self.instances[d_id].activate(d_seq, timing)

    def _finished(self, inst: SimInstance, seq: Sequence) -> None:
        if hasattr(self.placer, "release_decode"):
            self.placer.release_decode(seq.seq_id)
        self._done(seq.seq_id)

    def _fail(self, rid: str, timing: Timing, error: str) -> None:
        timing.error = error
        self._done(rid)

    def _stepped(self, inst: SimInstance) -> None:
        """After a step: reservations that waited for room; the block manager's KV events to the
        router's prefix index."""
        if inst.role == "decode" and self._pending_d.get(inst.worker_id):
            self._retry_pending(inst)
        if not inst.bm.record_events:
            return
        evs = inst.bm.drain_events()
        if not evs:
            return
        n = self._event_seq[inst.worker_id]
        batch = [{"seq": n + i + 1, "kind": e.kind, "block_hashes": e.block_hashes} for i, e in enumerate(evs)]
        self._event_seq[inst.worker_id] = n + len(evs)
        self.index.apply_events(inst.worker_id, "sim", batch)


def _cost_stats(lat: LatencyModel, cfg: ClusterConfig) -> dict:
    """What a worker reports about itself: D_prefill(L) and the decode step model, fitted by the
    workers' own functions (costmodel.fit_*) to what the latency model says, as workers calibrate."""
    lengths = [64, 256, 1024, 4096, 16384]
    pre = fit_prefill_cost(
        [
            (n, lat.step_s(StepShape(prefill_tokens=n, prefill_seqs=1, prefill_attention=n * (n + 1) / 2)))
            for n in lengths
        ]
    )
    dec = fit_decode_cost(
        [
            (b, b * c, lat.step_s(StepShape(decode_seqs=b, decode_context=b * c)))
            for b in (1, 8, 32, 128)
            for c in (256, 2048, 8192)
        ]
    )
    return {
        pre.STATS_KEY: pre.terms(),
        dec.STATS_KEY: dec.terms(),
        "kv_bytes_per_token": lat.kv_bytes_per_token(),
        "num_layers": lat.layers(),
        "kv_layerwise": cfg.transfer.layerwise if cfg.transfer else True,
    }
