"""Placer policies over a registry and the prefix index; the heartbeat's KV event path."""

import types

import pytest

from pdserve.kv.block_manager import BlockManager
from pdserve.kv.hashing import ROOT_HASH, block_hashes, salt_root
from pdserve.router import policy
from pdserve.router.app import _feed_index
from pdserve.router.placement import Placer
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Registry, WorkerInfo
from pdserve.server.async_engine import ENGINE_COMMANDS
from pdserve.server.errors import APIError
from pdserve.worker.kv_publisher import KVEventPublisher

BS = 16


def _registry(num_prefill=2):
    reg = Registry()
    for i in range(num_prefill):
        reg.register(WorkerInfo(f"p{i}", f"http://p{i}", "prefill"))
        reg.heartbeat(f"p{i}", {"kv_block_size": BS})
    reg.register(WorkerInfo("d0", "http://d0", "decode"))
    return reg


class _Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_cache_aware_follows_the_prefix_then_spreads_a_burst():
    reg, clock = _registry(), _Clock()
    placer = Placer("cache_aware", clock=clock)
    prompt = list(range(20 * BS))
    placer.index.apply_events("p1", "e", [{"seq": 1, "kind": "stored", "block_hashes": block_hashes(prompt, BS)}])
    p, d = placer.pick(reg, prompt)
    assert (p.worker_id, d.worker_id) == ("p1", "d0")  # H = 1 on p1
    # cold prompts: the first goes to p0 (idle), and a burst alternates since each pick books time
    cold = [list(range(1000 + i * 500, 1000 + i * 500 + 400)) for i in range(4)]
    assert [placer.pick(reg, c)[0].worker_id for c in cold] == ["p0", "p1", "p0", "p1"]
    clock.t += 60  # all drained
    assert placer.pick(reg, prompt + [1])[0].worker_id == "p1"


def test_cache_aware_matches_a_salted_prefix_only_under_its_salt():
    """Workers report salted block hashes; the router hashes a prompt under the request's
    salt, so another tenant's (or an unsalted) identical prompt is not drawn to that cache."""
    reg, clock = _registry(), _Clock()
    placer = Placer("cache_aware", clock=clock)
    prompt = list(range(20 * BS))
    salted = block_hashes(prompt, BS, root=salt_root("tenant-a"))
    placer.index.apply_events("p1", "e", [{"seq": 1, "kind": "stored", "block_hashes": salted}])
    assert placer.cached_tokens(reg.get("p1"), prompt, salt_root("tenant-a")) == 20 * BS
    assert placer.cached_tokens(reg.get("p1"), prompt) == 0
    assert placer.cached_tokens(reg.get("p1"), prompt, salt_root("tenant-b")) == 0
    assert placer.pick(reg, prompt)[0].worker_id == "p0"  # p0 idle, no hit anywhere: first
    clock.t += 60
    assert placer.pick(reg, prompt, salt_root("tenant-a"))[0].worker_id == "p1"


def test_cache_aware_busy_cached_worker_loses_at_high_alpha():
    reg, clock = _registry(), _Clock()
    prompt = list(range(8 * BS))
    for alpha, want in ((0.1, "p1"), (50.0, "p0")):
        placer = Placer("cache_aware", alpha=alpha, clock=clock)
        placer.index.apply_events("p1", "e", [{"seq": 1, "kind": "stored", "block_hashes": block_hashes(prompt, BS)}])
        placer._busy_until_s["p1"] = clock.t + 0.05  # p1 has 50 ms of queued prefill
        assert placer.pick(reg, prompt)[0].worker_id == want


def test_consistent_hash_sticks_to_a_prefix_and_moves_little():
    reg = _registry(num_prefill=4)
    placer = Placer("consistent_hash")
    convo = list(range(100))
    first = placer.pick(reg, convo)[0].worker_id
    assert all(placer.pick(reg, convo + list(range(n)))[0].worker_id == first for n in (5, 50, 500))
    keys = range(2000)
    before = {k: policy.consistent_hash(k, ["a", "b", "c", "d"]) for k in keys}
    after = {k: policy.consistent_hash(k, ["a", "b", "c"]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == "d" for k in moved)  # only the leaver's keys move
    assert 0.15 < len(moved) / len(keys) < 0.35
    with pytest.raises(ValueError):
        policy.consistent_hash(1, [])


def test_unknown_policy_rejected():
    with pytest.raises(ValueError):
        Placer("random")


def test_publisher_to_index_through_the_heartbeat_path():
    """Worker side numbers drained events; a lost heartbeat forces a snapshot that resyncs."""
    bm = BlockManager(num_blocks=8, block_size=4, record_events=True)
    pub, idx = KVEventPublisher(), PrefixIndex()

    engine = types.SimpleNamespace(block_manager=bm, scheduler=types.SimpleNamespace(running=[]))

    def heartbeat(deliver=True):
        snap = ENGINE_COMMANDS["heartbeat_snapshot"](engine, pub.want_snapshot, None)
        body = pub.payload(snap.kv_events, snap.cached_hashes)
        if deliver:
            pub.want_snapshot = _feed_index(idx, "w", body)

    def run(seq_id, tokens):
        assert bm.allocate(seq_id, len(tokens))
        bm.cache_full_blocks(seq_id, tokens, len(tokens), root=ROOT_HASH)
        bm.free(seq_id)

    a, b = list(range(8)), list(range(50, 62))
    run("a", a)
    heartbeat()
    assert idx.hit_blocks("w", block_hashes(a, 4)) == 2 and not pub.want_snapshot
    run("b", b)
    heartbeat(deliver=False)  # the router never saw these
    run("c", list(range(90, 94)))
    heartbeat()
    assert pub.want_snapshot and idx.hit_blocks("w", block_hashes(b, 4)) == 0
    heartbeat()  # carries the snapshot
    assert not pub.want_snapshot
    assert idx.hit_blocks("w", block_hashes(b, 4)) == 3
    with pytest.raises(APIError):
        _feed_index(idx, "w", {"events": []})


def test_router_counters_never_go_down_when_workers_die_or_restart():
    import asyncio

    from pdserve.router.disagg import DisaggEngine
    from pdserve.router.registry import Registry, WorkerInfo

    async def make():
        return DisaggEngine(None, Registry(), metrics=None)

    e = asyncio.run(make())
    reg = e.registry
    for wid in ("p0", "d0"):
        reg.register(WorkerInfo(wid, "http://127.0.0.1:1", "both"))
    reg.heartbeat("p0", {"prompt_tokens_computed": 100, "num_preemptions": 2})
    reg.heartbeat("d0", {"prompt_tokens_computed": 50})
    assert e._worker_counters()["prompt_tokens_computed"] == 150
    reg.mark_dead("d0")  # dead: what it counted still happened
    assert e._worker_counters()["prompt_tokens_computed"] == 150
    reg.register(WorkerInfo("p0", "http://127.0.0.1:2", "both"))  # restarted under its name, from 0
    reg.heartbeat("p0", {"prompt_tokens_computed": 10, "num_preemptions": 0})
    totals = e._worker_counters()
    assert totals["prompt_tokens_computed"] == 160 and totals["num_preemptions"] == 2


def test_a_router_that_stalled_forgives_its_workers():
    from pdserve.router.registry import Registry, WorkerInfo

    reg = Registry(timeout_s=2)
    reg.register(WorkerInfo("w", "http://127.0.0.1:1", "both"))
    later = reg.get("w").last_seen_s + 30  # the router's loop did not run for 30 s
    reg.forgive(30)
    assert reg.expire(later + 1) == [] and reg.expire(later + 3) == ["w"]
