"""The router's pool sizes: a pool nobody sized is not managed, so a by-hand deployment's
`pdserve scale --decode ...` leaves the prefill workers started by hand alone; a worker
the router retired is not reported dead when it stops."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pdserve.router.disagg import DisaggEngine
from pdserve.router.pools import PoolManager
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.server.metrics import ServerMetrics


def _registry(**roles) -> Registry:
    reg = Registry(timeout_s=1.0)
    for role, n in roles.items():
        for i in range(n):
            reg.register(WorkerInfo(f"{role}-{i}", f"http://127.0.0.1:{9000 + i}", role))
    return reg


def _manager(reg):
    drained = []

    async def drain(w):
        drained.append(w.worker_id)

    return PoolManager(reg, drain), drained


def test_scaling_one_pool_by_hand_leaves_the_other_unmanaged():
    reg = _registry(prefill=1, decode=1)
    pools, drained = _manager(reg)
    assert pools.scale({"decode": "+1"}) == {"decode": 2}
    reg.register(WorkerInfo("prefill-9", "http://127.0.0.1:9100", "prefill"))  # started by hand
    asyncio.run(pools.tick())
    assert drained == []  # it joins; nobody sized the prefill pool
    assert pools.scale({"prefill": "-1"}) == {"decode": 2, "prefill": 1}  # counted from the live 2
    asyncio.run(pools.tick())
    assert len(drained) == 1 and drained[0].startswith("prefill")


def test_a_supervisor_sizes_the_pools_nobody_sized():
    reg = _registry(prefill=1, decode=1)
    pools, _ = _manager(reg)
    pools.scale({"decode": 3})
    assert pools.supervisor_poll({"prefill": 1, "decode": 1}) == {"decode": 3, "prefill": 1}


def test_the_deployment_keeps_a_worker_only_when_every_pool_is_sized():
    pools, _ = _manager(_registry(prefill=1, decode=1))
    assert pools.scale({"decode": 0}) == {"decode": 0}  # the prefill pool serves whole requests
    with pytest.raises(ValueError, match="at least one worker"):
        pools.scale({"prefill": 0})


def test_a_retired_worker_that_stops_is_not_counted_dead(caplog):
    async def main():
        reg = _registry(prefill=1, decode=2)
        engine = DisaggEngine(None, reg, metrics=ServerMetrics("tiny"))
        reg.timeout_s = 0.2
        reg.get("decode-1").stats = {"draining": True}  # retired: it drains, then exits
        task = asyncio.ensure_future(engine._expire_loop())
        deadline = time.monotonic() + 5
        while any(w.alive for w in reg.all()) and time.monotonic() < deadline:
            for wid in ("prefill-0",):  # the others fall silent
                reg.heartbeat(wid, {})
            await asyncio.sleep(0.05)
        task.cancel()

    caplog.set_level(logging.INFO, "pdserve")
    asyncio.run(main())
    assert "decode-1 drained and stopped" in caplog.text
    dead = [r.getMessage() for r in caplog.records if "counted dead" in r.getMessage()]
    assert dead == ["no heartbeat from decode-0 for 0.2 s: counted dead"]
