"""The local KV tiers: the block codec, host memory, disk, and the engine loading from them."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import threading
import time

import pytest
import torch

from pdserve.kvstore import codec
from pdserve.kvstore.disk import SUFFIX, DiskTier
from pdserve.kvstore.host import HostTier
from pdserve.kvstore.tier import KVTier

SHAPE = [2, 2, 4, 2, 8]  # layers, K/V, block_size, heads, dim
FP = "00112233aabbccdd"


def _blob(h=7, tokens=(1, 2, 3, 4), fp=FP, dtype=torch.float32):
    kv = torch.randn(SHAPE).to(dtype)
    return kv, codec.encode(fp, h, tokens, kv)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_codec_round_trip(dtype):
    kv, blob = _blob(dtype=dtype)
    out = codec.decode(blob, FP, 7, (1, 2, 3, 4), SHAPE, dtype)
    assert torch.equal(out, kv)


def test_codec_refuses_corrupt_truncated_and_foreign_blocks():
    _, blob = _blob()
    flipped = bytearray(blob)
    flipped[-5] ^= 0xFF
    for bad, kind in [
        (bytes(flipped), "corrupt"),
        (blob[: len(blob) // 2], "corrupt"),
        (blob[:3], "corrupt"),
        (b"XXXX" + blob[4:], "corrupt"),
    ]:
        with pytest.raises(codec.BadBlock) as e:
            codec.decode(bad, FP, 7, (1, 2, 3, 4), SHAPE, torch.float32)
        assert e.value.kind == kind
    for args in [
        ("ffffffffffffffff", 7, (1, 2, 3, 4), SHAPE, torch.float32),  # another model wrote it
        (FP, 8, (1, 2, 3, 4), SHAPE, torch.float32),  # another block
        (FP, 7, (1, 2, 3, 5), SHAPE, torch.float32),  # same hash, other tokens
        (FP, 7, (1, 2, 3, 4), [2, 2, 8, 2, 4], torch.float32),  # another layout
        (FP, 7, (1, 2, 3, 4), SHAPE, torch.bfloat16),
    ]:
        with pytest.raises(codec.BadBlock) as e:
            codec.decode(blob, *args)
        assert e.value.kind == "foreign"


def test_codec_a_well_digested_but_malformed_header_is_corrupt():
    """A header that passes the digest (an unkeyed local tier's can be forged) but is not an object,
    or whose length fits `nbytes` but not the shape, is a corrupt block (a miss), not a crash."""
    import json
    import struct

    def forged(head_obj, data):
        head = json.dumps(head_obj).encode()
        prefix = struct.pack("<4sHI", codec.MAGIC, codec.VERSION, len(head))
        return prefix + head + codec._digest(head, data) + data

    meta = {"model": FP, "hash": f"{7:016x}", "tokens": [1, 2, 3, 4], "dtype": "float32", "shape": SHAPE}
    for blob in (forged([1, 2], b"\0" * 8), forged({**meta, "nbytes": 8}, b"\0" * 8)):
        with pytest.raises(codec.BadBlock) as e:
            codec.decode(blob, FP, 7, (1, 2, 3, 4), SHAPE, torch.float32)
        assert e.value.kind == "corrupt"


def test_sealed_blocks_open_only_for_the_cluster_under_their_own_name():
    """The shared store's blocks: encrypted and authenticated with the cluster secret, bound to
    their name; the name itself is keyed (without the secret, no one can tell where a prompt's
    blocks would be)."""
    secret = b"the cluster's secret"
    kv = torch.randn(SHAPE).to(torch.bfloat16)
    name = codec.shared_key(FP, 7, secret)
    assert name != codec.shared_key(FP, 7, b"another secret") and name != codec.shared_key(FP, 8, secret)
    assert name.startswith(FP) and f"{7:016x}" not in name
    blob = codec.seal(FP, 7, (1, 2, 3, 4), kv, secret, name)
    args = (FP, 7, (1, 2, 3, 4), SHAPE, torch.bfloat16)
    assert torch.equal(codec.unseal(blob, *args, secret, name), kv)
    # nothing of the block is readable: not its header, its token ids, nor its data
    raw = kv.view(torch.uint8).numpy().tobytes()
    assert b'"tokens"' not in blob and raw[:64] not in blob and FP.encode() not in blob
    assert codec.seal(FP, 7, (1, 2, 3, 4), kv, secret, name) != blob  # a fresh nonce each time
    flipped = bytearray(blob)
    flipped[-20] ^= 1
    for bad, key, where in [
        (blob, b"another secret", name),  # not sealed by this cluster
        (blob, secret, codec.shared_key(FP, 8, secret)),  # moved under another block's name
        (bytes(flipped), secret, name),
        (blob[:30], secret, name),
        (b"XXXX" + blob[4:], secret, name),
    ]:
        with pytest.raises(codec.BadBlock) as e:
            codec.unseal(bad, *args, key, where)
        assert e.value.kind == "corrupt"
    # sealed by the cluster, but not the block asked for (a hash collision, another layout)
    with pytest.raises(codec.BadBlock, match="foreign"):
        codec.unseal(blob, FP, 7, (1, 2, 3, 5), SHAPE, torch.bfloat16, secret, name)
    with pytest.raises(codec.BadBlock, match="foreign"):  # an unsealed (local-format) block
        codec.unseal(codec.encode(*args[:3], kv), *args, secret, name)


def test_host_tier_keeps_its_bound_and_spills_the_oldest():
    spilled = []
    tier = HostTier(1000, spill=lambda k, d: spilled.append(k))
    for i in range(5):
        assert tier.put(f"{i:x}-0", bytes(300))
    assert tier.used_bytes <= 1000 and len(tier) == 3
    assert spilled == ["0-0", "1-0"] and tier.stats.evictions == 2
    assert tier.get("0-0") is None and tier.get("4-0") == bytes(300)
    assert not tier.put("a-0", bytes(2000)) and tier.stats.errors == 1


def test_host_tier_keeps_blocks_decoded_and_spills_them_encoded():
    """The host tier holds tensors (no encoding on save, no checksum on load); a block it
    drops reaches the disk as the codec's bytes, which decode to the same data."""
    kvs = [torch.randn(SHAPE).to(torch.bfloat16) for _ in range(3)]
    blocks = [codec.KVBlock(FP, h, (h, 2, 3, 4), kv) for h, kv in enumerate(kvs)]
    spilled = {}
    tier = HostTier(2 * blocks[0].nbytes, spill=lambda k, d: spilled.__setitem__(k, d.to_bytes()))
    for b in blocks:
        assert tier.put(codec.block_key(FP, b.block_hash), b)
    assert len(tier) == 2 and tier.used_bytes == 2 * blocks[0].nbytes
    on_disk = spilled[codec.block_key(FP, 0)]
    assert torch.equal(codec.decode(on_disk, FP, 0, (0, 2, 3, 4), SHAPE, torch.bfloat16), kvs[0])
    kept = tier.get(codec.block_key(FP, 2))
    assert torch.equal(kept.check(FP, 2, (2, 2, 3, 4), SHAPE, torch.bfloat16), kvs[2])
    for args in [
        ("ffffffffffffffff", 2, (2, 2, 3, 4), SHAPE, torch.bfloat16),
        (FP, 3, (2, 2, 3, 4), SHAPE, torch.bfloat16),
        (FP, 2, (9, 2, 3, 4), SHAPE, torch.bfloat16),
        (FP, 2, (2, 2, 3, 4), SHAPE, torch.float32),
    ]:
        with pytest.raises(codec.BadBlock) as e:
            kept.check(*args)
        assert e.value.kind == "foreign"


def test_disk_tier_bound_restart_and_leftovers(tmp_path):
    d = str(tmp_path / "kv")
    tier = DiskTier(d, 1000)
    for i in range(5):
        assert tier.put(f"{i:x}-0", bytes([i]) * 300)
    assert tier.used_bytes <= 1000 and len(_blocks(d)) == 3
    assert tier.get("4-0") == bytes([4]) * 300
    assert not tier.put("../escape-0", b"x") and not os.path.exists(tmp_path / "escape-0.kvblock")
    open(os.path.join(d, ".deadbeef.tmp"), "wb").write(b"half a block")  # a write a crash cut
    tier.close()
    again = DiskTier(d, 1000)  # a restart finds what was written, and drops the leftover
    assert sorted(again._files) == ["2-0", "3-0", "4-0"] and again.get("3-0") == bytes([3]) * 300
    assert not any(n.endswith(".tmp") for n in os.listdir(d))
    again.close()
    smaller = DiskTier(d, 650)  # a smaller bound after a restart is kept at once
    assert smaller.used_bytes <= 650 and len(_blocks(d)) == 2
    smaller.close()


def _blocks(d):
    return [n for n in os.listdir(d) if n.endswith(".kvblock")]


def test_disk_tier_directory_is_this_workers_alone(tmp_path, monkeypatch):
    """0700 even when it existed wider; another user's refused; one worker at a time."""
    import pdserve.kvstore.disk as disk

    d = tmp_path / "kv"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    tier = DiskTier(str(d), 1000)
    assert os.stat(d).st_mode & 0o777 == 0o700
    monkeypatch.setattr(disk, "LOCK_WAIT_S", 0.3)
    with pytest.raises(ValueError, match="in use by another process"):
        DiskTier(str(d), 1000)  # a second worker given the same --kv-disk-dir
    tier.close()
    DiskTier(str(d), 1000).close()  # free again once the first let go
    if os.geteuid() == 0:
        other = tmp_path / "theirs"
        other.mkdir()
        os.chown(other, 65534, 65534)
        with pytest.raises(ValueError, match="belongs to another user"):
            DiskTier(str(other), 1000)


def test_disk_tier_reads_only_the_regular_files_it_wrote(tmp_path):
    """A block name planted as a symbolic link (to /dev/zero: a read without end) or swapped for
    a FIFO (a read that never returns) is a miss, never read."""
    d = str(tmp_path / "kv")
    tier = DiskTier(d, 1 << 20)
    assert tier.put("1-0", b"x" * 100) and tier.put("2-0", b"y" * 100)
    os.symlink("/dev/zero", os.path.join(d, "3-0.kvblock"))
    tier.close()
    tier = DiskTier(d, 1 << 20)
    assert sorted(tier._files) == ["1-0", "2-0"]  # the link is not indexed
    os.unlink(os.path.join(d, "1-0.kvblock"))
    os.symlink("/dev/zero", os.path.join(d, "1-0.kvblock"))
    os.unlink(os.path.join(d, "2-0.kvblock"))
    os.mkfifo(os.path.join(d, "2-0.kvblock"))
    assert tier.get("1-0") is None and tier.get("2-0") is None  # at once, no hang
    assert tier.stats.errors == 2 and not tier.contains("1-0") and not tier.contains("2-0")
    tier.close()


@contextlib.contextmanager
def _small_file_system(path: str, size: int):
    """A real file system of `size` bytes (a tmpfs: writes past it fail with ENOSPC), unmounted after."""
    os.makedirs(path)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", path], check=False)
    if mount.returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], check=False).returncode != 0:
            subprocess.run(["umount", "-l", path], check=True)


def test_disk_tier_on_a_full_file_system_logs_once_and_is_unhealthy_until_a_write_succeeds(tmp_path, caplog):
    with _small_file_system(str(tmp_path / "fs"), 64 << 10) as d:
        tier = DiskTier(d, 16 << 20, log_interval_s=3600)  # a bound the file system cannot hold
        with caplog.at_level(logging.INFO, logger="pdserve.kvstore"):
            stored = [tier.put(f"{i:x}-0", bytes(8000)) for i in range(40)]
            failed = stored.count(False)
            assert stored[0] and failed > 20 and tier.stats.errors == failed and not tier.healthy()
            warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "No space left" in warnings[0], warnings
            assert tier.get("0-0") == bytes(8000)  # reads go on
            tier.log_interval_s = 0  # due again: the next failure is logged with what was not written since
            assert not tier.put("ff-0", bytes(8000))
            assert f"({failed} more not written)" in caplog.records[-1].getMessage()
            for key in list(tier._files)[:2]:
                tier.forget(key)
            assert tier.put("fe-0", bytes(8000)) and tier.healthy()
            assert f"writes succeed again ({failed + 1} blocks" in caplog.records[-1].getMessage()


def test_a_full_file_system_under_the_disk_tier_costs_requests_nothing(sharp_model, reference, tmp_path, caplog):
    with _small_file_system(str(tmp_path / "fs"), 64 << 10) as d:
        with caplog.at_level(logging.WARNING, logger="pdserve.kvstore"):
            with _llm(sharp_model, kv_disk_dir=d, kv_disk_bytes=64 << 20) as llm:
                assert [_run(llm, [p])[0] for p in PROMPTS * 2] == reference * 2
                _wait_saved(llm)
                disk = _tier(llm, "disk")
                assert disk["errors"] > 20 and disk["stores"] > 0 and not disk["healthy"], disk
        assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1


# ---- the store between the pool and the tiers


def _store(tmp_path, host: HostTier | None = None):
    from pdserve.kvstore.store import TieredKVStore

    caches = [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(2)]  # 8 blocks of 4 tokens
    disk = DiskTier(str(tmp_path / "kv"), 1 << 20)
    host = host or HostTier(1 << 20)
    return TieredKVStore([host, disk], FP, caches, 4), host, disk


def _slot(store, i):
    return torch.stack([torch.stack((k[i], v[i])) for k, v in store.kv_caches])


def _load(store, refs):
    import time

    store.start_load("s", refs)
    deadline = time.monotonic() + 10
    while not (done := store.finished_loads()) and time.monotonic() < deadline:
        store.wait_for_loads(0.1)
    return done[0].num_blocks


def test_store_finds_a_prefix_split_between_disk_and_host(tmp_path):
    """A prefix's older blocks spill to disk first while its newer ones stay in host memory:
    the hit count goes block by block across the tiers, not tier by tier."""
    from pdserve.kvstore.store import BlockRef

    store, host, disk = _store(tmp_path)
    try:
        kvs = [torch.randn(SHAPE) for _ in range(4)]
        for h, kv in enumerate(kvs):
            key = codec.block_key(FP, h)
            if h < 2:
                assert disk.put(key, codec.encode(FP, h, (h,), kv))
            else:
                assert host.put(key, codec.KVBlock(FP, h, (h,), kv))
        assert store.count_hits([0, 1, 2, 3, 9]) == 4
        # the disk mirrors host memory (written through): the router is told 1 MiB of blocks, not 2
        assert store.stats()["lower_capacity_blocks"] == (1 << 20) // (store.block_bytes + 512)
        assert _load(store, [BlockRef(4 + h, h, (h,)) for h in range(4)]) == 4
        assert all(torch.equal(_slot(store, 4 + h), kvs[h]) for h in range(4))
    finally:
        store.close()


def test_a_clean_close_writes_what_only_host_memory_held_down_to_disk(tmp_path, caplog):
    """Blocks in host memory the disk does not hold (its write failed, or it evicted them since) are
    written down on a clean close, so a restarted worker loads them."""
    from pdserve.kvstore.store import BlockRef

    store, host, disk = _store(tmp_path)
    kvs = [torch.randn(SHAPE) for _ in range(4)]
    for h, kv in enumerate(kvs):
        assert host.put(codec.block_key(FP, h), codec.KVBlock(FP, h, (h,), kv))
    assert len(disk) == 0
    with caplog.at_level(logging.INFO, logger="pdserve.kvstore"):
        store.close()
    assert "4 blocks of host memory written down to disk, 0 there already, 0 not written" in caplog.text
    again, _, disk = _store(tmp_path)  # a restart: empty host memory, the same directory
    try:
        assert len(disk) == 4 and again.count_hits([0, 1, 2, 3]) == 4
        assert _load(again, [BlockRef(4 + h, h, (h,)) for h in range(4)]) == 4
        assert all(torch.equal(_slot(again, 4 + h), kvs[h]) for h in range(4))
    finally:
        again.close()


def _gated(tier_cls, gate: threading.Event, wait_s: float):
    """`tier_cls` whose writes wait for `gate` (a slow or hung backend)."""

    class Gated(tier_cls):
        def put(self, key, data):
            gate.wait(wait_s)
            return super().put(key, data)

    return Gated


def test_close_does_not_wait_for_a_disk_that_hangs(tmp_path):
    from pdserve.kvstore.store import BlockRef, TieredKVStore

    gate = threading.Event()
    HangingDisk = _gated(DiskTier, gate, 30)
    caches = [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(2)]
    store = TieredKVStore([HostTier(1 << 20), HangingDisk(str(tmp_path / "kv"), 1 << 20)], FP, caches, 4)
    store.offload([BlockRef(i, i, (i,)) for i in range(4)])
    t0 = time.monotonic()
    store.close(timeout_s=0.5)
    took = time.monotonic() - t0
    gate.set()
    store._threads[0].join(10)
    assert took < 2.5 and not store._threads[0].is_alive()


def test_store_loads_a_block_still_on_its_way_to_the_tiers(tmp_path):
    """An evicted block is a hit from the moment it leaves the pool, before the saver wrote it."""
    from pdserve.kvstore.store import BlockRef

    gate = threading.Event()
    store, host, _ = _store(tmp_path, _gated(HostTier, gate, 10)(1 << 20))
    try:
        evicted = _slot(store, 1).clone()
        store.offload([BlockRef(1, 77, (5, 6, 7, 8))])
        assert store.count_hits([77]) == 1 and len(host) == 0
        assert _load(store, [BlockRef(3, 77, (5, 6, 7, 8))]) == 1
        assert torch.equal(_slot(store, 3), evicted)
        assert _load(store, [BlockRef(3, 77, (5, 6, 7, 9))]) == 0  # same hash, other tokens: not it
    finally:
        gate.set()
        store.close()


# ---- the engine with tiers: outputs equal those of an engine that caches nothing

PROMPTS = [list(range(10 + i, 10 + i + 37)) for i in range(0, 60, 6)]  # 37 tokens: 9 full blocks of 4


def _llm(tiny_dir, **kw):
    from pdserve import LLM

    args = dict(dtype="float32", block_size=4, num_gpu_blocks=24, max_num_batched_tokens=64, max_num_seqs=4)
    args.update(kw)
    return LLM(tiny_dir, **args)


def _run(llm, prompts, max_tokens=6):
    from pdserve import SamplingParams

    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _tier(llm, name):
    return llm.engine.stats()["kv_store"]["tiers"][name]


def _wait_saved(llm):
    import time

    deadline = time.monotonic() + 10
    while llm.engine.kv_store._queued_bytes and time.monotonic() < deadline:
        time.sleep(0.01)


def test_host_tier_hits_give_the_same_tokens(sharp_model, reference):
    with _llm(sharp_model, kv_offload_bytes=8 << 20) as llm:
        # one at a time: each evicts the previous prompts' blocks from the 24-block pool
        first = [_run(llm, [p])[0] for p in PROMPTS]
        _wait_saved(llm)
        again = [_run(llm, [p])[0] for p in PROMPTS]
        assert first == reference and again == reference
        host = _tier(llm, "host")
        assert host["hits"] >= 8 * len(PROMPTS) and host["errors"] == 0, host


def test_lower_tiers_keep_salted_prefixes_apart(sharp_model, reference, tmp_path):
    """A prefix evicted to host memory and written to disk under one cache salt is a hit for
    that salt only, before and after a restart."""
    from pdserve import SamplingParams

    def run(llm, salt):
        p = {"prompt_token_ids": PROMPTS[0], "cache_salt": salt}
        out = llm.generate([p], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    kw = dict(kv_offload_bytes=8 << 20, kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=64 << 20)
    with _llm(sharp_model, **kw) as llm:
        assert run(llm, "a") == (reference[0], 0)
        for p in PROMPTS[1:]:  # evict it from the 24-block pool
            _run(llm, [p])
        _wait_saved(llm)
        hits = _tier(llm, "host")["hits"]
        assert run(llm, "b") == (reference[0], 0)
        assert _tier(llm, "host")["hits"] == hits
        assert run(llm, "a") == (reference[0], 36)
        assert _tier(llm, "host")["hits"] >= hits + 8
    with _llm(sharp_model, **kw) as llm:  # restarted: only the disk holds them
        assert run(llm, "c") == (reference[0], 0)
        assert _run(llm, [PROMPTS[0]]) == [reference[0]]  # unsalted: the disk has no such blocks
        assert _tier(llm, "disk")["hits"] == 0
        assert run(llm, "a") == (reference[0], 36)
        assert _tier(llm, "disk")["hits"] >= 8


def test_disk_tier_survives_a_restart_and_corrupt_files_are_misses(sharp_model, reference, tmp_path):
    d = str(tmp_path / "kv")
    with _llm(sharp_model, kv_disk_dir=d, kv_disk_bytes=64 << 20) as llm:
        assert [_run(llm, [p])[0] for p in PROMPTS] == reference
        _wait_saved(llm)
    files = sorted(f for f in os.listdir(d) if f.endswith(SUFFIX))
    assert len(files) >= 8 * (len(PROMPTS) - 3)
    # damage some blocks: flip a byte in one, cut another short, empty a third
    for i, f in enumerate(files[:9]):
        path = os.path.join(d, f)
        raw = bytearray(open(path, "rb").read())
        if i % 3 == 0:
            raw[len(raw) // 2] ^= 0x55
        elif i % 3 == 1:
            raw = raw[: len(raw) // 3]
        else:
            raw = b""
        open(path, "wb").write(raw)
    with _llm(sharp_model, kv_disk_dir=d, kv_disk_bytes=64 << 20) as llm:  # a restarted worker
        assert [_run(llm, [p])[0] for p in PROMPTS] == reference
        disk = _tier(llm, "disk")
        assert disk["hits"] > 0 and disk["errors"] >= 1, disk


def test_a_restart_loads_what_host_memory_held(sharp_model, reference, tmp_path):
    """Host memory large enough never to spill: blocks reach the disk only by being written
    through as they enter it (a kill would lose none), and a restarted worker loads them."""
    d = str(tmp_path / "kv")
    kw = dict(kv_offload_bytes=8 << 20, kv_disk_dir=d, kv_disk_bytes=64 << 20)
    with _llm(sharp_model, **kw) as llm:
        assert [_run(llm, [p])[0] for p in PROMPTS] == reference
        _wait_saved(llm)
        host, disk = _tier(llm, "host"), _tier(llm, "disk")
        assert host["evictions"] == 0 and disk["stores"] == host["stores"] >= 8 * (len(PROMPTS) - 3), (host, disk)
    with _llm(sharp_model, **kw) as llm:  # a restarted worker: empty pool and host memory
        assert [_run(llm, [p])[0] for p in PROMPTS] == reference
        disk = _tier(llm, "disk")
        # every prompt: those whose blocks were still in the pool were saved at the close
        assert disk["hits"] >= 8 * len(PROMPTS) and disk["errors"] == 0, disk


def test_full_disk_bound_still_serves_correctly(sharp_model, reference, tmp_path):
    block = None
    with _llm(sharp_model, kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=20_000) as llm:
        block = llm.engine.kv_store.block_bytes
        assert [_run(llm, [p])[0] for p in PROMPTS * 2] == reference * 2
        _wait_saved(llm)
        disk = _tier(llm, "disk")
        assert disk["evictions"] > 0 and llm.engine.kv_store.tiers[0].used_bytes <= 20_000
    assert block and sum(os.path.getsize(tmp_path / "kv" / f) for f in os.listdir(tmp_path / "kv")) <= 20_000


def test_preempted_sequences_come_back_from_the_tiers(sharp_model):
    """A pool too small for the batch: sequences are preempted; their blocks go down to the
    host tier and are loaded back instead of recomputed, and the tokens do not change."""
    prompts = [list(range(5 + 3 * i, 5 + 3 * i + 21)) for i in range(4)]
    ref = _run(_llm(sharp_model, enable_prefix_caching=False, num_gpu_blocks=256), prompts, max_tokens=24)
    with _llm(sharp_model, num_gpu_blocks=14, kv_offload_bytes=8 << 20) as llm:
        out = _run(llm, prompts, max_tokens=24)
        assert llm.engine.scheduler.num_preemptions > 0
        assert out == ref
        assert _tier(llm, "host")["hits"] > 0


def test_abort_while_loading_frees_the_blocks(sharp_model):
    from pdserve import SamplingParams

    with _llm(sharp_model, kv_offload_bytes=8 << 20) as llm:
        for p in PROMPTS:
            _run(llm, [p])
        _wait_saved(llm)
        eng = llm.engine
        eng.add_request("x", PROMPTS[0], SamplingParams(max_tokens=4))
        eng.step()  # admitted to load from the host tier
        assert "x" in eng.scheduler.loading
        eng.abort_request("x")
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.num_free_blocks == eng.block_manager.num_blocks


def test_tiers_need_prefix_caching(sharp_model):
    from pdserve.config import ConfigError

    with pytest.raises(ConfigError, match="prefix caching"):
        _llm(sharp_model, kv_offload_bytes=1 << 20, enable_prefix_caching=False)


def test_start_up_calibration_leaves_no_trace_in_the_tiers_or_counters(sharp_model):
    from pdserve.server import calibrate

    with _llm(sharp_model, kv_offload_bytes=8 << 20, num_gpu_blocks=64) as llm:
        eng = llm.engine
        calibrate.measure_prefill(eng, lengths_tokens=(64, 128), repeats=1)
        _wait_saved(llm)
        assert eng.num_prompt_tokens_computed == 0
        st = eng.kv_store.stats()
        assert st["queried_blocks"] == 0 and st["tiers"]["host"]["stores"] == 0
        assert _run(llm, [PROMPTS[0]])  # and the tiers work afterwards
        assert eng.block_manager.track_tiers and eng.scheduler.external is eng.kv_store


def test_host_tier_still_serves_a_block_while_it_spills():
    """Between leaving host memory and landing on disk a block must be found somewhere."""
    seen = []
    tier = None

    def spill(key, data):
        seen.append((tier.contains(key), tier.get(key) == data))

    tier = HostTier(600, spill=spill)
    assert tier.put("0-0", bytes(300)) and tier.put("1-0", bytes(300)) and tier.put("2-0", bytes(300))
    assert seen == [(True, True)] and not tier.contains("0-0")


class _SharedInMemory(KVTier):
    """A shared tier in this process's memory (the Mooncake Store's part in the store's logic)."""

    name, shared = "shared", True

    def __init__(self):
        super().__init__()
        self.objects: dict[str, bytes] = {}
        self.forgotten: list[str] = []

    def contains(self, key):
        return key in self.objects

    def get(self, key):
        return self.objects.get(key)

    def put(self, key, data):
        self.objects.setdefault(key, data)
        return True

    def forget(self, key):
        self.forgotten.append(key)
        self.objects.pop(key, None)


def test_the_shared_tier_holds_sealed_blocks_under_keyed_names():
    """What the store publishes, counts and loads through a shared tier: only sealed blocks under
    names made with the secret; a store with another secret finds none, and a block that does
    not open is removed (a put would keep it)."""
    import time

    from pdserve.kvstore.store import BlockRef, TieredKVStore

    def store(tier, secret):
        caches = [(torch.randn(8, 4, 2, 8), torch.randn(8, 4, 2, 8)) for _ in range(2)]
        return TieredKVStore([tier], FP, caches, 4, secret=secret)

    tier = _SharedInMemory()
    secret = b"0123456789abcdef-cluster"
    a = store(tier, secret)
    try:
        refs = [BlockRef(i, 100 + i, (i, i, i, i)) for i in range(3)]
        a.publish(refs)
        deadline = time.monotonic() + 10
        while len(tier.objects) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(tier.objects) == sorted(codec.shared_key(FP, 100 + i, secret) for i in range(3))
        assert a.count_hits([100, 101, 102, 999]) == 3
        sizes = {len(b) for b in tier.objects.values()}
        assert len(sizes) == 1  # padded headers: token ids of other lengths, blocks of one size
    finally:
        a.close()
    b = store(tier, secret)
    other = store(tier, b"another-cluster-0123456789")
    try:
        assert _load(b, [BlockRef(4 + i, 100 + i, (i, i, i, i)) for i in range(3)]) == 3
        assert all(torch.equal(_slot(b, 4 + i), _slot(a, i)) for i in range(3))
        assert other.count_hits([100, 101, 102]) == 0
        # a block planted under a name of the cluster's (one somebody learnt) does not open
        name = codec.shared_key(FP, 100, secret)
        tier.objects[name] = codec.seal(FP, 100, (0, 0, 0, 0), torch.zeros(b.block_shape), b"x" * 32, name)
        assert _load(b, [BlockRef(5, 100, (0, 0, 0, 0))]) == 0
        assert tier.forgotten == [name] and name not in tier.objects
    finally:
        b.close()
        other.close()
    with pytest.raises(ValueError, match="cluster secret"):
        store(_SharedInMemory(), b"")
