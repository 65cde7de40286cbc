"""The router's engine: each request is a prefill on one worker and a decode on another.

`DisaggEngine` implements the same `EngineClient` as the collocated
`AsyncEngine` (pdserve/server/engine_client.py: `submit` -> a group with
`accepted` / `next_batch` / `abort`), so the very same OpenAI app
(pdserve/server/app.py) serves both modes.

Flow for one choice: pick (P, D); D reserves blocks (keeping any prefix it
caches); P prefills and streams the first token, which goes to the client at
once (TTFT), while its KV streams to D layer by layer; D decodes the rest.
Failures: P gone before the first token -> D recomputes the prompt; the KV lost
on the way -> D recomputes; D gone, or silent past the heartbeat timeout ->
the request moves to another worker, replaying prompt + tokens so far. While
one role has no live worker, a live worker of the other role runs requests
whole (both roles are the same engine).

Every call to a worker is signed with the cluster secret (pdserve/auth.py), and
every body and answer is a model of pdserve/control_api.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import Counter
from typing import TypeVar

import httpx
from pydantic import BaseModel

from pdserve import auth, tracing
from pdserve.control_api import (
    LORA_ENABLED_FEATURE,
    LORA_FEATURE_PREFIX,
    AbortRequest,
    DecodeRequest,
    DrainResponse,
    ErrorEvent,
    FirstTokenEvent,
    GenerateRequest,
    KVFailedRequest,
    KVFailedResponse,
    KVReadyEvent,
    LoadLoRARequest,
    LoadLoRAResponse,
    LoRAListResponse,
    LoRASource,
    OutputEvent,
    PrefillRequest,
    PullRequest,
    PullResponse,
    ReserveRequest,
    ReserveResponse,
    SavedEvent,
    UnloadLoRARequest,
    UnloadLoRAResponse,
    adapter_features,
    adapters_of,
    features_needed,
    logprobs_from_wire,
    params_to_json,
    parse_event,
)
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import choice_request_id
from pdserve.kv.hashing import params_root
from pdserve.router import conductor
from pdserve.router.placement import Placer
from pdserve.router.pools import PoolManager
from pdserve.server.engine_client import ChoiceOutput, Completion, EngineInput
from pdserve.server.errors import APIError
from pdserve.server.metrics import KV_TRANSFER_BUCKETS_S, Histogram
from pdserve.settings import KV_TIMEOUT_S  # `--kv-timeout-s`: its one default

log = logging.getLogger("pdserve.router")
LORA_CALL_TIMEOUT_S = 60.0  # a worker's adapter load, unload or list (a load reads the files)
MAX_UNLOADED_KEPT = 1024  # adapter names remembered as unloaded, for workers that were away
Reply = TypeVar("Reply", bound=BaseModel)


class WorkerGone(Exception):
    """A worker could not be reached or its stream broke."""


class WorkerLost(WorkerGone):
    """The worker missed its heartbeats while we streamed from it (stopped, hung, cut off)."""


class WorkerSlow(WorkerGone):
    """A call to a worker timed out: the request fails over, but a worker that is busy (one
    core, a long prefill, the router and a client beside it) is not dead; its heartbeats say."""


def _unreachable(w, e: Exception) -> WorkerGone:
    cls = WorkerSlow if isinstance(e, httpx.TimeoutException) else WorkerGone
    return cls(f"{w.worker_id}: {type(e).__name__}" + (f": {e}" if str(e) else ""))


class _Choice:
    """One engine-level request: accumulates what the workers stream (the tokens, to resume it
    elsewhere; the text and logprobs, for its final completion)."""

    def __init__(self, group, index: int, rid: str, inp: EngineInput):
        self.group, self.index, self.rid = group, index, rid
        self.prompt, self.params = inp.prompt_token_ids, inp.params
        self.hash_root = params_root(inp.params)  # its block hashes start here
        # the workers that may run it: those with the features it needs (a rolling upgrade)
        self.needs = features_needed(inp.params)
        self.registry = group.engine.registry.having(self.needs)
        # resumed: what the choice streamed through a router that died (the front resumes it)
        self.resumed = bool(inp.resume_token_ids)
        self.token_ids: list[int] = list(inp.resume_token_ids or ())
        self._texts: list[str] = []
        self.logprobs: list[dict] | None = [] if self.params.logprobs is not None else None
        self.prompt_logprobs: list[dict | None] | None = None  # from the worker that computed the prompt
        self.num_cached_tokens: int | None = None  # the same worker's: the first that says
        self.prompt_logprob_ranks: list[int | None] | None = None  # with prompt_logprobs
        self.finished = False
        self.arrival_s = time.monotonic()
        # a resumed choice had its first token long ago: its gaps count from now, not its TTFT
        self.first_token_s = self.last_token_s = self.arrival_s if self.resumed else None
        self.workers: set[str] = set()
        self.remote_ids: dict[str, str] = {}  # worker id -> the request id used there
        self.span = tracing.NO_SPAN  # its "route" span, while it runs (tracing.py)

    def emit(self, ev: OutputEvent | FirstTokenEvent) -> None:
        """Add what a worker streamed, and hand it to the front end as the ChoiceOutput the
        collocated engine would have given (engine_client.py)."""
        ids = list(ev.token_ids)
        self.token_ids += ids
        self._texts.append(ev.text)
        new_lps = None
        if self.logprobs is not None:
            new_lps = logprobs_from_wire(ev.logprobs)
            self.logprobs += new_lps
        new_cached = None
        if self.num_cached_tokens is None and ev.num_cached_tokens is not None:
            new_cached = self.num_cached_tokens = ev.num_cached_tokens
        new_plps = None
        new_ranks = None
        if ev.prompt_logprobs and self.prompt_logprobs is None:
            new_plps = self.prompt_logprobs = logprobs_from_wire(ev.prompt_logprobs)
            new_ranks = self.prompt_logprob_ranks = ev.prompt_logprob_ranks
        self.finished = ev.finished
        now = time.monotonic()
        m = self.group.engine.metrics
        if ids:
            if self.first_token_s is None:
                self.first_token_s = now
                # the prefill worker's own prefill time, when it says: the rest of TTFT waited
                # (in the router, on the way, in the worker's queue)
                prefill_s = ev.prefill_s
                scheduled = None if prefill_s is None else max(self.arrival_s, now - prefill_s)
                m.on_first_token(self.arrival_s, scheduled, now, len(self.prompt))
                gap = None
            else:
                gap = now - self.last_token_s
            self.last_token_s = now
            m.on_tokens(len(ids), gap)
        final = None
        if self.finished:
            final = Completion(
                "".join(self._texts),
                self.token_ids,
                self.logprobs,
                ev.finish_reason,
                ev.stop_reason,
                prompt_logprobs=self.prompt_logprobs,
                num_cached_tokens=self.num_cached_tokens,
                prompt_logprob_ranks=self.prompt_logprob_ranks,
            )
            m.on_finish(
                final.finish_reason or "stop",
                self.arrival_s,
                self.first_token_s,
                self.last_token_s,
                len(self.token_ids),
            )
        out = ChoiceOutput(
            ids,
            ev.text,
            new_lps,
            final,
            prompt_logprobs=new_plps,
            num_cached_tokens=new_cached,
            prompt_logprob_ranks=new_ranks,
        )
        self.group._queue.put_nowait((self.index, out))


class RouterGroup:
    def __init__(self, engine: DisaggEngine, request_id: str, inputs, priority: int, trace=None):
        self.engine = engine
        self.request_id = request_id
        self.trace = trace if trace is not None else tracing.NO_SPAN  # the API request's span
        self.subs = [_Choice(self, i, choice_request_id(request_id, i), inp) for i, inp in enumerate(inputs)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ack: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending_acks = len(self.subs)
        self._num_finished = 0
        self.tasks = [asyncio.create_task(engine.run_choice(c)) for c in self.subs]

    def acknowledge(self, err: APIError | None = None) -> None:
        if self._ack.done():
            return
        if err is not None:
            self._ack.set_exception(err)
            self._stop(finished=False)  # refused before it was accepted: not a finished request
            return
        self._pending_acks -= 1
        if self._pending_acks == 0:
            self._ack.set_result(None)

    def fail(self, err: APIError) -> None:
        if not self._ack.done():
            self.acknowledge(err)
        else:
            self._queue.put_nowait(err)

    async def accepted(self) -> None:
        await asyncio.shield(self._ack)

    async def next_batch(self):
        if self._num_finished == len(self.subs):
            return None
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for item in items:
            if isinstance(item, APIError):
                raise item
            if item[1].finished:
                self._num_finished += 1
        return items

    def abort(self) -> None:
        """The client left (or the request failed): stop every choice still running, each a
        finished request with reason "abort"."""
        self._stop(finished=True)

    def _stop(self, finished: bool) -> None:
        """Stop every choice still running; count them as finished (aborted) requests only if
        `finished`: a request refused before it was accepted (a 400, a 503) never started, and
        the collocated server does not count one either."""
        m = self.engine.metrics
        for c, t in zip(self.subs, self.tasks):
            if not t.done():
                t.cancel()
                if not c.finished:
                    c.finished = True  # counted once, however often abort is called
                    # a choice that already had its first token counted (a sibling refused
                    # after it started) ends as an abort in the metrics too
                    if finished or c.first_token_s is not None:
                        m.on_finish("abort", c.arrival_s, c.first_token_s, c.last_token_s, len(c.token_ids))


class DisaggEngine:
    """The OpenAI app's EngineClient (pdserve/server/engine_client.py); places work on remote workers."""

    def __init__(
        self,
        core,
        registry,
        metrics,
        placer: Placer | None = None,
        kv_timeout_s: float = KV_TIMEOUT_S,
        max_in_flight: int = 1024,
        kv_mode: str = "push",
        admitter=None,
        secret: bytes | None = None,
        max_local_prefill_length: int = 0,
    ):
        self.engine = core  # tokenizer, model_config, max_model_len: what the app reads
        self.registry = registry
        self.metrics = metrics
        self.placer = placer or Placer()
        self.admitter = admitter  # router.admission.Admitter: early rejection, or None
        self.kv_timeout_s = kv_timeout_s
        if kv_mode not in ("push", "pull"):
            raise ValueError("kv_mode must be push or pull")
        self.kv_mode = kv_mode
        self.max_in_flight = max_in_flight
        if max_local_prefill_length < 0:
            raise ValueError("max_local_prefill_length must be >= 0")
        self.max_local_prefill_length = max_local_prefill_length
        self.draining = False
        self.ready = asyncio.Event()
        self.stats: dict | None = None
        self._counter_last: dict[tuple[str, str], float] = {}  # (worker id, counter): its last value
        self._counter_base: dict[str, float] = {}  # what workers counted before they restarted
        self.num_waiting = 0
        self.counters = {
            "kv_bytes": 0,
            "kv_seconds": 0.0,
            "kv_failed": 0,
            "kv_retries": 0,
            "recomputed": 0,
            "replaced": 0,
            "whole": 0,
            "local_prefill": 0,
            "resumed": 0,
            "kv_exposed_bytes": 0.0,
            "kv_exposed_seconds": 0.0,
            "lora_synced": 0,
        }
        # per transfer, as the prefill workers report them: what P99 TTFT is made of, not just totals
        self.kv_transfer_time = Histogram(
            "pdserve:kv_transfer_duration_seconds",
            "Per request: from the start of its KV transfer to the decode worker's acknowledgement of the last layer.",
            KV_TRANSFER_BUCKETS_S,
        )
        self.kv_exposed_time = Histogram(
            "pdserve:kv_transfer_exposed_duration_seconds",
            "Per request: the part of its KV transfer left after its prefill ended (what its first token waited for).",
            KV_TRANSFER_BUCKETS_S,
        )
        self._groups: set[RouterGroup] = set()
        self._http: httpx.AsyncClient | None = None
        self._auth = auth.http_auth(secret) if secret is not None else None
        self._watched: dict[str, set[asyncio.Task]] = {}  # worker id -> streams read from it now
        self._lost: set[asyncio.Task] = set()  # of those, the ones cancelled because the worker went silent
        self._aborts: set[asyncio.Task] = set()  # aborts on their way to workers
        self._syncing: dict[str, asyncio.Task] = {}  # worker id -> its run-time adapters being loaded there
        self._lora_updates = 0  # run-time loads and unloads so far (a sync that raced one checks again)
        self._lora_unloaded: dict[str, None] = {}  # names unloaded at run time (oldest first), not loaded since
        self.started_s = time.monotonic()
        self.startup_grace_s = max(5.0, 2 * registry.timeout_s)
        self.pools = PoolManager(registry, self._drain_worker, log=log)
        self._expiry: asyncio.Task | None = None
        self._pool_task: asyncio.Task | None = None

    # ---- lifecycle
    def start(self) -> None:
        self._http = httpx.AsyncClient(
            trust_env=False,  # internal traffic: an operator's http_proxy must not catch it
            timeout=httpx.Timeout(10.0, read=None),
            auth=self._auth,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
        )
        self._expiry = asyncio.get_running_loop().create_task(self._expire_loop())
        self._pool_task = asyncio.get_running_loop().create_task(self._pool_loop())
        self.started_s = time.monotonic()
        self.refresh_stats()
        self.ready.set()

    @property
    def awaiting_workers(self) -> bool:
        """A fresh (or restarted) router gives workers a few heartbeats to register before it
        refuses requests for want of them: a request that arrives first waits instead."""
        return not self.registry.alive() and time.monotonic() - self.started_s < self.startup_grace_s

    async def _workers_registered(self) -> None:
        while self.awaiting_workers:
            await asyncio.sleep(0.05)

    async def _expire_loop(self) -> None:
        period_s = self.registry.timeout_s / 4
        last_s = time.monotonic()
        while True:
            now = time.monotonic()
            stalled_s = now - last_s - period_s
            if stalled_s > 0.1:
                # this loop itself did not run (the router was stopped, or its loop blocked): the
                # workers' beats waited unread in the sockets, so that silence is ours, not theirs
                if stalled_s > self.registry.timeout_s / 2:
                    log.warning("the router stalled for %.1f s: its workers are not blamed for it", stalled_s)
                self.registry.forgive(stalled_s)
            last_s = now
            gone = self.registry.expire(now)
            if gone:
                # a worker that drained (retired, or stopped by its operator) went quiet on purpose
                drained = [wid for wid in gone if (w := self.registry.get(wid)) is not None and w.draining]
                lost = [wid for wid in gone if wid not in drained]
                if drained:
                    log.info("%s drained and stopped", ", ".join(drained))
                if lost:
                    log.warning(
                        "no heartbeat from %s for %.1f s: counted dead", ", ".join(lost), self.registry.timeout_s
                    )
                self.workers_lost(gone)
            self.refresh_stats()  # also after workers found dead by failed calls
            await asyncio.sleep(period_s)

    async def _pool_loop(self) -> None:
        interval_s = self.pools.autoscale.interval_s if self.pools.autoscale is not None else 1.0
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.pools.tick()
            except Exception:  # a bad round must not end the loop
                log.exception("pool management round failed")

    async def _drain_worker(self, w) -> None:
        try:
            await self._post(w, "/internal/drain", None, DrainResponse)
        except (WorkerGone, APIError) as e:
            log.warning("could not ask %s to drain: %s", w.worker_id, e)

    def workers_lost(self, worker_ids) -> None:
        """Fail over every stream read from these workers now, as if they had died: a
        stopped process keeps its sockets open, and its streams would freeze with it."""
        for wid in worker_ids:
            tasks = self._watched.get(wid, set())
            if tasks:
                log.warning("worker %s missed its heartbeats: moving its %d stream(s) elsewhere", wid, len(tasks))
            for t in list(tasks):
                self._lost.add(t)
                t.cancel()

    async def _watch(self, w, coro):
        """Run `coro` (reading a stream from worker w) so that losing w fails it over with WorkerLost."""
        task = asyncio.ensure_future(coro)
        self._watched.setdefault(w.worker_id, set()).add(task)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if task in self._lost:
                raise WorkerLost(f"{w.worker_id} missed its heartbeats") from None
            task.cancel()  # our caller was cancelled (client gone): stop reading too
            raise
        finally:
            self._watched[w.worker_id].discard(task)
            self._lost.discard(task)

    def refresh_stats(self) -> None:
        """What /health shows: the decode pool's KV and everyone's queues."""
        alive = self.registry.alive()
        # the decode pool's KV; with no decode worker, the prefill workers serve requests whole
        dec = [w.stats for w in alive if w.can_decode() and w.stats] or [w.stats for w in alive if w.stats]
        num_blocks = sum(s.get("num_blocks", 0) for s in dec)
        free = sum(s.get("num_free_blocks", 0) for s in dec)
        self.stats = {
            "num_running": sum(w.stats.get("num_running", 0) for w in alive if w.stats),
            "num_waiting": sum(w.stats.get("num_waiting", 0) for w in alive if w.stats),
            "num_free_blocks": free,
            "num_fenced_blocks": sum(s.get("num_fenced_blocks", 0) for s in dec),
            "num_blocks": num_blocks,
            "kv_usage": 1 - free / num_blocks if num_blocks else 0.0,
            "workers_alive": {r: len(self.registry.alive(r)) for r in ("prefill", "decode")},
        }
        self.stats.update(self._worker_counters())
        stores = [w.stats["kv_store"] for w in alive if w.stats and isinstance(w.stats.get("kv_store"), dict)]
        if stores:
            self.stats["kv_store"] = sum_kv_store_stats(stores)
        loras = [w.stats["lora"] for w in alive if w.stats and isinstance(w.stats.get("lora"), dict)]
        if loras:  # the pool's: every worker's adapters, each worker's max
            self.stats["lora"] = {
                "running": sorted({str(n) for s in loras for n in s.get("running") or ()}),
                "waiting": sorted({str(n) for s in loras for n in s.get("waiting") or ()}),
                "max_lora": max(int(s.get("max_lora") or 0) for s in loras),
            }
        self.metrics.set_engine_stats(self.stats)

    # the workers' own counters, summed into the router's /metrics
    WORKER_COUNTERS = (
        "prefix_cache_queries_tokens",
        "prefix_cache_hits_tokens",
        "num_preemptions",
        "prompt_tokens_computed",
        "spec_decode_num_drafts",
        "spec_decode_num_draft_tokens",
        "spec_decode_num_accepted_tokens",
    )

    def _worker_counters(self) -> dict[str, float]:
        """Totals that never go down: a dead worker's last count stays in (it happened), and a
        worker whose count fell has restarted from 0, so its count before stays in too.
        Prometheus reads a total that falls as a counter reset and its rate() goes wrong."""
        for w in self.registry.all():
            for key in self.WORKER_COUNTERS:
                v = (w.stats or {}).get(key)
                if v is None:
                    continue
                last = self._counter_last.get((w.worker_id, key), 0)
                if v < last:
                    self._counter_base[key] = self._counter_base.get(key, 0) + last
                self._counter_last[(w.worker_id, key)] = v
        # speculative decoding's, only once a worker has them (workers without it report none)
        totals = {k: 0 for k in self.WORKER_COUNTERS if not k.startswith("spec_decode_")}
        for (_, key), v in self._counter_last.items():
            totals.setdefault(key, 0)
            totals[key] += v
        return {k: v + self._counter_base.get(k, 0) for k, v in totals.items()}

    async def shutdown(self, reason: str = "the router is shutting down") -> None:
        self.draining = True
        for task in (self._expiry, self._pool_task, *self._syncing.values()):
            if task is not None:
                task.cancel()
        self.fail_all(APIError(503, reason))
        if self._http is not None:
            await self._http.aclose()

    def fail_all(self, err: APIError) -> None:
        for g in list(self._groups):
            g.fail(err)
            g.abort()

    # how long a router waits for its first worker before it calls itself failed: long enough
    # for workers to load a large model, short enough that a wrong --router URL or cluster
    # secret (workers that can never register) reaches an alert on "failed"
    first_worker_timeout_s = 600.0

    @property
    def loading(self) -> str | None:
        """Until the first worker registers (a fresh deployment whose workers still load their
        model, or a router started before its workers), the router is not failed but loading."""
        if self.registry.all() or time.monotonic() - self.started_s > self.first_worker_timeout_s:
            return None
        return "waiting for the first worker to register"

    @property
    def failure(self) -> str | None:
        """Why requests cannot be served now (the app answers 503 with it), or None. One live
        worker of either role is enough: it runs requests whole until the other role is back."""
        if self.registry.alive() or self.awaiting_workers or self.loading:
            return None
        if not self.registry.all():
            return (
                f"no worker has registered in {self.first_worker_timeout_s:.0f} s: check the workers' "
                "--router URL and that they hold this deployment's cluster secret"
            )
        return "no worker is alive"

    def _no_worker(self, c: _Choice | None = None) -> APIError:
        """The 503 for a request no worker can take: not ready yet (none has registered), every
        worker it knew is gone, or those alive are too old for what it asks."""
        if c is not None and c.needs and self.registry.alive():
            return APIError(
                503,
                f"no live worker supports {', '.join(sorted(c.needs))} (workers older than the router: upgrade them)",
                code="no_workers",
                headers={"Retry-After": "2"},
            )
        if self.loading:
            return APIError(503, f"not ready: {self.loading}", code="loading", headers={"Retry-After": "2"})
        return APIError(503, "no worker is alive", code="no_workers", headers={"Retry-After": "2"})

    @property
    def num_in_flight(self) -> int:
        return sum(len(g.subs) for g in self._groups)

    async def compile_constraints(self, params: list[SamplingParams]) -> None:
        """Nothing here: the workers compile the constraints they are sent (and refuse those
        that do not compile with a 400 the client gets)."""

    def lora_adapters(self) -> dict[str, str]:
        """The adapters the live workers hold. Workers that hold different weights under one
        name (an upgrade under way) give the name the key most of them hold; a request is placed
        only on workers with that key."""
        return self._adapters_held()

    def _adapters_held(self, exclude: str | None = None) -> dict[str, str]:
        """lora_adapters, of the live workers but `exclude`."""
        workers = [w for w in self.registry.alive() if w.worker_id != exclude]
        counts = Counter(key for w in workers for key in adapters_of(w.features))
        out: dict[str, str] = {}
        for key, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            out.setdefault(key.rsplit("@", 1)[0], key)
        return out

    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> str:
        """Load an adapter on every live worker, or on none: where one refuses (a bad adapter, a
        worker without --enable-lora), those that loaded it unload it again. `path` is read on
        each worker's host."""
        self._lora_updates += 1
        have = self.lora_adapters().get(name)
        if have is not None and not replace:
            raise APIError(
                400, f"the LoRA adapter {name!r} is already loaded (load_inplace replaces it)", param="lora_name"
            )
        workers = self.registry.alive()
        if not workers:
            raise self._no_worker()
        body = LoadLoRARequest(lora_name=name, lora_path=path, load_inplace=replace)
        results = await asyncio.gather(
            *(self._post(w, "/internal/lora/load", body, LoadLoRAResponse) for w in workers), return_exceptions=True
        )
        failed = [(w, r) for w, r in zip(workers, results) if isinstance(r, BaseException)]
        if failed:
            if have is None:  # all or nothing (an adapter replaced in place stays replaced where it was)
                undo = UnloadLoRARequest(lora_name=name)
                await asyncio.gather(
                    *(
                        self._post(w, "/internal/lora/unload", undo, UnloadLoRAResponse)
                        for w, r in zip(workers, results)
                        if not isinstance(r, BaseException)
                    ),
                    return_exceptions=True,
                )
            w, err = failed[0]
            if isinstance(err, APIError):
                raise APIError(err.status, f"worker {w.worker_id}: {err.message}", param=err.param)
            raise APIError(503, f"worker {w.worker_id} could not load the adapter: {err}")
        for w, r in zip(workers, results):  # what each holds now (room made may have unloaded another)
            gone = [f for f in w.features if f.startswith(LORA_FEATURE_PREFIX)]
            self.registry.update_features(w.worker_id, add=adapter_features(r.keys or [r.key]), remove=gone)
        self._lora_unloaded.pop(name, None)
        return results[0].key

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload an adapter from every worker that holds one of that name. A worker that does
        not answer now (stopped, restarting) is told again when it registers: the name is
        remembered as unloaded until an adapter of that name is loaded again."""
        self._lora_updates += 1
        prefix = LORA_FEATURE_PREFIX + name + "@"
        holders = [w for w in self.registry.all() if any(f.startswith(prefix) for f in w.features)]
        if not holders:
            raise APIError(404, f"no LoRA adapter is named {name!r}", param="lora_name", code="lora_not_found")
        self._lora_unloaded[name] = None
        while len(self._lora_unloaded) > MAX_UNLOADED_KEPT:
            del self._lora_unloaded[next(iter(self._lora_unloaded))]
        body = UnloadLoRARequest(lora_name=name)
        for w in holders:  # new requests stop going there at once, whatever the workers answer
            self.registry.update_features(w.worker_id, remove=[f for f in w.features if f.startswith(prefix)])
        await asyncio.gather(
            *(
                self._post(w, "/internal/lora/unload", body, UnloadLoRAResponse, timeout=LORA_CALL_TIMEOUT_S)
                for w in holders
                if w.alive
            ),
            return_exceptions=True,
        )

    def sync_lora_adapters(self, worker_id: str) -> None:
        """A worker joined the pools, or came back from a restart: in the background, load on it
        the adapters loaded at run time that the other workers serve and it lacks (those given
        at start come with each worker's own flags), and unload those unloaded since it last
        heard (it was away then). Until it holds one, the requests for that adapter go to the
        others: its features say what it holds; an unloaded one leaves them at once."""
        w = self.registry.get(worker_id)
        if w is None:
            return
        stale = [k for k in adapters_of(w.features) if k.rsplit("@", 1)[0] in self._lora_unloaded]
        if stale:
            self.registry.update_features(worker_id, remove=adapter_features(stale))
        if LORA_ENABLED_FEATURE not in w.features and not stale:
            return
        old = self._syncing.pop(worker_id, None)
        if old is not None:  # it registered again (a new process): that sync was for the old one
            old.cancel()
        task = asyncio.get_running_loop().create_task(self._sync_loras(w, {k.rsplit("@", 1)[0] for k in stale}))
        self._syncing[worker_id] = task
        task.add_done_callback(
            lambda t: self._syncing.pop(worker_id, None) if self._syncing.get(worker_id) is t else None
        )

    async def _sync_loras(self, w, unload: set[str]) -> None:
        for name in sorted(unload):
            try:
                await self._post(
                    w, "/internal/lora/unload", UnloadLoRARequest(lora_name=name), UnloadLoRAResponse,
                    timeout=LORA_CALL_TIMEOUT_S,
                )  # fmt: skip
            except (WorkerGone, APIError, httpx.HTTPError, ValueError) as e:
                log.warning("worker %s still holds the LoRA adapter %r unloaded elsewhere (%s)", w.worker_id, name, e)
        if LORA_ENABLED_FEATURE not in w.features:
            return
        updates = self._lora_updates
        held = set(adapters_of(w.features))
        missing = {name: key for name, key in self._adapters_to_copy(w.worker_id).items() if key not in held}
        sources = await self._lora_sources(set(missing.values()), exclude=w.worker_id) if missing else {}
        for name, key in sorted(missing.items()):
            src = sources.get(key)
            if src is None or src.pinned:
                continue  # no holder says where it came from, or each worker's flags decide
            body = LoadLoRARequest(
                lora_name=name, lora_path=src.path, load_inplace=any(k.rsplit("@", 1)[0] == name for k in held)
            )
            if self.registry.get(w.worker_id) is not w:
                return  # it registered again since: that registration's sync takes over
            try:
                r = await self._post(w, "/internal/lora/load", body, LoadLoRAResponse, timeout=LORA_CALL_TIMEOUT_S)
            except (WorkerGone, APIError, httpx.HTTPError, ValueError) as e:
                log.warning(
                    "worker %s could not load the LoRA adapter %r from %s (%s): its requests go to the other workers",
                    w.worker_id,
                    name,
                    src.path,
                    e,
                )
                continue
            if self._lora_updates != updates and self._adapters_held(exclude=w.worker_id).get(name) is None:
                # unloaded everywhere while this load ran: it must not come back through this worker
                await asyncio.gather(
                    self._post(w, "/internal/lora/unload", UnloadLoRARequest(lora_name=name), UnloadLoRAResponse),
                    return_exceptions=True,
                )
                continue
            if self.registry.get(w.worker_id) is not w:
                return
            gone = [f for f in w.features if f.startswith(LORA_FEATURE_PREFIX)]
            self.registry.update_features(w.worker_id, add=adapter_features(r.keys or [r.key]), remove=gone)
            held = set(r.keys or [r.key])
            self.counters["lora_synced"] += 1
            same = "" if r.key == key else f"; its files changed since the others read them ({r.key} here, not {key})"
            log.info("worker %s: loaded the LoRA adapter %r the other workers serve%s", w.worker_id, name, same)

    def _adapters_to_copy(self, worker_id: str) -> dict[str, str]:
        """Name -> key of the adapters that more than half of the other live workers serving
        adapters hold: what a run-time load put on every worker, less those that restarted
        since. One worker's stray adapter (one that missed an unload while away, across a
        router restart that forgot the unload) is not copied; the joiner does not vote."""
        others = [x for x in self.registry.alive() if x.worker_id != worker_id and LORA_ENABLED_FEATURE in x.features]
        counts = Counter(key for x in others for key in adapters_of(x.features))
        out: dict[str, str] = {}
        for key, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
            if 2 * n > len(others):
                out.setdefault(key.rsplit("@", 1)[0], key)
        return out

    async def _lora_sources(self, keys: set[str], exclude: str) -> dict[str, LoRASource]:
        """Where live workers that hold these adapters (by key) read them from."""
        out: dict[str, LoRASource] = {}
        for h in self.registry.alive():
            if h.worker_id == exclude or not keys.difference(out).intersection(adapters_of(h.features)):
                continue
            try:
                listed = await self._get(h, "/internal/lora/list", LoRAListResponse)
            except (WorkerGone, APIError, httpx.HTTPError, ValueError):
                continue
            for src in listed.adapters:  # a holder that loaded it at run time says more than one given it at start
                if src.key in keys and (src.key not in out or out[src.key].pinned):
                    out[src.key] = src
        return out

    def submit(self, inputs, priority: int = 0, request_id: str | None = None, trace=None) -> RouterGroup:
        if self.draining:
            raise APIError(503, "the router is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if not self.registry.alive() and not self.awaiting_workers:
            raise self._no_worker()
        if self.num_in_flight + len(inputs) > self.max_in_flight:
            self.metrics.rejected.inc()
            raise APIError(429, "too many requests in flight; retry shortly", headers={"Retry-After": "1"})
        if self.admitter is not None:
            self._admit(inputs)
        group = RouterGroup(self, request_id or f"req-{time.monotonic_ns()}", inputs, priority, trace)
        self._groups.add(group)
        for t in group.tasks:
            t.add_done_callback(lambda _t, g=group: self._groups.discard(g) if all(x.done() for x in g.tasks) else None)
        return group

    def _admit(self, inputs) -> None:
        """Refuse before any prefill work what would miss its SLO (429 with Retry-After)."""
        for inp in inputs:
            if inp.resume_token_ids:
                continue  # admitted once already, by the router that died
            max_tokens = inp.params.max_output_tokens(len(inp.prompt_token_ids), self.engine.max_model_len)
            root = params_root(inp.params)
            reg = self.registry.having(features_needed(inp.params))
            d = self.admitter.check(reg, self.placer, inp.prompt_token_ids, max_tokens, root)
            if not d.admitted:
                self.metrics.rejected.inc()
                raise APIError(
                    429,
                    f"request refused to protect the SLOs ({d.reason}); retry later",
                    code=d.reason,
                    headers={"Retry-After": str(d.retry_after_s)},
                )

    # ---- one choice
    async def run_choice(self, c: _Choice) -> None:
        if c.group.trace.traced:
            attrs = {"gen_ai.request.id": c.rid, "pdserve.choice": c.index, "gen_ai.usage.prompt_tokens": len(c.prompt)}
            c.span = tracing.start("route", c.group.trace, attributes=attrs, start_s=c.arrival_s)
        try:
            await self._run(c)
        except asyncio.CancelledError:
            c.span.set({"pdserve.cancelled": True})
            await self._abort_everywhere(c)
            raise
        except APIError as e:
            c.span.fail(f"{e.status}: {e}")
            c.group.fail(e)
        except Exception as e:  # a bug here must not hang the client
            log.exception("request %s failed in the router", c.rid)
            c.span.fail(f"{type(e).__name__}: {e}")
            c.group.fail(APIError(500, f"the router failed this request: {type(e).__name__}"))
        finally:
            self.placer.release_decode(c.rid)
            if c.span.recording:
                c.span.set(
                    {
                        "gen_ai.usage.completion_tokens": len(c.token_ids),
                        "gen_ai.latency.time_to_first_token": c.first_token_s - c.arrival_s
                        if c.first_token_s is not None and not c.resumed
                        else None,
                    }
                )
                c.span.end()

    def _call(self, c: _Choice, name: str, w, **attributes):
        """The span of a call to worker `w` for choice c (a `with`: tracing.span)."""
        if not c.span.traced:
            return contextlib.nullcontext(tracing.NO_SPAN)
        attrs = {"pdserve.worker.id": w.worker_id, "server.address": w.url, **attributes}
        return tracing.span(name, c.span, kind="client", attributes=attrs)

    async def _run(self, c: _Choice) -> None:
        await self._workers_registered()
        if c.resumed:
            await self._run_whole(c, "resumed")
            return
        if self.max_local_prefill_length:
            d = self.placer.pick_decode(c.registry)
            # the prefix index is read only for a prompt that is too long without it; a prompt
            # whose logprobs are wanted is computed whole wherever it goes: its hits do not count
            whole = len(c.prompt) <= self.max_local_prefill_length or c.params.prompt_logprobs is not None
            if d is not None and conductor.prefill_locally(
                len(c.prompt),
                0 if whole else self.placer.cached_tokens(d, c.prompt, c.hash_root),
                self.max_local_prefill_length,
            ):
                await self._run_whole(c, "local_prefill", worker=d)
                return
        params = params_to_json(c.params)
        reserve = ReserveRequest(
            request_id=c.rid, prompt_token_ids=c.prompt, params=params, deadline_s=self.kv_timeout_s
        )
        for attempt in range(3):
            p, d = self.placer.pick(c.registry, c.prompt, c.hash_root)
            if p is None or d is None:
                await self._run_whole(c)
                return
            try:
                with self._call(c, "reserve", d, **{"pdserve.attempt": attempt}) as sp:
                    dest = (
                        await self._watch(d, self._post(d, "/internal/reserve", reserve, ReserveResponse, sp))
                    ).kv_destination
                break
            except WorkerGone as e:
                # a worker that died (or stopped) since its last heartbeat: place again without it;
                # a reservation it may have made is dropped there once it answers again
                self._abort_later(d, c.rid)
                if isinstance(e, WorkerSlow) or attempt == 2:
                    raise APIError(
                        503, f"the decode worker could not be reached ({e}); retry", headers={"Retry-After": "1"}
                    ) from None
                log.warning("request %s: decode worker %s unreachable (%s); placing again", c.rid, d.worker_id, e)
                self.registry.mark_dead(d.worker_id)
        if self.kv_mode == "pull" and p.kv_export_address:
            dest.pull = True
            try:  # D starts pulling now; P's exporter waits for the transfer to begin
                await self._post(
                    d, "/internal/pull", PullRequest(request_id=c.rid, address=p.kv_export_address), PullResponse
                )
            except WorkerGone:
                dest.pull = False
        c.group.acknowledge()
        max_tokens = c.params.max_output_tokens(len(c.prompt), self.engine.max_model_len)
        self.placer.book_decode(d.worker_id, c.rid, len(c.prompt), max_tokens)
        if c.span.recording:
            c.span.set(
                {
                    "pdserve.route": "disaggregated",
                    "pdserve.prefill.worker": p.worker_id,
                    "pdserve.decode.worker": d.worker_id,
                    "pdserve.kv.mode": "pull" if dest.pull else "push",
                }
            )
        c.workers = {p.worker_id, d.worker_id}
        c.remote_ids = {p.worker_id: c.rid, d.worker_id: c.rid}
        prefill = PrefillRequest(request_id=c.rid, prompt_token_ids=c.prompt, params=params, kv_destination=dest)
        first, prefill_task = await self._prefill(c, p, d, prefill)
        await self._decode(c, d, first, kv_expected=first is not None)
        if prefill_task is not None:
            await prefill_task

    async def _prefill(self, c: _Choice, p, d, body: PrefillRequest):
        """Stream the prefill; returns (first token or None if P failed, task reading the save report).

        A save report that fails, or a stream that breaks before it, means the KV
        will not all reach D: D is told at once, so it recomputes now instead of
        waiting out --kv-timeout-s."""
        with self._call(c, "prefill", p) as sp:
            try:
                resp = await self._watch(p, self._stream(p, "/internal/prefill", body, sp))
                lines = resp.aiter_lines()
                try:
                    ev = parse_event(await self._watch(p, anext(lines)))
                except BaseException:
                    await resp.aclose()
                    raise
                if not isinstance(ev, FirstTokenEvent):
                    raise WorkerGone(ev.message if isinstance(ev, ErrorEvent) else "prefill failed")
            except (WorkerGone, httpx.HTTPError, StopAsyncIteration, ValueError, APIError) as e:
                if isinstance(e, APIError) and e.status != 503:
                    raise  # the request itself is bad: the decode worker would refuse it too
                # 503: P is draining or its engine failed; D has the prompt and can compute it
                log.warning(
                    "request %s: prefill worker %s failed (%s); the decode worker recomputes", c.rid, p.worker_id, e
                )
                sp.fail(f"{type(e).__name__}: {e}")
                c.span.event("prefill_failed", {"pdserve.worker.id": p.worker_id, "pdserve.reason": str(e)[:200]})
                if isinstance(e, (WorkerGone, httpx.TransportError)) and not isinstance(
                    e, (WorkerSlow, httpx.TimeoutException)
                ):
                    self.registry.mark_dead(p.worker_id)
                return None, None  # the decode worker recomputes; its "kv" event is counted below
            sp.set({"pdserve.prefill_s": ev.prefill_s, "pdserve.prompt_tokens_cached": ev.num_cached_tokens})
        first = ev.token_ids[0]
        c.emit(ev.model_copy(update={"finished": False}))

        async def read_saved():
            saved, why = False, "the prefill worker's stream ended before its save report"
            try:
                async for line in lines:
                    s = parse_event(line)
                    if isinstance(s, SavedEvent):
                        saved = s.ok
                        why = s.error or why
                        self._count_saved(s)
                        c.span.set(
                            {
                                "pdserve.kv.bytes": s.bytes,
                                "pdserve.kv.seconds": s.seconds,
                                "pdserve.kv.exposed_s": s.exposed_s,
                                "pdserve.kv.retries": s.retries,
                            }
                        )
            except (httpx.HTTPError, ValueError) as e:
                why = f"the prefill worker's stream broke: {type(e).__name__}"
            finally:
                await resp.aclose()
            if not saved:
                c.span.event("kv_transfer_failed", {"pdserve.reason": why[:200]})
                await self._tell_kv_failed(d, c.rid, why)

        return first, asyncio.create_task(read_saved())

    def _count_saved(self, s: SavedEvent) -> None:
        self.counters["kv_bytes"] += s.bytes
        self.counters["kv_seconds"] += s.seconds
        self.counters["kv_retries"] += s.retries
        self.counters["kv_failed"] += not s.ok
        if s.ok:
            self.kv_transfer_time.observe(s.seconds)
        if s.ok and s.exposed_s is not None:
            self.kv_exposed_time.observe(s.exposed_s)
            self.counters["kv_exposed_bytes"] += s.exposed_bytes
            self.counters["kv_exposed_seconds"] += s.exposed_s
            if self.admitter is not None:
                self.admitter.transfers.observe(s.exposed_bytes, s.exposed_s)

    async def _tell_kv_failed(self, d, rid: str, reason: str) -> None:
        log.warning("request %s: KV transfer to %s broke (%s); telling it to recompute", rid, d.worker_id, reason)
        try:
            await self._post(d, "/internal/kv_failed", KVFailedRequest(request_id=rid, reason=reason), KVFailedResponse)
        except (WorkerGone, APIError, httpx.HTTPError):
            pass  # D gone too, or already past the wait: its own deadline still holds

    async def _decode(self, c: _Choice, d, first: int | None, kv_expected: bool) -> None:
        body = DecodeRequest(request_id=c.rid, first_token=first, kv_expected=kv_expected, timeout_s=self.kv_timeout_s)
        try:
            with self._call(c, "decode", d, **{"pdserve.kv_expected": kv_expected}) as sp:
                await self._consume(c, d, "/internal/decode", body, sp)
        except WorkerGone as e:
            self.registry.mark_dead(d.worker_id)
            await self._replace(c, reason=str(e))
        except APIError as e:
            if e.code != "reservation_expired":
                raise
            c.span.event("reservation_expired", {"pdserve.worker.id": d.worker_id})
            # D's lease ran out before the decode began (a prefill slower than
            # --kv-timeout-s): its blocks are gone, so it recomputes from the prompt
            # and the tokens already streamed, as after a failed transfer.
            self.counters["recomputed"] += 1
            log.warning("request %s: %s's reservation expired before decoding; recomputing there", c.rid, d.worker_id)
            try:
                await self._resume_on(c, d, f"{c.rid}-x")
            except WorkerGone as e2:
                self.registry.mark_dead(d.worker_id)
                await self._replace(c, reason=str(e2))

    async def _run_whole(self, c: _Choice, counter: str = "whole", worker=None) -> None:
        """One worker runs the request alone: a worker of the other role when one role has no live
        worker, the chosen decode worker when the prompt is short enough to prefill there
        (`worker`), and a resumed choice (its prompt and the tokens it streamed; on a decode worker
        if one is alive)."""
        w = worker or self.placer.pick_any(c.registry, exclude=set())
        if w is None:
            raise self._no_worker(c)
        c.group.acknowledge()
        c.workers = {w.worker_id}
        c.span.set({"pdserve.route": counter, "pdserve.worker.id": w.worker_id})
        if worker is not None:  # counted in the decode worker's load, as a placed decode is
            max_tokens = c.params.max_output_tokens(len(c.prompt), self.engine.max_model_len)
            self.placer.book_decode(w.worker_id, c.rid, len(c.prompt), max_tokens)
        self.counters[counter] += 1
        try:
            await self._resume_on(c, w, c.rid)
        except WorkerGone as e:
            if not isinstance(e, WorkerSlow):
                self.registry.mark_dead(w.worker_id)
            await self._replace(c, reason=str(e))

    async def _replace(self, c: _Choice, reason: str) -> None:
        """The decode worker is gone: replay prompt + tokens so far on another worker."""
        self.counters["replaced"] += 1
        c.span.event("worker_lost", {"pdserve.reason": reason[:200]})
        failed = {wid for wid in c.workers if not (self.registry.get(wid) and self.registry.get(wid).alive)}
        for wid in failed:  # a stopped worker that comes back must not keep the request's blocks
            if wid in c.remote_ids and self.registry.get(wid) is not None:
                self._abort_later(self.registry.get(wid), c.remote_ids.pop(wid))
        for _ in range(3):
            w = self.placer.pick_any(c.registry, exclude=failed)
            if w is None:
                break
            c.workers.add(w.worker_id)
            failed.add(w.worker_id)  # if this one fails too, do not come back to it
            log.warning("request %s: decode worker lost (%s); continuing on %s", c.rid, reason, w.worker_id)
            try:
                await self._resume_on(c, w, f"{c.rid}-r{len(c.workers)}")
                return
            except WorkerGone:
                self.registry.mark_dead(w.worker_id)
        raise APIError(503, f"the request lost its decode worker and no other could take it ({reason})")

    async def _resume_on(self, c: _Choice, w, remote_id: str) -> None:
        """Run the rest of the request on w from its prompt and the tokens already streamed."""
        c.remote_ids[w.worker_id] = remote_id
        body = GenerateRequest(
            request_id=remote_id,
            prompt_token_ids=c.prompt,
            resume_token_ids=c.token_ids,
            params=params_to_json(c.params),
        )
        attrs = {"pdserve.resume_tokens": len(c.token_ids), "gen_ai.request.id": remote_id}
        with self._call(c, "generate", w, **attrs) as sp:
            await self._consume(c, w, "/internal/generate", body, sp)

    async def _consume(
        self, c: _Choice, w, path: str, body: DecodeRequest | GenerateRequest, trace: tracing.Span
    ) -> None:
        await self._watch(w, self._read_outputs(c, w, path, body, trace))
        if not c.finished:
            raise WorkerGone(f"{w.worker_id} ended the stream before the request finished")

    async def _read_outputs(
        self, c: _Choice, w, path: str, body: DecodeRequest | GenerateRequest, trace: tracing.Span
    ) -> None:
        try:
            resp = await self._stream(w, path, body, trace)
            try:
                async for line in resp.aiter_lines():
                    ev = parse_event(line)
                    if isinstance(ev, OutputEvent):
                        c.emit(ev)
                    elif isinstance(ev, KVReadyEvent) and not ev.ok:
                        # P died or the KV missed its deadline (even after P's first token
                        # was out): the decode worker recomputed the prompt
                        self.counters["recomputed"] += 1
                        c.span.event("kv_missing_recomputed", {"pdserve.worker.id": w.worker_id})
                    elif isinstance(ev, ErrorEvent):
                        raise APIError(ev.status, ev.message)
            finally:
                await resp.aclose()
        except (httpx.HTTPError, ValueError) as e:
            raise WorkerGone(f"{w.worker_id}: {type(e).__name__}: {e}") from None

    # ---- HTTP to workers
    async def _stream(self, w, path: str, body: BaseModel, trace: tracing.Span = tracing.NO_SPAN) -> httpx.Response:
        try:
            req = self._http.build_request("POST", w.url + path, json=body.wire(), headers=trace.headers())
            resp = await self._http.send(req, stream=True)
        except httpx.TransportError as e:
            raise _unreachable(w, e) from None
        if resp.status_code != 200:
            detail = (await resp.aread()).decode(errors="replace")
            await resp.aclose()
            raise _api_error(resp.status_code, detail, resp.headers)
        return resp

    async def _post(
        self,
        w,
        path: str,
        body: BaseModel | None,
        reply: type[Reply],
        trace: tracing.Span = tracing.NO_SPAN,
        timeout: float | None = None,
    ) -> Reply:
        """POST `body` (None: an empty object) and read the answer as a `reply` (ValueError if it
        is not one); `timeout`: seconds, else the client's (no read limit: a reservation waits)."""
        kw = {} if timeout is None else {"timeout": timeout}
        try:
            resp = await self._http.post(
                w.url + path, json=body.wire() if body is not None else {}, headers=trace.headers(), **kw
            )
        except httpx.TransportError as e:
            raise _unreachable(w, e) from None
        if resp.status_code != 200:
            raise _api_error(resp.status_code, resp.text, resp.headers)
        return reply.model_validate(resp.json())

    async def _get(self, w, path: str, reply: type[Reply]) -> Reply:
        try:
            resp = await self._http.get(w.url + path, timeout=LORA_CALL_TIMEOUT_S)
        except httpx.TransportError as e:
            raise _unreachable(w, e) from None
        if resp.status_code != 200:
            raise _api_error(resp.status_code, resp.text, resp.headers)
        return reply.model_validate(resp.json())

    async def probe(self, url: str, timeout_s: float = 3.0) -> str | None:
        """None if a worker's control API answers at `url`, else why not."""
        try:
            r = await self._http.get(url.rstrip("/") + "/internal/state", timeout=timeout_s)
        except httpx.HTTPError as e:
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return None if r.status_code == 200 else f"HTTP {r.status_code} from /internal/state"

    async def _abort_everywhere(self, c: _Choice) -> None:
        """Drop the request on every worker it touched, all at once (a dead one refuses at once;
        one that is stopped or slow gets the abort when it answers again)."""
        for wid, remote_id in c.remote_ids.items():
            w = self.registry.get(wid)
            if w is not None:
                self._abort_later(w, remote_id)

    def _abort_later(self, w, remote_id: str, timeout_s: float = 120.0) -> None:
        """Abort `remote_id` on w in the background: the caller does not wait for a worker
        that may be stopped; the abort lands when (if) it answers within `timeout_s`."""

        async def send():
            try:
                await self._http.post(
                    w.url + "/internal/abort", json=AbortRequest(request_id=remote_id).wire(), timeout=timeout_s
                )
            except httpx.HTTPError:
                pass  # gone for good: its blocks went with it

        task = asyncio.get_running_loop().create_task(send())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


def _api_error(status: int, text: str, headers) -> APIError:
    try:
        err = json.loads(text)["error"]
        message, param, code = err.get("message", text), err.get("param"), err.get("code")
    except (ValueError, KeyError, TypeError):
        message, param, code = text, None, None
    keep = {k: v for k, v in headers.items() if k.lower() == "retry-after"}
    return APIError(status, message, param=param, code=code, headers=keep)


def sum_kv_store_stats(stores: list[dict]) -> dict:
    """The workers' KV store counters added up, per tier (a tier is healthy if it is on every worker)."""
    out: dict = {"tiers": {}, "queried_blocks": 0, "hit_blocks": 0, "dropped_saves": 0, "pending_loads": 0}
    for st in stores:
        for key in ("queried_blocks", "hit_blocks", "dropped_saves", "pending_loads"):
            out[key] += st.get(key, 0)
        for name, t in (st.get("tiers") or {}).items():
            acc = out["tiers"].setdefault(name, {"healthy": True})
            for key, value in t.items():
                if key == "healthy":
                    acc["healthy"] = acc["healthy"] and bool(value)
                elif isinstance(value, (int, float)):
                    acc[key] = acc.get(key, 0) + value
    return out
