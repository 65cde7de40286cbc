"""Which run-time LoRA adapters the router copies to a worker that registers, and which it takes
back (router/disagg.py, sync_lora_adapters). The copy itself, through real worker processes,
is tests/server/test_lora_api.py's restarted-worker test."""

import asyncio
import logging

from pdserve.control_api import LORA_ENABLED_FEATURE, LORA_FEATURE_PREFIX, WORKER_FEATURES, RegisterRequest
from pdserve.router.disagg import DisaggEngine
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.server.metrics import ServerMetrics


def _worker(wid: str, *keys: str, lora: bool = True, port: int = 1) -> WorkerInfo:
    features = {*(LORA_FEATURE_PREFIX + k for k in keys), *([LORA_ENABLED_FEATURE] if lora else [])}
    return WorkerInfo(wid, f"http://127.0.0.1:{port}", "decode", features=frozenset(features))


def _engine(*workers: WorkerInfo) -> DisaggEngine:
    reg = Registry()
    for w in workers:
        reg.register(w)
    return DisaggEngine(None, reg, metrics=ServerMetrics("tiny"))


def test_adapters_more_than_half_of_the_others_hold_are_copied():
    e = _engine(_worker("a", "x@1", "g@1"), _worker("b", "x@1"), _worker("c"), _worker("j"))
    assert e._adapters_to_copy("j") == {"x": "x@1"}  # 2 of 3 others; g (1 of 3) is one worker's stray
    assert e._adapters_to_copy("c") == {"x": "x@1"}
    # workers that serve no adapters (--enable-lora off, an older version) do not count
    e = _engine(_worker("a", "x@1"), _worker("old", lora=False), _worker("j"))
    assert e._adapters_to_copy("j") == {"x": "x@1"}
    # the joiner's own start-up adapter of that name does not vote: the others' run-time
    # replacement wins, whatever the count of a two-worker deployment
    e = _engine(_worker("p", "x@b"), _worker("d", "x@a"))
    assert e._adapters_to_copy("d") == {"x": "x@b"}
    e.registry.mark_dead("p")
    assert e._adapters_to_copy("d") == {}  # nobody left to copy from


def test_a_worker_that_missed_an_unload_gives_it_up_when_it_registers(caplog):
    async def main():
        e = _engine(_worker("a", "g@1"), _worker("b", "g@1"))
        e.start()
        try:
            e.registry.mark_dead("b")  # away (stopped, its heartbeats late) while g is unloaded
            await e.unload_lora_adapter("g")  # a is told (and cannot be reached here: logged)
            assert e.lora_adapters() == {}
            # b comes back and registers with what it still holds: g leaves its features at
            # once (no request is placed there for it), and the sync tells b to unload it
            e.registry.register(_worker("b", "g@1"))
            e.sync_lora_adapters("b")
            assert LORA_FEATURE_PREFIX + "g@1" not in e.registry.get("b").features
            assert e.lora_adapters() == {}
            first = e._syncing["b"]
            e.registry.register(_worker("b", "g@1", port=2))  # a new process, again
            e.sync_lora_adapters("b")
            await asyncio.sleep(0)
            assert first.cancelled() and e._syncing["b"] is not first
            await asyncio.wait_for(e._syncing["b"], 30)
            # loading the name again ends its being unloaded
            e._lora_unloaded.clear()
            e.registry.register(_worker("c", "g@2"))
            e.sync_lora_adapters("c")
            assert LORA_FEATURE_PREFIX + "g@2" in e.registry.get("c").features
        finally:
            await e.shutdown()

    caplog.set_level(logging.WARNING, "pdserve")
    asyncio.run(main())
    assert "worker b still holds the LoRA adapter 'g' unloaded elsewhere" in caplog.text


def test_a_worker_holding_the_most_adapters_still_registers():
    """Its features: the request features, "lora", and every adapter it may hold."""
    from pdserve.config import MAX_LORAS_LIMIT

    limit = RegisterRequest.model_fields["features"].metadata
    max_len = next(m.max_length for m in limit if hasattr(m, "max_length"))
    assert len(WORKER_FEATURES) + 1 + MAX_LORAS_LIMIT <= max_len
