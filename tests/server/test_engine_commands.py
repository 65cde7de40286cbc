"""The loop's side of the engine thread: request ids and the named engine commands."""

import asyncio
import inspect
import re
import threading
import types

import pytest

from pdserve.engine.sequence import PENDING, choice_request_id
from pdserve.server.async_engine import ENGINE_COMMANDS, AsyncEngine
from pdserve.server.errors import APIError
from pdserve.server.metrics import ServerMetrics


def test_choice_request_ids_are_the_request_id_and_the_index():
    assert choice_request_id("req-7", 2) == "req-7-2"
    # a worker's routes carry the router's choice id; their one engine request is index 0
    assert choice_request_id(choice_request_id("cmpl-x", 1)) == "cmpl-x-1-0"


def test_a_group_attached_by_a_worker_route_uses_the_id_its_kv_is_keyed_by():
    """The decode route keys the KV receiver by choice_request_id(request_id) and attaches
    a group for request_id: the group's engine request must be that same id."""

    async def main():
        engine = AsyncEngine(lambda: None, ServerMetrics)
        engine.metrics = ServerMetrics("m")
        return engine.attach("cmpl-x-1", 1).subs[0].rid

    assert asyncio.run(main()) == choice_request_id("cmpl-x-1")


class _FakeEngine:
    """Just enough of an LLMEngine for the engine thread's loop; records which thread calls it."""

    def __init__(self):
        self.model_config = types.SimpleNamespace(name="fake")
        self.has_pending_reservations = False
        self.threads = []
        self.claims = {"r-0": True}

    def has_unfinished_requests(self):
        return False

    def stats(self):
        return {}

    def close(self):
        pass

    def claim_reservation(self, request_id, hold_s):
        self.threads.append(threading.current_thread().name)
        return self.claims[request_id]  # a KeyError for an unknown id

    def reserve_for_transfer(
        self, request_id, prompt_ids, params, receiver, deadline_s, arrival_time=None, wait_s=0.0, on_done=None
    ):
        self.waiting = on_done  # no room now: in line
        return PENDING

    def admit_waiting(self, dest):
        self.waiting(dest)

    def cancel_reservation(self, request_id):
        self.cancelled = request_id

    def expire_reservations(self, now=None):
        return [f"gone-at-{now}"]


def _with_engine(body):
    async def main():
        fake = _FakeEngine()
        engine = AsyncEngine(lambda: fake, ServerMetrics)
        engine.start()
        await asyncio.wait_for(engine.ready.wait(), 10)
        try:
            return fake, await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def test_named_commands_run_on_the_engine_thread_and_return_its_result():
    async def body(engine):
        return await engine.claim_reservation("r-0", 5.0), await engine.expire_reservations(everything=True)

    fake, (claimed, gone) = _with_engine(body)
    assert claimed is True and gone == ["gone-at-inf"]
    assert fake.threads == ["pdserve-engine"]


def test_what_a_command_raises_on_the_engine_thread_reaches_the_caller():
    async def body(engine):
        with pytest.raises(KeyError):
            await engine.claim_reservation("nobody", 5.0)
        return await engine.claim_reservation("r-0", 1.0)  # the thread lives on

    assert _with_engine(body)[1] is True


def test_a_reservation_waiting_in_line_resolves_when_the_engine_admits_it_or_is_cancelled():
    async def body(engine):
        waiting = asyncio.ensure_future(engine.reserve_for_transfer("r-0", [1, 2], None, None, 30.0, wait_s=5.0))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        fake = engine.engine
        fake.admit_waiting("the-destination")  # what the engine's retry_reservations does once there is room
        dest = await asyncio.wait_for(waiting, 5)
        given_up = asyncio.ensure_future(engine.reserve_for_transfer("r-1", [1], None, None, 30.0, wait_s=5.0))
        await asyncio.sleep(0.2)
        given_up.cancel()  # the router's client left
        await asyncio.sleep(0.2)
        return dest, fake.cancelled

    assert _with_engine(body)[1] == ("the-destination", "r-1")


def test_commands_before_the_engine_loaded_get_503():
    async def main():
        engine = AsyncEngine(lambda: None, ServerMetrics)
        with pytest.raises(APIError) as e:
            await engine.abort_request("r-0")
        return e.value

    assert asyncio.run(main()).status == 503


def test_every_named_command_has_an_engine_side():
    """The AsyncEngine methods that cross to the engine thread are exactly ENGINE_COMMANDS."""
    src = inspect.getsource(AsyncEngine)
    sent = set(re.findall(r'self\._command\(\s*"(\w+)"', src))
    assert sent == set(ENGINE_COMMANDS)
    assert all(callable(getattr(AsyncEngine, name, None)) for name in ENGINE_COMMANDS)
    assert not hasattr(AsyncEngine, "call")  # no arbitrary function crosses to the engine thread


def test_worker_heartbeat_stats_from_a_snapshot():
    from pdserve.costmodel import DecodeCostModel
    from pdserve.server.async_engine import HeartbeatSnapshot
    from pdserve.worker.cli import WorkerState

    snap = HeartbeatSnapshot([], 16, None, running_context_tokens=300, prefill_steps=[], decode_steps=[])
    state = WorkerState(static_stats={"num_layers": 2, "max_num_seqs": 8})
    assert state.live_stats(snap) == {
        "num_layers": 2,
        "max_num_seqs": 8,
        "running_context_tokens": 300,
        "kv_block_size": 16,
    }
    state.calibration = {"prefill_cost_s": [0.01, 0.001, 0.0]}
    state.decode_model = DecodeCostModel(0.01, 0.001, 1e-6)
    live = state.live_stats(snap)
    assert live["prefill_live_scale"] == 1.0 and live["prefill_cost_s"] == [0.01, 0.001, 0.0]
    assert live["decode_live_scale"] == 1.0 and live["decode_cost_s"] == [0.01, 0.001, 1e-6]
