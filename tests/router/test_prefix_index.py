"""The router's prefix index: events in order, gaps, restarts, snapshots, H_i."""

import pytest

from pdserve.kv.block_manager import BlockManager
from pdserve.kv.hashing import ROOT_HASH, block_hashes
from pdserve.router.prefix_index import PrefixIndex

BS = 4


def _ev(seq, kind, hashes=()):
    return {"seq": seq, "kind": kind, "block_hashes": list(hashes)}


def test_insert_gives_leading_hit_blocks_and_ratio():
    idx = PrefixIndex()
    prompt = list(range(20))  # 5 full blocks of 4
    hs = block_hashes(prompt, BS)
    assert idx.apply_events("p0", "e1", [_ev(1, "stored", hs[:3])])
    assert idx.hit_blocks("p0", hs) == 3
    assert idx.hit_ratio("p0", hs, BS, len(prompt)) == pytest.approx(12 / 20)
    assert idx.hit_blocks("p1", hs) == 0  # a worker never heard of holds nothing
    # a different prompt with the same second block but another first: chained hashes differ
    other = block_hashes([99] * 4 + prompt[4:], BS)
    assert idx.hit_blocks("p0", other) == 0


def test_hit_counts_only_the_leading_run():
    idx = PrefixIndex()
    hs = block_hashes(list(range(16)), BS)
    idx.apply_events("p0", "e1", [_ev(1, "stored", [hs[0], hs[2], hs[3]])])
    assert idx.hit_blocks("p0", hs) == 1


def test_evict_and_clear():
    idx = PrefixIndex()
    hs = block_hashes(list(range(16)), BS)
    idx.apply_events("p0", "e1", [_ev(1, "stored", hs), _ev(2, "evicted", [hs[1]])])
    assert idx.hit_blocks("p0", hs) == 1
    idx.apply_events("p0", "e1", [_ev(3, "cleared")])
    assert idx.hit_blocks("p0", hs) == 0
    with pytest.raises(ValueError):
        idx.apply_events("p0", "e1", [_ev(4, "bogus")])


def test_gap_unsyncs_until_snapshot_then_events_resume():
    idx = PrefixIndex()
    hs = block_hashes(list(range(16)), BS)
    assert idx.apply_events("p0", "e1", [_ev(1, "stored", hs[:1])])
    # events 2..3 lost: 4 arrives
    assert not idx.apply_events("p0", "e1", [_ev(4, "stored", hs[1:2])])
    assert idx.needs_snapshot("p0") and idx.hit_blocks("p0", hs) == 0
    assert not idx.apply_events("p0", "e1", [_ev(5, "stored", hs[2:3])])  # still waiting
    idx.apply_snapshot("p0", "e1", 5, hs[:3])
    assert not idx.needs_snapshot("p0") and idx.hit_blocks("p0", hs) == 3
    # events the snapshot already covers are skipped; the next one applies
    assert idx.apply_events("p0", "e1", [_ev(5, "evicted", hs[:1]), _ev(6, "stored", hs[3:])])
    assert idx.hit_blocks("p0", hs) == 4
    assert idx.stats()["p0"]["num_gaps"] == 1


def test_worker_restart_new_epoch_starts_empty():
    idx = PrefixIndex()
    hs = block_hashes(list(range(16)), BS)
    idx.apply_events("p0", "e1", [_ev(1, "stored", hs)])
    assert idx.apply_events("p0", "e2", [])  # restarted: empty cache, numbering from 1
    assert idx.hit_blocks("p0", hs) == 0
    assert idx.apply_events("p0", "e2", [_ev(1, "stored", hs[:2])])
    assert idx.hit_blocks("p0", hs) == 2


def test_router_restart_sees_mid_epoch_events_as_a_gap():
    idx = PrefixIndex()  # a fresh router; the worker is at event 41 of its epoch
    assert idx.needs_snapshot("p0")
    assert not idx.apply_events("p0", "e1", [_ev(41, "stored", [1])])
    idx.apply_snapshot("p0", "e1", 41, [7, 8])
    assert idx.hit_blocks("p0", [7, 8, 9]) == 2
    idx.remove("p0")
    assert idx.hit_blocks("p0", [7]) == 0


def test_index_follows_a_real_block_manager():
    """The block manager's own events, numbered, keep the index equal to its cache."""
    bm = BlockManager(num_blocks=6, block_size=BS, record_events=True)
    idx, seq = PrefixIndex(), 0

    def run(seq_id, tokens):
        nonlocal seq
        assert bm.allocate(seq_id, len(tokens))
        bm.cache_full_blocks(seq_id, tokens, len(tokens), root=ROOT_HASH)
        bm.free(seq_id)
        evs = []
        for e in bm.drain_events():
            seq += 1
            evs.append({"seq": seq, "kind": e.kind, "block_hashes": e.block_hashes})
        assert idx.apply_events("w", "e", evs)

    a, b = list(range(16)), list(range(100, 116))
    run("a", a)
    assert idx.hit_blocks("w", block_hashes(a, BS)) == 4
    run("b", b)  # 6 blocks: b's 4 evict the 2 least recently used of a's
    assert set(bm.cached) == idx._workers["w"].hashes
    assert idx.hit_blocks("w", block_hashes(b, BS)) == 4
