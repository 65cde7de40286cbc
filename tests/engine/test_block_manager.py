"""The real BlockManager, on synthetic sequences: no model needed."""

from pdserve.kv.block_manager import BlockManager
from pdserve.kv.hashing import ROOT_HASH, block_hashes


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(10, 4)
    assert bm.allocate("a", 9)  # 3 blocks
    assert bm.num_free_blocks == 7
    assert len(bm.block_table("a")) == 3
    assert bm.allocate("a", 13)  # grows by one
    assert bm.num_free_blocks == 6
    bm.free("a")
    assert bm.num_free_blocks == 10


def test_fenced_blocks_come_back_at_their_time_or_when_their_writer_is_done():
    bm = BlockManager(10, 4)
    assert bm.allocate("a", 9) and bm.allocate("b", 4)
    a_blocks = bm.block_table("a")
    assert bm.fence("a", until=100.0) == 3 and bm.fence("b", until=50.0) == 1
    assert bm.fence("gone", until=1.0) == 0  # nothing held: nothing fenced
    assert bm.num_free_blocks == 6 and bm.num_fenced_blocks == 4 and "a" not in bm.seqs
    assert bm.allocate("c", 24) and not set(a_blocks) & set(bm.block_table("c"))  # never handed out
    bm.free("c")
    assert bm.release_fenced(now=60.0) == 1 and bm.num_fenced_blocks == 3  # b's time came
    assert bm.release_fenced(now=60.0, seq_ids={"a"}) == 3  # a's writer said it is done
    assert bm.num_free_blocks == 10 and bm.num_fenced_blocks == 0


def test_allocation_refused_when_pool_short():
    bm = BlockManager(4, 4)
    assert bm.allocate("a", 12)
    assert not bm.allocate("b", 8)
    assert bm.num_free_blocks == 1  # a refused allocation takes nothing
    assert "b" not in bm.seqs or not bm.seqs["b"].blocks


def test_prefix_hit_after_full_blocks_cached():
    bm = BlockManager(16, 4)
    toks = list(range(10))
    bm.find_cached_prefix("a", toks, root=ROOT_HASH)
    assert bm.allocate("a", 10)
    bm.cache_full_blocks("a", toks, 10, root=ROOT_HASH)  # 2 full blocks registered
    hit, n = bm.find_cached_prefix("b", toks + [99], root=ROOT_HASH)
    assert n == 8 and [b.block_id for b in hit] == bm.block_table("a")[:2]
    assert bm.allocate("b", 11, hit)
    assert bm.block_table("b")[:2] == bm.block_table("a")[:2]
    assert all(b.ref_cnt == 2 for b in hit)
    assert bm.stats.hits_tokens == 8


def test_blocks_filled_across_chunks_and_decode_steps_are_all_cached():
    """A block half filled by one chunk (or decode step) and completed by the next is registered
    too: a 12-token prompt prefilled in chunks of 6, then 4 generated tokens, is cached whole."""
    bm = BlockManager(16, 4)
    toks = list(range(16))
    bm.find_cached_prefix("a", toks[:12], root=ROOT_HASH)
    for done in (6, 12):  # chunked prefill: blocks 0-1, then 1-2; block 1 is full only after the second
        assert bm.allocate("a", done)
        bm.cache_full_blocks("a", toks[:done], done, root=ROOT_HASH)
    for n in range(13, 17):  # decode: one token a step, block 3 fills at the fourth
        assert bm.allocate("a", n)
        bm.cache_full_blocks("a", toks[:n], n, root=ROOT_HASH)
    hit, n = bm.find_cached_prefix("b", toks + [99], root=ROOT_HASH)
    assert n == 16 and [b.block_id for b in hit] == bm.block_table("a")


def test_a_full_prompt_hit_still_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    toks = list(range(8))
    bm.find_cached_prefix("a", toks, root=ROOT_HASH)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks, 8, root=ROOT_HASH)
    _, n = bm.find_cached_prefix("b", toks, root=ROOT_HASH)
    assert n == 4  # the last block is recomputed to produce logits


def test_lru_evicts_least_recently_freed_prefix_first():
    bm = BlockManager(4, 4)
    for sid, base in (("a", 0), ("b", 100)):
        toks = list(range(base, base + 8))
        bm.find_cached_prefix(sid, toks, root=ROOT_HASH)
        bm.allocate(sid, 8)
        bm.cache_full_blocks(sid, toks, 8, root=ROOT_HASH)
        bm.free(sid)
    assert len(bm.cached) == 4 and bm.num_free_blocks == 4
    # needing 2 blocks evicts a's two blocks (freed first), b's prefix survives
    assert bm.allocate("c", 8)
    _, n_b = bm.find_cached_prefix("x", list(range(100, 108)) + [1], root=ROOT_HASH)
    _, n_a = bm.find_cached_prefix("y", list(range(0, 8)) + [1], root=ROOT_HASH)
    assert n_b == 8 and n_a == 0


def test_shared_prefix_outlives_unique_suffix():
    bm = BlockManager(3, 4)
    toks = list(range(12))
    bm.find_cached_prefix("a", toks, root=ROOT_HASH)
    bm.allocate("a", 12)
    bm.cache_full_blocks("a", toks, 12, root=ROOT_HASH)
    bm.free("a")
    assert bm.allocate("b", 4)  # takes one block: the deepest (last) one goes first
    _, n = bm.find_cached_prefix("c", toks[:8] + [5], root=ROOT_HASH)
    assert n == 8


def test_shared_blocks_are_full_and_registered_so_growth_takes_fresh_ones():
    """Why there is no copy-on-write: a prefix hit shares only full, registered blocks, and
    a sequence that grows gets blocks of its own."""
    bm = BlockManager(8, 4)
    toks = list(range(8))
    bm.find_cached_prefix("a", toks, root=ROOT_HASH)
    assert bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks, 8, root=ROOT_HASH)
    hit, n = bm.find_cached_prefix("b", toks + [1, 2], root=ROOT_HASH)
    assert n == 8 and bm.allocate("b", 10, hit)
    assert bm.allocate("b", 13)  # grows past the shared blocks
    shared = [b for b in bm.blocks if b.ref_cnt > 1]
    assert shared == hit and all(b.block_hash is not None for b in shared)
    assert all(bm.blocks[i].ref_cnt == 1 for i in bm.block_table("b")[2:])
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 8


def test_events_report_stored_and_evicted_hashes():
    bm = BlockManager(2, 4, record_events=True)
    toks = list(range(8))
    bm.find_cached_prefix("a", toks, root=ROOT_HASH)
    bm.allocate("a", 8)
    bm.cache_full_blocks("a", toks, 8, root=ROOT_HASH)
    bm.free("a")
    stored = bm.drain_events()
    assert [e.kind for e in stored] == ["stored"] and stored[0].block_hashes == block_hashes(toks, 4)
    bm.allocate("b", 4)
    ev = bm.drain_events()
    assert ev[0].kind == "evicted" and ev[0].block_hashes[0] in stored[0].block_hashes


def test_block_hashes_are_chained_and_stable():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert a[1] != b[1]  # same block tokens, different prefix
    assert a == block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert block_hashes([1, 2, 3, 4], 4, start=a[:1]) == a[:1]
