"""The prefix index follows the workers' KV tiers from their ordinary events, and placement
prices a lower-tier hit between a pool hit and a miss."""

from pdserve.kv.hashing import block_hashes
from pdserve.router import conductor
from pdserve.router.placement import Placer
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Registry, WorkerInfo

BS = 16


def _events(*evs):
    return [{"seq": i + 1, "kind": k, "block_hashes": h} for i, (k, h) in enumerate(evs)]


def test_evicted_blocks_move_to_the_workers_lower_tiers_within_their_capacity():
    idx = PrefixIndex()
    hashes = block_hashes(list(range(6 * BS)), BS)
    idx.apply_events("p0", "e", [])
    idx.set_tiers("p0", lower_capacity_blocks=4, shares=False)
    idx.apply_events("p0", "e", _events(("stored", hashes), ("evicted", hashes)))
    assert idx.hit_blocks("p0", hashes) == 0
    # the capacity keeps the 4 most recent; the prefix from block 0 is what counts
    assert idx.lower_hit_blocks("p0", hashes, 0) == 0
    assert idx.lower_hit_blocks("p0", hashes, 2) == 4
    # a worker without tiers forgets what it evicts
    idx.apply_events("p1", "e", _events(("stored", hashes), ("evicted", hashes)))
    assert idx.lower_hit_blocks("p1", hashes, 0) == 0


def test_the_shared_store_serves_every_sharing_worker():
    idx = PrefixIndex()
    hashes = block_hashes(list(range(5 * BS)), BS)
    for w, shares in (("p0", True), ("p1", True), ("p2", False)):
        idx.apply_events(w, "e", [])
        idx.set_tiers(w, 0, shares)
    idx.apply_events("p0", "e", _events(("stored", hashes)))  # p0 computed it, and published it
    assert idx.hit_blocks("p0", hashes) == 5
    assert idx.lower_hit_blocks("p1", hashes, 0) == 5  # p1 can load it from the store
    assert idx.lower_hit_blocks("p2", hashes, 0) == 0  # p2 is not on the store
    # a worker restart empties its pool, not what it knows of the store and its disk
    idx.apply_events("p1", "e2", [])
    assert idx.lower_hit_blocks("p1", hashes, 0) == 5


def test_a_store_hit_ranks_between_a_pool_hit_and_a_miss():
    local = conductor.effective_hit_ratio(8, 0, BS, 8 * BS + 1, 0.2)
    lower = conductor.effective_hit_ratio(0, 8, BS, 8 * BS + 1, 0.2)
    miss = conductor.effective_hit_ratio(0, 0, BS, 8 * BS + 1, 0.2)
    assert local > lower > miss == 0.0
    assert conductor.effective_hit_ratio(0, 8, BS, 8 * BS + 1, 1.0) == 0.0  # a load as slow as compute


def test_placement_prefers_the_worker_that_can_load_the_prefix():
    reg = Registry()
    for i in range(2):
        reg.register(WorkerInfo(f"p{i}", f"http://p{i}", "prefill"))
    reg.register(WorkerInfo("d0", "http://d0", "decode"))
    store = {"kv_store": {"tiers": {}, "lower_capacity_blocks": 0, "shared": True}}
    reg.heartbeat("p0", {"kv_block_size": BS})
    reg.heartbeat("p1", {"kv_block_size": BS, **store})
    placer = Placer("cache_aware", clock=lambda: 100.0)
    prompt = list(range(12 * BS))
    for w in ("p0", "p1", "d0"):
        placer.index.apply_events(w, "e", [])
    placer.index.set_tiers("p1", 0, True)
    placer.index.set_tiers("d0", 0, True)
    placer.index.apply_events("d0", "e", _events(("stored", block_hashes(prompt, BS))))  # published by d0
    assert placer.pick(reg, prompt)[0].worker_id == "p1"
