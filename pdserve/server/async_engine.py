"""An `LLMEngine` driven from asyncio without ever blocking the event loop.

The engine lives in one thread of its own: it is built there (model loading
takes seconds), and only that thread calls into it, so the engine needs no
locks. The event loop talks to it through a command queue (add a group of
requests, abort one, stop, or one of the named commands in `ENGINE_COMMANDS`,
awaited through an AsyncEngine method of the same name); the thread hands
results back once per step with `loop.call_soon_threadsafe`, which the loop
fans out to per-request queues.

One API request becomes a `RequestGroup`: n choices x k prompts engine
requests that share one queue, accepted or refused together.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve import tracing
from pdserve.engine.sampling_params import InvalidRequest, SamplingParams
from pdserve.engine.sequence import PENDING, RequestOutput, choice_request_id
from pdserve.engine.step_trace import StepTraceWriter
from pdserve.faults import ENGINE_FAULTS, FaultSet
from pdserve.server import calibrate
from pdserve.server.admission import RateMeter, admit, retry_after_s
from pdserve.server.engine_client import ChoiceOutput, Completion, EngineInput
from pdserve.server.errors import APIError
from pdserve.server.metrics import ServerMetrics
from pdserve.settings import EngineServerConfig
from pdserve.transfer.connector import KVTransferError

log = logging.getLogger("pdserve.server")


def choice_output(out: RequestOutput) -> ChoiceOutput:
    """The front end's view of an engine output: its new part, and the whole completion once
    the request has finished (whose logprobs then cover every token: the new ones are its tail)."""
    c = out.outputs[0]
    plp, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    if not out.finished:  # the engine's running outputs hold only what is new
        return ChoiceOutput(
            out.new_token_ids, out.new_text, c.logprobs, prompt_logprobs=plp, prompt_logprob_ranks=ranks
        )
    lps, n = c.logprobs, len(out.new_token_ids)
    new_lps = None if lps is None else (lps[len(lps) - n :] if n else [])
    final = Completion(
        c.text,
        c.token_ids,
        lps,
        c.finish_reason,
        c.stop_reason,
        prompt_logprobs=plp,
        num_cached_tokens=out.num_cached_tokens,
        prompt_logprob_ranks=ranks,
    )
    return ChoiceOutput(
        out.new_token_ids, out.new_text, new_lps, final, prompt_logprobs=plp, prompt_logprob_ranks=ranks
    )


class _Sub:
    """Loop-side bookkeeping of one engine request."""

    __slots__ = (
        "group",
        "index",
        "rid",
        "arrival_s",
        "started",
        "first_token_s",
        "last_token_s",
        "num_tokens",
        "num_prompt_tokens",
        "num_cached_tokens",
    )

    def __init__(self, group: RequestGroup, index: int, rid: str, arrival_s: float):
        self.group, self.index, self.rid, self.arrival_s = group, index, rid, arrival_s
        self.started = False
        self.first_token_s = self.last_token_s = None
        self.num_tokens = 0
        self.num_prompt_tokens = self.num_cached_tokens = None  # from the first output (for its trace)


class RequestGroup:
    """The engine requests of one API call; iterate with `next_batch()`."""

    def __init__(self, engine: AsyncEngine, request_id: str, num: int, arrival_s: float, trace=None):
        self.request_id = request_id
        self._engine = engine
        self.trace = trace  # the parent of its engine_request spans (tracing.py), if traced
        self.subs = [_Sub(self, i, choice_request_id(request_id, i), arrival_s) for i in range(num)]
        # A list and one waiter rather than an asyncio.Queue: this is fed once per
        # token, and the queue's bookkeeping showed up in the per-token cost.
        self._items: list = []
        self._waiter: asyncio.Future | None = None
        self._loop = asyncio.get_running_loop()
        self._ack: asyncio.Future = self._loop.create_future()
        self._num_finished = 0

    async def accepted(self) -> None:
        """Wait until the engine took every request of the group; raise its APIError if not."""
        await asyncio.shield(self._ack)

    async def next_batch(self) -> list | None:
        """All (choice index, ChoiceOutput) pairs available now, at least one; None at the end."""
        if self._num_finished == len(self.subs):
            return None
        while not self._items:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        out = []
        for item in items:
            if isinstance(item, APIError):
                raise item
            out.append(item)
            if item[1].finished:
                self._num_finished += 1
        return out

    def put(self, item) -> None:
        """Hand the group an (index, ChoiceOutput) pair or an APIError (event loop only)."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def abort(self) -> None:
        """Abort what is still running (client gone, error); a no-op once all finished."""
        self._engine._abort_group(self)


class AsyncEngine:
    def __init__(
        self,
        make_engine: Callable[[], object],
        metrics_factory: Callable[[str], ServerMetrics],
        max_waiting_requests: int = EngineServerConfig.max_waiting_requests,
        step_trace: StepTraceWriter | None = None,
    ):
        self._make_engine = make_engine
        self.step_trace = step_trace  # every step's record goes there (engine/step_trace.py)
        self._metrics_factory = metrics_factory
        self.max_waiting_requests = max_waiting_requests
        self.engine = None  # the LLMEngine, once loaded; only its immutable parts are read from the loop
        self.metrics: ServerMetrics | None = None
        self.stats: dict | None = None
        self.failure: str | None = None  # why the engine is unusable, if it is
        # called on the loop when the engine could not be built, with the exit status its process
        # should end with: 2 for a configuration or model that cannot load (a retry would fail
        # alike: a supervisor stops), 1 for anything else (out of memory, a passing read error:
        # a supervisor restarts it)
        self.on_failure: Callable[[int], None] | None = None  # exits the process with that status
        self.faults = FaultSet.from_env(ENGINE_FAULTS)  # armed only by tests
        self.draining = False
        self.ready = asyncio.Event()
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._subs: dict[str, _Sub] = {}
        self._num_waiting = 0  # engine requests accepted that have produced no token yet
        self._starts = RateMeter()
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- lifecycle (event loop side)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._thread_main, name="pdserve-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, reason: str = "the server is shutting down") -> None:
        self.draining = True
        self.fail_all(APIError(503, reason))
        self._cmds.put(("stop",))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    def fail_all(self, err: APIError) -> None:
        """End every request in flight with `err` (engine failure, shutdown deadline)."""
        for group in {s.group for s in self._subs.values()}:
            if not group._ack.done():
                group._ack.set_exception(err)
            group.put(err)
            self._abort_group(group)

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @property
    def num_in_flight(self) -> int:
        return len(self._subs)

    def lora_adapters(self) -> dict[str, str]:
        return self.engine.list_loras() if self.engine is not None else {}

    def lora_sources(self) -> list[tuple[str, str, str, bool]]:
        """(name, key, path, given at start) of the adapters served (LoRAManager.sources)."""
        lora = self.engine.lora if self.engine is not None else None
        return lora.sources() if lora is not None else []

    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> str:
        from pdserve.engine.lora import LoRAError

        core = self._loaded()
        if core.lora is None:
            raise APIError(400, "this server serves no LoRA adapters (start it with --enable-lora)", param="lora_name")
        if name in core.list_loras() and not replace:
            raise APIError(
                400, f"the LoRA adapter {name!r} is already loaded (load_inplace replaces it)", param="lora_name"
            )
        try:
            adapter = await asyncio.to_thread(core.lora.read, name, path)  # file reads off the loop and the engine
            return await self.install_lora(adapter)
        except LoRAError as e:
            raise APIError(400, str(e), param="lora_path") from None

    async def install_lora(self, adapter) -> str:
        """Serve an adapter read already (LLMEngine.install_lora); its key."""
        return await self._command("install_lora", adapter)

    async def remove_lora(self, name: str) -> bool:
        return await self._command("remove_lora", name)

    async def unload_lora_adapter(self, name: str) -> None:
        if not await self.remove_lora(name):
            raise APIError(404, f"no LoRA adapter is named {name!r}", param="lora_name", code="lora_not_found")

    def _loaded(self):
        if self.failure is not None:
            raise APIError(503, f"the engine is not available: {self.failure}")
        if self.engine is None:
            raise APIError(503, "the engine is still loading; retry shortly", headers={"Retry-After": "1"})
        return self.engine

    # ---- requests (event loop side)
    def submit(
        self, inputs: list[EngineInput], priority: int = 0, request_id: str | None = None, trace=None
    ) -> RequestGroup:
        """Hand a group to the engine; raises APIError 503/429 if it cannot take work now.
        `trace`: the span (or a caller's trace context) its engine_request spans go under."""
        if self.failure is not None:
            raise APIError(503, f"the engine is not available: {self.failure}")
        if self.draining:
            raise APIError(503, "the server is shutting down")
        if self.engine is None:
            raise APIError(503, "the engine is still loading; retry shortly", headers={"Retry-After": "1"})
        self._admit(len(inputs))
        arrival_s = time.monotonic()
        group = RequestGroup(self, request_id or f"req-{next(self._ids)}", len(inputs), arrival_s, trace)
        for sub in group.subs:
            self._subs[sub.rid] = sub
        self._num_waiting += len(inputs)
        self._cmds.put(("add", group, [(s.rid, inp, priority, arrival_s) for s, inp in zip(group.subs, inputs)]))
        return group

    async def compile_constraints(self, params: list[SamplingParams]) -> None:
        """Compile the output constraints (structured outputs) of `params` on a thread of their
        own, before the request reaches the engine: a large grammar takes a while, and the
        engine thread would stall every running request for it. The engine then finds them in
        its cache. A constraint that does not compile is the caller's 400."""
        engine = self.engine
        if engine is None:
            return
        done: set[int] = set()
        for p in params:
            so = p.structured_outputs
            if so is None or id(so) in done:
                continue
            done.add(id(so))
            try:
                await asyncio.to_thread(engine.structured.compile, so)
            except InvalidRequest as e:
                raise APIError(400, str(e), param=e.param) from None

    def _admit(self, num: int) -> None:
        """Refuse a group of `num` sequences that would take the queue past its limit.

        The limit counts sequences, not API requests: one request fans out into
        prompts x n of them, and each waits and is aborted on its own."""
        limit = self.max_waiting_requests
        if num > limit:  # no amount of waiting lets it in: say so instead of "retry"
            raise APIError(
                400,
                f"this request needs {num} sequences, but at most {limit} may wait in this "
                f"engine (max_waiting_requests={limit})",
                code="request_too_large",
            )
        # the group is admitted whole or not at all, as if its sequences arrived one by one
        if not admit(self._num_waiting + num - 1, limit):
            self.metrics.rejected.inc()
            wait_s = retry_after_s(self._num_waiting, self._starts.rate_per_s(time.monotonic()))
            raise APIError(
                429,
                f"{self._num_waiting} sequences are already waiting and this request adds {num}; "
                f"the limit is max_waiting_requests={limit}; retry in {wait_s}s",
                code="queue_full",
                headers={"Retry-After": str(wait_s)},
            )

    def attach(self, request_id: str, num: int, trace=None) -> RequestGroup:
        """A group for engine requests created by a command (`activate_transferred`: a decode
        that resumes from transferred KV): their outputs are delivered like a submitted group's."""
        group = RequestGroup(self, request_id, num, time.monotonic(), trace)
        for sub in group.subs:
            self._subs[sub.rid] = sub
        self._num_waiting += num
        group._ack.set_result(None)
        return group

    # ---- named engine commands (event loop side): each runs on the engine thread
    # between steps, and what it raises there is raised here
    async def reserve_for_transfer(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        receiver,
        deadline_s: float,
        wait_s: float = 0.0,
    ):
        """Reserve blocks for KV another worker computes: its KVDestination, or None when
        there is no room, now or within `wait_s` in line. Cancelled while it waits in
        line (the caller gave up): the reservation is cancelled too."""
        got: asyncio.Future = self._loop.create_future()

        def on_done(dest):  # engine thread: the wait in line ended
            self._post(_settle, got, dest)

        dest = await self._command(
            "reserve_for_transfer",
            request_id,
            prompt_token_ids,
            params,
            receiver,
            deadline_s=deadline_s,
            wait_s=wait_s,
            on_done=on_done,
        )
        if dest is not PENDING:
            return dest
        try:
            return await got
        except asyncio.CancelledError:
            asyncio.ensure_future(self.cancel_reservation(request_id))
            raise

    async def cancel_reservation(self, request_id: str) -> None:
        return await self._command("cancel_reservation", request_id)

    async def claim_reservation(self, request_id: str, hold_s: float) -> bool:
        return await self._command("claim_reservation", request_id, hold_s)

    async def activate_transferred(
        self, request_id: str, first_token: int | None, kv_complete: bool
    ) -> ChoiceOutput | None:
        """Start decoding a reserved request; the output of the first token, if one was given."""
        out = await self._command("activate_transferred", request_id, first_token, kv_complete)
        return choice_output(out) if out is not None else None

    async def abort_request(self, request_id: str) -> bool:
        """Abort one engine request and wait until it is gone (`abort()` of a group does not wait)."""
        return await self._command("abort_request", request_id)

    async def expire_reservations(self, everything: bool = False) -> list[str]:
        """Free reservations whose lease ran out (or all of them); their request ids."""
        return await self._command("expire_reservations", math.inf if everything else None)

    async def calibrate_prefill(self) -> list[tuple[int, float]]:
        return await self._command("calibrate_prefill")

    async def calibrate_decode(self, recorder) -> list[tuple[int, int, float]]:
        return await self._command("calibrate_decode", recorder)

    async def heartbeat_snapshot(self, want_cached: bool, recorder=None) -> HeartbeatSnapshot:
        return await self._command("heartbeat_snapshot", want_cached, recorder)

    async def _command(self, name: str, *args, **kwargs):
        """Run ENGINE_COMMANDS[name](engine, *args, **kwargs) on the engine thread; its result or exception."""
        if self.engine is None:
            raise APIError(503, "the engine is still loading; retry shortly", headers={"Retry-After": "1"})
        fut = self._loop.create_future()
        self._cmds.put(("call", name, args, kwargs, fut))
        return await fut

    def _abort_group(self, group: RequestGroup) -> None:
        for sub in group.subs:
            if self._subs.pop(sub.rid, None) is None:
                continue  # finished or already aborted
            self._cmds.put(("abort", sub.rid))
            if not sub.started:
                self._num_waiting -= 1
            self.metrics.on_finish("abort", sub.arrival_s, sub.first_token_s, sub.last_token_s, sub.num_tokens)
            if group.trace is not None:
                _trace_request(sub, "abort", {"first_token_time": sub.first_token_s})

    # ---- results (event loop side, called by the engine thread via call_soon_threadsafe)
    def _on_ready(self, engine) -> None:
        self.engine = engine
        self.metrics = self._metrics_factory(engine.model_config.name)
        self._on_stats(engine.stats())
        # A serving process keeps its engine for life: take everything loaded so far
        # (model, tokenizer vocabulary) out of the cyclic GC's walks, as vLLM does.
        # Collections during decoding were ~5% of a batch-1 step in a perf profile.
        gc.collect()
        gc.freeze()
        self.ready.set()

    @property
    def loading(self) -> str | None:
        return "the model is loading" if self.engine is None and self.failure is None else None

    def _on_failure(self, reason: str, status: int = 1) -> None:
        """The engine failed to load (status 2: its config or model cannot load; 1: anything
        else) or a step failed (1): every request in flight ends with 503, and the process
        exits with `status` (`on_failure`), so that its supervisor restarts it (1) or stops
        the deployment (2). A failed step leaves the engine's state unknown: a process that
        stayed up could only refuse work while looking alive to its router."""
        self.failure = reason
        if self.metrics is not None:
            self.fail_all(APIError(503, f"the engine failed: {reason}"))
        self.ready.set()  # wake waiters so they see the failure
        if self.on_failure is not None:
            self.on_failure(status)

    def _on_stats(self, stats: dict) -> None:
        self.stats = stats
        self.metrics.set_engine_stats(stats)

    def _on_ack(self, group: RequestGroup, err: APIError | None) -> None:
        if err is not None:
            for sub in group.subs:
                if self._subs.pop(sub.rid, None) is not None:
                    self._num_waiting -= 1
            if not group._ack.done():
                group._ack.set_exception(err)
        elif not group._ack.done():
            group._ack.set_result(None)

    def _deliver(self, outputs: list, stats: dict) -> None:
        self._on_stats(stats)
        now = time.monotonic()
        for out in outputs:
            sub = self._subs.get(out.request_id)
            if sub is None:
                continue  # aborted while this step ran
            m = out.metrics
            gap_s = None
            first = not sub.started
            if first:
                sub.started = True
                sub.first_token_s = m["first_token_time"]
                sub.num_prompt_tokens, sub.num_cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens
                self._num_waiting -= 1
                self._starts.add(now)
                self.metrics.on_first_token(
                    m["arrival_time"], m["first_scheduled_time"], m["first_token_time"], len(out.prompt_token_ids)
                )
            else:
                gap_s = m["last_token_time"] - sub.last_token_s
            sub.last_token_s = m["last_token_time"]
            sub.num_tokens += len(out.new_token_ids)
            self.metrics.on_tokens(len(out.new_token_ids), gap_s)
            if out.finished:
                del self._subs[out.request_id]
                self.metrics.on_finish(
                    out.outputs[0].finish_reason or "stop",
                    sub.arrival_s,
                    sub.first_token_s,
                    sub.last_token_s,
                    sub.num_tokens,
                )
                if sub.group.trace is not None:
                    _trace_request(sub, out.outputs[0].finish_reason or "stop", m)
            c = choice_output(out)
            if first:
                c.num_cached_tokens = out.num_cached_tokens
                if m.get("first_scheduled_time") is not None:
                    c.prefill_s = max(0.0, m["first_token_time"] - m["first_scheduled_time"])
            if not first:
                # the prompt's logprobs travel once, with the first output (a worker's stream
                # to its router included); the final completion still holds them
                c.prompt_logprobs = c.prompt_logprob_ranks = None
            sub.group.put((sub.index, c))

    # ---- the engine thread
    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop has closed: nobody is left to tell
            pass

    def _thread_main(self) -> None:
        try:
            engine = self._make_engine()
        except Exception as e:
            from pdserve.engine.loader import ModelLoadError

            if isinstance(e, (ValueError, ModelLoadError)):  # config, model path: the message says it all
                log.error("engine failed to load: %s", e)
                status = 2
            else:
                log.exception("engine failed to load")
                status = 1
            self._post(self._on_failure, f"load failed: {e}", status)
            return
        self._post(self._on_ready, engine)
        trace = self.step_trace
        if trace is not None:
            engine.add_step_observer(trace.record)
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                # reservations waiting for room are retried after commands and steps, and their
                # waits end on time even when nothing else happens
                waits = engine.has_pending_reservations
                if not self._run_commands(engine, block=idle, timeout_s=0.05 if waits else None):
                    break
                if engine.has_pending_reservations:
                    engine.retry_reservations()
                    self._post(self._on_stats, engine.stats())  # what /internal/state reports
                if engine.has_unfinished_requests():
                    if self.faults:
                        self.faults.before_step()
                    self._post(self._deliver, engine.step(), engine.stats())
        except Exception as e:
            # A failed step leaves the batch in an unknown state: stop, and exit (restarted).
            log.exception("engine step failed; the engine is stopped and the process exits")
            self._post(self._on_failure, f"step failed: {type(e).__name__}: {e}")
        finally:
            if trace is not None:
                trace.close()
            engine.close()

    def _run_commands(self, engine, block: bool, timeout_s: float | None = None) -> bool:
        """Apply queued commands; wait for one (up to `timeout_s`) when idle. False means stop."""
        try:
            cmds = [self._cmds.get(timeout=timeout_s) if block else self._cmds.get_nowait()]
        except queue.Empty:
            return True
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                break
        for cmd in cmds:
            if cmd[0] == "stop":
                return False
            if cmd[0] == "abort":
                engine.abort_request(cmd[1])
            elif cmd[0] == "call":
                self._call(engine, *cmd[1:])
            else:
                self._post(self._on_ack, cmd[1], self._add_group(engine, cmd[2]))
        self._post(self._on_stats, engine.stats())
        return True

    def _call(self, engine, name: str, args: tuple, kwargs: dict, fut) -> None:
        try:
            result, exc = ENGINE_COMMANDS[name](engine, *args, **kwargs), None
        except Exception as e:  # handed to the awaiting coroutine, which decides
            result, exc = None, e

        def settle():
            if fut.done():
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

        self._post(settle)

    @staticmethod
    def _add_group(engine, items) -> APIError | None:
        added = []
        try:
            for rid, inp, priority, arrival_s in items:
                engine.add_request(
                    rid,
                    inp.prompt_token_ids,
                    inp.params,
                    priority=priority,
                    arrival_time=arrival_s,
                    kv_destination=inp.kv_destination,
                    resume_token_ids=inp.resume_token_ids,
                )
                added.append(rid)
            return None
        except InvalidRequest as e:
            err = APIError(400, str(e), param=e.param)
        except KVTransferError as e:  # the KV transfer could not start (its receiver, NIXL metadata)
            err = APIError(503, f"the KV transfer could not start: {e}")
        except (ValueError, TypeError) as e:
            err = APIError(400, str(e))
        except Exception:
            log.exception("add_request failed")
            err = APIError(500, "the engine could not take the request; see the server log")
        for rid in added:  # all or nothing
            engine.abort_request(rid)
        return err


def _trace_request(sub: _Sub, finish_reason: str, m: dict) -> None:
    """The engine_request span of a finished (or aborted) engine request: its time in the
    queue, its prefill and its decode here (tracing.py), under its group's parent."""
    now = time.monotonic()
    # from when the group reached this engine: a decode worker's sequence was made when its
    # blocks were reserved, and its first token came from the prefill worker, before that
    arrival, last = sub.arrival_s, sub.last_token_s
    scheduled, first = (
        t if t is not None and t >= arrival else None
        for t in (m.get("first_scheduled_time"), m.get("first_token_time"))
    )
    attrs = {
        "gen_ai.request.id": sub.rid,
        "gen_ai.response.finish_reasons": (finish_reason,),
        "gen_ai.usage.prompt_tokens": sub.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": sub.num_tokens,
        "pdserve.prompt_tokens_cached": sub.num_cached_tokens,
        "pdserve.num_preemptions": m.get("num_preemptions"),
    }
    if scheduled is not None:
        attrs["gen_ai.latency.time_in_queue"] = max(0.0, scheduled - arrival)
        if first is not None:
            attrs["gen_ai.latency.time_in_model_prefill"] = max(0.0, first - scheduled)
    if first is not None:
        attrs["gen_ai.latency.time_to_first_token"] = max(0.0, first - arrival)
        if last is not None:
            attrs["gen_ai.latency.time_in_model_decode"] = max(0.0, last - first)
    attrs["gen_ai.latency.e2e"] = max(0.0, (last or now) - arrival)
    tracing.record(
        "engine_request",
        sub.group.trace,
        arrival,
        last or now,
        attrs,
        events=[("scheduled", scheduled), ("first_token", first)],
        kind="server" if not isinstance(sub.group.trace, tracing.Span) else "internal",
    )


def _settle(fut: asyncio.Future, result) -> None:
    if not fut.done():
        fut.set_result(result)


# ---- what the named commands run on the engine thread: the engine's whole surface
# used from the event loop, besides adding and aborting requests


@dataclass
class HeartbeatSnapshot:
    """What one heartbeat reads on the engine thread."""

    kv_events: list  # drained from the block manager since the last snapshot
    block_size: int
    cached_hashes: list[int] | None  # every cached block hash, when asked for
    running_context_tokens: int  # tokens of the sequences in the running batch
    prefill_steps: list  # the recorder's recent live prefill steps (empty without one)
    decode_steps: list  # ... and decode steps


def _heartbeat_snapshot(engine, want_cached: bool, recorder) -> HeartbeatSnapshot:
    # the events and the snapshot in one go: no event falls between them
    bm = engine.block_manager
    return HeartbeatSnapshot(
        bm.drain_events(),
        bm.block_size,
        list(bm.cached) if want_cached else None,
        sum(s.num_tokens for s in engine.scheduler.running),
        list(recorder.prefill_samples) if recorder is not None else [],
        recorder.recent() if recorder is not None else [],
    )


def _calibrate_prefill(engine):
    return calibrate.measure_prefill(engine)


def _calibrate_decode(engine, recorder):
    return calibrate.measure_decode(engine, recorder)


def _method(name: str):
    def run(engine, *args, **kwargs):
        return getattr(engine, name)(*args, **kwargs)

    run.__name__ = name
    return run


ENGINE_COMMANDS: dict[str, Callable] = {
    **{
        name: _method(name)
        for name in (
            "reserve_for_transfer",
            "cancel_reservation",
            "claim_reservation",
            "activate_transferred",
            "abort_request",
            "expire_reservations",
            "install_lora",
            "remove_lora",
        )
    },
    "calibrate_prefill": _calibrate_prefill,
    "calibrate_decode": _calibrate_decode,
    "heartbeat_snapshot": _heartbeat_snapshot,
}
