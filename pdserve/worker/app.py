"""A worker process: one engine in a role (prefill, decode or both), driven by the router.

Its control API is plain HTTP + JSON (NDJSON streams for tokens), every body one
of the models in pdserve/control_api.py; the KV cache never travels here, only
over the KV bridge (pdserve/transfer).

    POST /internal/prefill   prefill, stream the first token, then report the KV save
    POST /internal/reserve   reserve blocks for a prompt whose KV will arrive
    POST /internal/pull      fetch that KV from a prefill worker (pull mode)
    POST /internal/decode    wait for that KV (or recompute), stream the rest (decode.py)
    POST /internal/kv_failed that KV will not come (its sender broke): recompute now
    POST /internal/generate  the whole request here (role both, or a fallback)
    POST /internal/abort     drop a request and its blocks
    POST /internal/lora/load, /internal/lora/unload   a LoRA adapter at run time (the router's
                             /v1/load_lora_adapter, /v1/unload_lora_adapter)
    GET  /internal/state     engine stats, free blocks (tests, debugging)
    POST /internal/drain     leave the pool: finish what is in flight, then exit 0
    POST /internal/fault     inject a fault (only with PDSERVE_ENABLE_FAULT_INJECTION=1: tests, chaos)

Every route needs a request signed with the cluster secret (pdserve/auth.py);
leases and waits the caller asks for are capped by `max_lease_s`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from pdserve import auth, faults, tracing
from pdserve.control_api import (
    MAX_RESERVE_WAIT_S,
    AbortRequest,
    AbortResponse,
    DecodeRequest,
    DrainResponse,
    FaultRequest,
    FaultResponse,
    FirstTokenEvent,
    GenerateRequest,
    KVDestinationBody,
    KVFailedRequest,
    KVFailedResponse,
    LoadLoRARequest,
    LoadLoRAResponse,
    LoRAListResponse,
    LoRASource,
    PrefillRequest,
    PullRequest,
    PullResponse,
    ReserveRequest,
    ReserveResponse,
    SavedEvent,
    StateResponse,
    UnloadLoRARequest,
    UnloadLoRAResponse,
    event_line,
    params_from_json,
)
from pdserve.engine.sampling_params import InvalidRequest, SamplingParams
from pdserve.engine.sequence import choice_request_id
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.engine_client import EngineInput
from pdserve.server.errors import APIError, from_validation_errors, install_handlers
from pdserve.server.streaming import wait_disconnect
from pdserve.transfer.connector import KVDestination, KVTransferError
from pdserve.worker.decode import RemoteDecode, output_event, stream_outputs

log = logging.getLogger("pdserve.worker")


def _params(d: dict) -> SamplingParams:
    """The caller's sampling parameters; values SamplingParams refuses are a 400, as on the public API."""
    try:
        return params_from_json(d)
    except InvalidRequest as e:
        raise APIError(400, str(e), param=f"params.{e.param}" if e.param else "params") from None
    except (TypeError, ValueError) as e:
        raise APIError(400, f"bad params: {e}", param="params") from None


class WorkerApi:
    def __init__(
        self,
        engine: AsyncEngine,
        role: str,
        sender=None,
        receiver=None,
        save_timeout_s: float = 30.0,
        max_lease_s: float = 600.0,
    ):
        self.engine = engine
        self.role = role
        self.sender = sender  # KVSender (prefill / both)
        self.receiver = receiver  # KVReceiver (decode / both)
        self.save_timeout_s = save_timeout_s
        self.max_lease_s = max_lease_s
        self.start_drain = None  # set by the process that serves this API (serving.DrainingServer)
        self.exit = None  # its `exit(code)`: stop the process now
        self._faults = faults.FaultSet.from_env(faults.WORKER_FAULTS)  # tests and the chaos benchmark only

    # Each route takes its body as a control_api model: FastAPI validates it, and a body
    # that does not fit is a 400 naming the field (errors.install_handlers), never a 500.

    # ---- prefill role
    async def prefill(self, b: PrefillRequest, request: Request) -> StreamingResponse:
        dest = KVDestination(**b.kv_destination.model_dump()) if b.kv_destination else None
        if dest is not None:
            dest.localize_lease(time.time())  # this host's clock, whatever the decode worker's says
        params = dataclasses.replace(_params(b.params), max_tokens=1, min_tokens=0)
        if self._faults:
            await self._faults.before_prefill()
        await self.engine.compile_constraints([params])
        trace = tracing.extract(request.headers)  # the router's "prefill" span, when it traces
        group = self.engine.submit(
            [EngineInput(b.prompt_token_ids, params, kv_destination=dest)], request_id=b.request_id, trace=trace
        )
        await group.accepted()

        async def stream():
            try:
                batch = await group.next_batch()
                computed_s = time.monotonic()  # every layer is computed: what is left of the transfer is exposed
                yield event_line(FirstTokenEvent(**output_event(batch[-1][1])))
                if dest is not None:
                    yield event_line(await self._saved(dest.transfer_id, computed_s, trace))
            except asyncio.CancelledError:
                group.abort()
                raise

        return StreamingResponse(stream(), media_type="application/x-ndjson")

    async def _saved(self, transfer_id: str, computed_s: float, trace=None) -> SavedEvent:
        """The save report. `exposed_s`: from the end of the prefill to the decode side's
        acknowledgement, the part of the transfer TTFT pays for; `exposed_bytes`: what
        travelled in it (one layer's share in layer-wise mode, all of it in eager)."""
        try:
            st = await asyncio.to_thread(self.sender.wait_for_save, transfer_id, self.save_timeout_s)
            bridge = self.engine.engine.bridge if self.engine.engine is not None else None
            layerwise = bridge is not None and bridge.layerwise
            layers = bridge.num_layers if layerwise else 1
            exposed_s = max(0.0, st.finished_s - computed_s) if st.finished_s else None
            if trace is not None and exposed_s is not None:
                attrs = {
                    "pdserve.kv.bytes": st.bytes,
                    "pdserve.kv.layers": st.layers,
                    "pdserve.kv.retries": st.retries,
                    "pdserve.kv.layerwise": layerwise,
                    "pdserve.kv.exposed_s": exposed_s,
                }
                tracing.record("kv_transfer", trace, st.started_s, st.finished_s, attrs, kind="producer")
            return SavedEvent(
                ok=True,
                bytes=st.bytes,
                retries=st.retries,
                seconds=st.finished_s - st.started_s,
                exposed_s=exposed_s,
                exposed_bytes=st.bytes / layers,
            )
        except KVTransferError as e:
            if trace is not None:
                tracing.record("kv_transfer", trace, computed_s, time.monotonic(), kind="producer", error=str(e))
            return SavedEvent(ok=False, error=str(e))

    # ---- decode role
    async def reserve(self, b: ReserveRequest) -> ReserveResponse:
        rid = choice_request_id(b.request_id)
        params = _params(b.params)
        # the caller's lease and wait, capped by this worker: a lease of a day would pin blocks for a day
        deadline_s = min(b.deadline_s, self.max_lease_s)
        # no room now: wait in line for up to wait_s (the scheduler's queue and the
        # transfers already admitted go first), then 503
        wait_s = min(b.wait_s, MAX_RESERVE_WAIT_S)
        await self.engine.compile_constraints([params])
        try:
            dest = await self.engine.reserve_for_transfer(
                rid, b.prompt_token_ids, params, self.receiver, deadline_s=deadline_s, wait_s=wait_s
            )
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        if dest is None:
            raise APIError(503, "no free KV blocks for this prompt now", code="kv_full", headers={"Retry-After": "1"})
        return ReserveResponse(kv_destination=KVDestinationBody(**dest.to_json()))

    async def pull(self, b: PullRequest) -> PullResponse:
        """Start fetching a reserved request's KV from the prefill worker at `address`."""
        if self.receiver is None:
            raise APIError(400, "this worker does not decode")
        # the connection itself is authenticated both ways: a peer without the secret gets nothing
        self.receiver.pull(b.address, choice_request_id(b.request_id))
        return PullResponse(pulling=b.request_id)

    async def kv_failed(self, b: KVFailedRequest) -> KVFailedResponse:
        """The router saw the prefill worker's transfer break: stop waiting for that KV now
        (the decode recomputes the prompt) rather than at the deadline."""
        if self.receiver is None:
            raise APIError(400, "this worker does not decode")
        self.receiver.fail(choice_request_id(b.request_id), b.reason)
        return KVFailedResponse(failed=b.request_id)

    async def decode(self, b: DecodeRequest, request: Request) -> StreamingResponse:
        """Wait for the reserved request's KV (or recompute without it), then stream the rest."""
        d = RemoteDecode(self.engine, self.receiver, b, self.max_lease_s, tracing.extract(request.headers))
        await d.start(lambda: wait_disconnect(request.receive))
        return StreamingResponse(d.events(), media_type="application/x-ndjson")

    # ---- whole requests here
    async def generate(self, b: GenerateRequest, request: Request) -> StreamingResponse:
        inp = EngineInput(b.prompt_token_ids, _params(b.params), resume_token_ids=b.resume_token_ids)
        await self.engine.compile_constraints([inp.params])
        group = self.engine.submit([inp], request_id=b.request_id, trace=tracing.extract(request.headers))
        await group.accepted()
        return StreamingResponse(stream_outputs(group), media_type="application/x-ndjson")

    async def abort(self, b: AbortRequest) -> AbortResponse:
        rid = choice_request_id(b.request_id)
        await self.engine.abort_request(rid)
        if self.receiver is not None:
            self.receiver.cancel(rid)
        return AbortResponse(aborted=rid)

    async def load_lora(self, b: LoadLoRARequest) -> LoadLoRAResponse:
        key = await self.engine.load_lora_adapter(b.lora_name, b.lora_path, b.load_inplace)
        return LoadLoRAResponse(key=key, keys=sorted(set(self.engine.lora_adapters().values())))

    async def list_lora(self) -> LoRAListResponse:
        return LoRAListResponse(
            adapters=[LoRASource(name=n, key=k, path=p, pinned=pin) for n, k, p, pin in self.engine.lora_sources()]
        )

    async def unload_lora(self, b: UnloadLoRARequest) -> UnloadLoRAResponse:
        await self.engine.unload_lora_adapter(b.lora_name)
        return UnloadLoRAResponse(unloaded=b.lora_name)

    async def reap_leases(self, every_s: float = 1.0) -> None:
        """Free blocks reserved for KV that never came and a decode that was never asked for."""
        await self.engine.ready.wait()
        while self.engine.engine is not None and self.receiver is not None:
            await self.free_reservations("reservation lease expired")
            await asyncio.sleep(every_s)

    async def free_reservations(self, why: str, everything: bool = False) -> None:
        """Free reservations whose lease ran out, or all of them (`everything`: the router
        that made them is gone, and nobody will decode them)."""
        if self.receiver is None or self.engine.engine is None:
            return
        gone = await self.engine.expire_reservations(everything)
        for rid in gone:
            log.warning("request %s: %s; its blocks are freed", rid, why)
            self.receiver.cancel(rid)

    async def drain(self) -> DrainResponse:
        if self.start_drain is None:
            raise APIError(400, "this worker cannot drain on request", code="not_supported")
        started = self.start_drain()
        log.warning(
            "the router asked this worker to leave its pool (the pool is over its wanted size; "
            "`pdserve scale --status` shows it): draining"
            if started
            else "asked to drain again: already draining"
        )
        return DrainResponse(draining=True)

    async def fault(self, request: Request) -> FaultResponse:
        """Arm a fault for tests and the chaos benchmark: {"kv": "cut_at_layer=3"} for the KV
        sender, {"worker": "delay_prefill=0:2"} for this API. 404 unless the process was
        started with PDSERVE_ENABLE_FAULT_INJECTION=1."""
        if not faults.route_enabled():
            raise APIError(404, "fault injection is off on this worker", code="not_found")
        # parsed here, not by FastAPI: a worker without fault injection answers 404 whatever the body
        try:
            b = FaultRequest.model_validate(json.loads(await request.body()))
        except ValidationError as e:
            raise from_validation_errors(e.errors()) from None
        except ValueError as e:
            raise APIError(400, f"bad fault spec: {e}") from None
        try:
            if b.kv is not None:
                if self.sender is None:
                    raise APIError(400, "this worker sends no KV", param="kv")
                self.sender.inject_fault(b.kv)
            if b.worker is not None:
                self._faults.arm(b.worker)
        except ValueError as e:
            raise APIError(400, f"bad fault spec: {e}") from None
        armed = b.model_dump(exclude_none=True)
        log.warning("fault armed: %s", armed)
        return FaultResponse(armed=armed)

    async def state(self) -> StateResponse:
        return StateResponse(
            role=self.role,
            ready=self.engine.engine is not None,
            failure=self.engine.failure,
            stats=dict(self.engine.stats or {}),
            time=time.time(),
        )


def build_worker_app(api: WorkerApi, secret: bytes, on_startup=None, on_shutdown=None, aliases=()) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        api.engine.start()
        tasks = [asyncio.create_task(api.reap_leases())]
        if on_startup:
            tasks.append(asyncio.create_task(on_startup()))
        yield
        for t in tasks:
            t.cancel()
        if on_shutdown:
            await on_shutdown()
        await api.engine.shutdown()

    app = FastAPI(title="pdserve-worker", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_handlers(app)
    api.verifier = auth.Verifier(secret, aliases=aliases)
    app.add_middleware(auth.InternalAuth, verifier=api.verifier)
    for path, fn, method in (
        ("/internal/prefill", api.prefill, "POST"),
        ("/internal/reserve", api.reserve, "POST"),
        ("/internal/decode", api.decode, "POST"),
        ("/internal/generate", api.generate, "POST"),
        ("/internal/pull", api.pull, "POST"),
        ("/internal/kv_failed", api.kv_failed, "POST"),
        ("/internal/abort", api.abort, "POST"),
        ("/internal/lora/load", api.load_lora, "POST"),
        ("/internal/lora/unload", api.unload_lora, "POST"),
        ("/internal/lora/list", api.list_lora, "GET"),
        ("/internal/state", api.state, "GET"),
        ("/internal/drain", api.drain, "POST"),
        ("/internal/fault", api.fault, "POST"),
    ):
        app.add_api_route(path, fn, methods=[method])
    return app
