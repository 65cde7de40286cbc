"""The decode of a request whose prompt another worker prefilled, as a state machine.

The router reserves blocks on this worker (/internal/reserve) while a prefill worker
computes the prompt and streams its KV here; then it asks for the decode
(/internal/decode), which `RemoteDecode` runs:

    RESERVED ──KV already in──────────────────────────► KV_READY ──┐
       │  └─no KV expected (the prefill failed)──────► RECOMPUTE ──┤
       ├─lease gone──► EXPIRED                                     ├─► DECODING ──► DONE
       └─KV on its way─► WAITING_FOR_KV ──landed──► KV_READY       │
                            ├─broke or late──► RECOMPUTE ──────────┘
                            └─the router left──► ABANDONED

KV_READY and RECOMPUTE go to EXPIRED instead when the engine no longer holds the
reservation as the decode starts. EXPIRED and ABANDONED end with the APIError the
router reads (404 reservation_expired: it has this worker recompute; 499).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from pdserve import tracing
from pdserve.control_api import DecodeRequest, ErrorEvent, KVReadyEvent, OutputEvent, event_line, logprobs_to_wire
from pdserve.engine.sequence import choice_request_id
from pdserve.server.async_engine import AsyncEngine, RequestGroup
from pdserve.server.engine_client import ChoiceOutput
from pdserve.server.errors import APIError
from pdserve.transfer.connector import KVTransferError

log = logging.getLogger("pdserve.worker")

# a decode that waits for its KV holds the blocks this much past its wait
CLAIM_MARGIN_S = 5.0


class DecodeState(enum.Enum):
    RESERVED = "reserved"  # blocks held for the prompt's KV
    WAITING_FOR_KV = "waiting_for_kv"  # the decode began before all the KV was in: the lease is claimed
    KV_READY = "kv_ready"  # the KV is in: decode from it
    RECOMPUTE = "recompute"  # the KV will not come (prefill failed, transfer broke or was late)
    DECODING = "decoding"  # started in the engine: tokens stream
    DONE = "done"  # the stream ended (finished, failed, or its reader left)
    EXPIRED = "expired"  # the lease ran out before the decode began: the blocks are gone
    ABANDONED = "abandoned"  # the router went away while the KV was on its way: blocks freed


S = DecodeState
NEXT: dict[DecodeState, set[DecodeState]] = {
    S.RESERVED: {S.KV_READY, S.RECOMPUTE, S.WAITING_FOR_KV, S.EXPIRED},
    S.WAITING_FOR_KV: {S.KV_READY, S.RECOMPUTE, S.ABANDONED},
    S.KV_READY: {S.DECODING, S.EXPIRED},
    S.RECOMPUTE: {S.DECODING, S.EXPIRED},
    S.DECODING: {S.DONE},
    S.DONE: set(),
    S.EXPIRED: set(),
    S.ABANDONED: set(),
}


def reservation_gone(rid: str) -> APIError:
    """The router reads the code: it then has this worker recompute the request."""
    return APIError(404, f"no reserved request {rid!r} here (lease expired?)", code="reservation_expired")


class RemoteDecode:
    """One /internal/decode: `start()` takes it to DECODING (or raises the router's APIError),
    `events()` streams it to DONE."""

    def __init__(self, engine: AsyncEngine, receiver, body: DecodeRequest, max_wait_s: float, trace=None):
        self.engine, self.receiver = engine, receiver
        self.trace = trace  # the router's "decode" span (tracing.extract), when it traces
        self.request_id = body.request_id  # the router's id (one choice)
        self.rid = choice_request_id(body.request_id)  # the engine's
        self.first_token = body.first_token  # sampled by the prefill worker (None if it failed)
        self.kv_expected = body.kv_expected
        self.wait_s = min(body.timeout_s, max_wait_s)
        self.state = S.RESERVED
        self.group: RequestGroup | None = None
        self.first_out: ChoiceOutput | None = None
        self.kv_ok = False  # whether the decode began from the transferred KV

    def _to(self, state: DecodeState) -> None:
        if state not in NEXT[self.state]:
            raise RuntimeError(f"decode {self.rid}: no way from {self.state.value} to {state.value}")
        self.state = state

    async def start(self, disconnected: Callable[[], Awaitable[None]]) -> None:
        """Get the KV (or give up on it) and start the request in the engine. `disconnected()`
        returns when the router that asked goes away."""
        if not self.kv_expected:
            self._to(S.RECOMPUTE)
        elif self.receiver.is_complete(self.rid):
            # usually the KV landed while P sampled the first token: then the one engine call
            # below activates at once (each call waits for the step in flight, and a second
            # one made the first inter-token gap ~2.5 decode steps)
            self._to(S.KV_READY)
        else:
            t0 = time.monotonic()
            try:
                await self._wait_for_kv(disconnected)
            finally:
                if self.trace is not None:
                    attrs = {"gen_ai.request.id": self.rid, "pdserve.kv.outcome": self.state.value}
                    tracing.record("kv_wait", self.trace, t0, time.monotonic(), attrs, kind="consumer")
        if self.kv_expected:
            self.receiver.cancel(self.rid)  # landed or given up: late frames must not touch the blocks
        self.kv_ok = self.state is S.KV_READY
        self.group = self.engine.attach(self.request_id, 1, self.trace)
        try:
            self.first_out = await self.engine.activate_transferred(self.rid, self.first_token, self.kv_ok)
        except KeyError:
            self.group.abort()
            self._to(S.EXPIRED)
            raise reservation_gone(self.rid) from None
        self._to(S.DECODING)

    async def _wait_for_kv(self, disconnected: Callable[[], Awaitable[None]]) -> None:
        # the lease ran from the reservation; a decode that waits holds the blocks through
        # its wait, or learns at once that they are gone
        if not await self.engine.claim_reservation(self.rid, self.wait_s + CLAIM_MARGIN_S):
            self._to(S.EXPIRED)
            raise reservation_gone(self.rid)
        self._to(S.WAITING_FOR_KV)
        wait = asyncio.ensure_future(asyncio.to_thread(self.receiver.wait_for_all, self.rid, self.wait_s))
        gone = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({wait, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not wait.done():  # nobody will read this decode: free its blocks now, not at the deadline
            self.receiver.fail(self.rid, "the router that asked for this decode went away")
            await asyncio.gather(wait, return_exceptions=True)
            await self.engine.abort_request(self.rid)
            self.receiver.cancel(self.rid)
            self._to(S.ABANDONED)
            log.warning("request %s: its router went away while the KV was on its way; blocks freed", self.rid)
            raise APIError(499, "the caller went away")
        try:
            wait.result()
            self._to(S.KV_READY)
        except KVTransferError as e:
            log.warning("request %s: KV did not arrive (%s); recomputing the prompt here", self.rid, e)
            self._to(S.RECOMPUTE)

    async def events(self) -> AsyncIterator[str]:
        """The decode's NDJSON stream: whether the KV arrived, then its outputs."""
        try:
            async for line in stream_outputs(self.group, self.first_out, self.kv_ok):
                yield line
        finally:
            self._to(S.DONE)


def output_event(out: ChoiceOutput) -> dict:
    """An engine output's new part: the fields of an OutputEvent or FirstTokenEvent (what
    the router turns back into a ChoiceOutput)."""
    lps = out.new_logprobs
    return {
        "token_ids": out.new_token_ids,
        "text": out.new_text,
        "finished": out.finished,
        "finish_reason": out.final.finish_reason if out.final else None,
        "stop_reason": out.final.stop_reason if out.final else None,
        "logprobs": logprobs_to_wire(lps),
        "prefill_s": out.prefill_s,
        "prompt_logprobs": logprobs_to_wire(out.prompt_logprobs),
        "num_cached_tokens": out.num_cached_tokens,
        "prompt_logprob_ranks": out.prompt_logprob_ranks,
    }


async def stream_outputs(group: RequestGroup, first_out: ChoiceOutput | None = None, kv_ok: bool = True):
    """A worker's token stream for the router: a KVReadyEvent, then an OutputEvent per output
    (after `first_out`, already streamed by the prefill worker), or an ErrorEvent."""
    try:
        yield event_line(KVReadyEvent(ok=kv_ok))
        if first_out is not None and first_out.finished:
            # the first token (already streamed by the prefill worker) ended the request
            end = output_event(first_out)
            yield event_line(
                OutputEvent(
                    **{
                        **end,
                        "token_ids": [],
                        "text": "",
                        "logprobs": None,
                        "prefill_s": None,
                        "prompt_logprobs": None,
                        "num_cached_tokens": None,
                        "prompt_logprob_ranks": None,
                    }
                )
            )
            group.abort()
            return
        while (batch := await group.next_batch()) is not None:
            for _, out in batch:
                yield event_line(OutputEvent(**output_event(out)))
    except APIError as e:
        yield event_line(ErrorEvent(status=e.status, message=str(e)))
    except asyncio.CancelledError:
        group.abort()
        raise
