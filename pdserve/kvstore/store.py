"""The worker half of the KV store: moves blocks between the engine's pool and the tiers.

The engine's pool is the first tier (L1). Below it, nearest first:

- `host` (L2): evicted blocks are written here, asynchronously;
- `disk` (L3): blocks saved to the host tier are written through to it, so
  that a restart (even after a crash) finds them, and what the host tier
  drops spills here if it is not there yet (or evicted blocks go straight
  here when there is no host tier); a clean close writes down what host
  memory holds and the disk does not;
- a shared tier (Mooncake Store): every block this worker computes is
  published, so every other worker of the cluster can load it.

The engine thread only copies block data out of (or is told when data has been
copied into) its KV tensors; encoding, checksums and tier I/O run on two
background threads, one that saves and one that loads, so the engine step is
never held up by a disk or a network. The scheduler half (which sequences wait
for a load, how their blocks are allocated) lives in the scheduler; this class
answers its one question, "how many of these blocks can be loaded?", and
reports which loads have finished.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from pdserve import auth
from pdserve.kvstore import codec
from pdserve.kvstore.tier import KVTier

log = logging.getLogger("pdserve.kvstore")

# A block on its way out, queued for the saver: (block hash, its token ids, its K/V of every layer)
_Saved = tuple[int, tuple, torch.Tensor]


@dataclass
class BlockRef:
    """One block of the engine's pool, named for the tiers."""

    block_id: int
    block_hash: int
    token_ids: tuple


@dataclass
class LoadDone:
    seq_id: str
    num_blocks: int  # loaded intact, from the first; the rest (if any) is recomputed


class TieredKVStore:
    def __init__(
        self,
        tiers: list[KVTier],
        fingerprint: str,
        kv_caches: list,
        block_size: int,
        max_queued_bytes: int = 256 << 20,
        secret: bytes = b"",
    ):
        self.tiers = tiers
        self.local = [t for t in tiers if not t.shared]
        self.shared = [t for t in tiers if t.shared]
        self.fingerprint = fingerprint
        # blocks in the shared store are sealed with the cluster secret; the local tiers' files
        # are this user's alone and outlive a deployment's secret (a disk survives restarts)
        self.secret = secret
        if self.shared and len(secret) < auth.MIN_SECRET_BYTES:
            # sealing and keyed names under a key anyone can compute would hide nothing
            raise ValueError(f"a shared KV store needs the cluster secret (at least {auth.MIN_SECRET_BYTES} bytes)")
        self.kv_caches = kv_caches
        self.block_size = block_size
        k0 = kv_caches[0][0]
        self.block_shape = [len(kv_caches), 2, *k0.shape[1:]]  # [layers, K/V, block_size, heads, dim]
        self.dtype = k0.dtype
        self.block_bytes = k0[0].numel() * k0.element_size() * 2 * len(kv_caches)
        self.max_queued_bytes = max_queued_bytes
        self.dropped_saves = 0  # blocks not saved because the saver fell behind
        self._published: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._save_q: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._queued_lock = threading.Lock()
        # evicted blocks queued for the local tiers, by key, until the saver has written them:
        # a request that needs one before then loads it from here instead of recomputing it
        self._unsaved: dict[str, tuple[int, tuple, torch.Tensor]] = {}
        self.queried_blocks = 0  # blocks the scheduler asked about (beyond its own pool's hits)
        self.hit_blocks = 0  # of those, held by some tier
        self._load_q: queue.Queue = queue.Queue()
        self._done: list[LoadDone] = []
        self._done_lock = threading.Lock()
        self._done_event = threading.Event()
        self.pending_loads = 0
        # the first local tier below the nearest one that outlives the process: blocks saved to the
        # nearest are written through to it
        self._through = next((t for t in self.local[1:] if t.persistent), None)
        self._closed = False
        self._close_by = float("inf")  # past this, the saver writes nothing more
        self._threads = [
            threading.Thread(target=self._saver, name="kvstore-save", daemon=True),
            threading.Thread(target=self._loader, name="kvstore-load", daemon=True),
        ]
        for t in self._threads:
            t.start()
        log.info(
            "KV store tiers: %s (model fingerprint %s, %d KB a block)",
            ", ".join(t.name for t in tiers),
            fingerprint,
            self.block_bytes // 1024,
        )

    # ---- the scheduler's question
    def count_hits(self, hashes: list[int]) -> int:
        """How many of these blocks, from the first, some tier holds."""
        keys = [codec.block_key(self.fingerprint, h) for h in hashes]
        n = 0
        # block by block across the local tiers: a prefix's older blocks may have spilled to disk
        # while its newer ones are still in host memory, or still on their way to either
        while n < len(keys) and (keys[n] in self._unsaved or any(t.contains(keys[n]) for t in self.local)):
            n += 1
        for tier in self.shared:  # never waits on the network: the engine thread asks
            if n < len(keys):
                n += tier.count_prefix_now([codec.shared_key(self.fingerprint, h, self.secret) for h in hashes[n:]])
        self.queried_blocks += len(keys)
        self.hit_blocks += n
        return n

    # ---- saving (engine thread: copy out; saver thread: encode and write)
    def _gather(self, blocks: list[BlockRef]) -> torch.Tensor:
        """[n, layers, 2, block_size, heads, dim]: a copy, so the pool may reuse the blocks."""
        # the ids where the cache lives: CUDA's index_select takes no host indices
        idx = torch.tensor([b.block_id for b in blocks], dtype=torch.long, device=self.kv_caches[0][0].device)
        per_layer = [
            torch.stack((k.index_select(0, idx), v.index_select(0, idx)), dim=1) for k, v in self.kv_caches
        ]  # each [n, 2, bs, heads, dim]
        return torch.stack(per_layer, dim=1).cpu()

    def _enqueue(self, blocks: list[BlockRef], where: str) -> None:
        room = (self.max_queued_bytes - self._queued_bytes) // self.block_bytes
        if room < len(blocks):  # the tiers are slower than the pool churns: what does not fit is not kept
            self.dropped_saves += len(blocks) - max(room, 0)
            blocks = blocks[: max(room, 0)]
        if not blocks:
            return
        data = self._gather(blocks)
        saved = [(b.block_hash, b.token_ids, data[i]) for i, b in enumerate(blocks)]
        with self._queued_lock:
            self._queued_bytes += len(blocks) * self.block_bytes
            if where == "local":
                for item in saved:
                    self._unsaved[codec.block_key(self.fingerprint, item[0])] = item
        self._save_q.put((where, saved))

    def offload(self, evicted: list[BlockRef]) -> None:
        """Blocks the pool just evicted (their data is still intact): keep them in the local tiers."""
        if evicted and self.local:
            self._enqueue(evicted, "local")

    def save_all(self, blocks: list[BlockRef], timeout_s: float = 5.0) -> int:
        """Before a close: keep in the local tiers every block of `blocks` (in that order) none
        of them holds, queueing as fast as the saver drains, until `timeout_s`. The number queued."""
        if not self.local:
            return 0
        held = lambda b: any(t.contains(codec.block_key(self.fingerprint, b.block_hash)) for t in self.local)
        todo = [b for b in blocks if not held(b)]
        deadline, queued = time.monotonic() + timeout_s, 0
        while todo and time.monotonic() < deadline:
            room = (self.max_queued_bytes - self._queued_bytes) // self.block_bytes
            if room <= 0:
                time.sleep(0.01)
                continue
            self._enqueue(todo[:room], "local")
            queued += len(todo[:room])
            todo = todo[room:]
        return queued

    def publish(self, computed: list[BlockRef]) -> None:
        """Blocks this worker just computed: put them where every worker can load them."""
        if not self.shared:
            return
        fresh = [b for b in computed if b.block_hash not in self._published]
        for b in fresh:
            self._published[b.block_hash] = None
        while len(self._published) > 1 << 16:
            self._published.popitem(last=False)
        if fresh:
            self._enqueue(fresh, "shared")

    def _saver(self) -> None:
        while (item := self._save_q.get()) is not None:
            where, blocks = item
            for block_hash, token_ids, kv in blocks:
                key = codec.block_key(self.fingerprint, block_hash)
                try:
                    if time.monotonic() < self._close_by:
                        self._save(where, key, block_hash, token_ids, kv)
                except Exception:  # a tier must never take the engine down
                    log.exception("KV store: saving a block failed")
                finally:
                    with self._queued_lock:
                        self._queued_bytes -= self.block_bytes
                        if where == "local":
                            self._unsaved.pop(key, None)
        self._write_down()

    def _save(self, where: str, key: str, block_hash: int, token_ids: tuple, kv: torch.Tensor) -> None:
        if where == "shared":  # sealed with the cluster secret, under a name only the cluster can compute
            name = codec.shared_key(self.fingerprint, block_hash, self.secret)
            blob = codec.seal(self.fingerprint, block_hash, token_ids, kv, self.secret, name)
            for tier in self.shared:
                tier.put(name, blob)
            return
        tiers = self.local[:1]
        blob = None
        for tier in tiers:
            if tier.holds_blocks:  # in-process: kept decoded, its own copy of the data
                tier.put(key, codec.KVBlock(self.fingerprint, block_hash, tuple(token_ids), kv.clone()))
                continue
            if blob is None:
                blob = codec.encode(self.fingerprint, block_hash, token_ids, kv)
            tier.put(key, blob)
        # written through: the disk holds what host memory holds (a kill loses nothing saved), and the
        # host tier's spill finds the block there and writes nothing: in steady state the same writes
        if where == "local" and self._through is not None and not self._through.touch(key):
            self._through.put(key, blob or codec.encode(self.fingerprint, block_hash, token_ids, kv))

    def _write_down(self) -> None:
        """On a clean close: what host memory holds and the disk does not (a write that failed, a
        block the disk evicted since), written down to it, oldest first, until the close deadline."""
        if self._through is None:
            return
        held = self.local[0].blocks()
        written = there = 0
        for key, data in held:
            if time.monotonic() >= self._close_by:
                break
            if self._through.touch(key):
                there += 1
            elif self._through.put(key, data.to_bytes() if isinstance(data, codec.KVBlock) else data):
                written += 1
            elif not self._through.healthy():  # the disk refuses writes: the rest would fail too
                break
        if held:
            log.info(
                "KV store: closing: %d blocks of host memory written down to disk, %d there already, %d not written",
                written,
                there,
                len(held) - written - there,
            )

    # ---- loading (engine thread: start and poll; loader thread: read, check, copy in)
    def start_load(self, seq_id: str, blocks: list[BlockRef]) -> None:
        """Load these blocks into the pool slots they name (the sequence owns them already)."""
        self.pending_loads += 1
        self._load_q.put((seq_id, blocks))

    def finished_loads(self) -> list[LoadDone]:
        with self._done_lock:
            out, self._done = self._done, []
            self._done_event.clear()
        self.pending_loads -= len(out)
        return out

    def wait_for_loads(self, timeout_s: float) -> None:
        self._done_event.wait(timeout_s)

    def _loader(self) -> None:
        while True:
            item = self._load_q.get()
            if item is None:
                return
            seq_id, blocks = item
            n = 0
            try:
                n = self._load(blocks)
            except Exception:
                log.exception("KV store: loading a block failed")
            with self._done_lock:
                self._done.append(LoadDone(seq_id, n))
                self._done_event.set()

    def _load(self, blocks: list[BlockRef]) -> int:
        """Fetch and check the blocks from the first until one is missing, then copy them into
        their pool slots in one pass per layer; the number copied in."""
        found: list[torch.Tensor] = []
        from_tier: list[KVTier] = []
        for b in blocks:
            got = self._fetch(b)
            if got is None:
                break
            found.append(got[0])
            from_tier.append(got[1])
        if not found:
            return 0
        t0 = time.monotonic()
        device = self.kv_caches[0][0].device
        data = torch.stack(found).to(device)  # [n, layers, 2, block_size, heads, dim]
        idx = torch.tensor([b.block_id for b in blocks[: len(found)]], dtype=torch.long, device=device)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(0, idx, data[:, layer, 0])
            v.index_copy_(0, idx, data[:, layer, 1])
        per_block = (time.monotonic() - t0) / len(found)
        for tier in from_tier:
            with tier.lock:
                tier.stats.load_seconds += per_block
        return len(found)

    def _fetch(self, b: BlockRef) -> tuple[torch.Tensor, KVTier] | None:
        """The block's data from the nearest tier that holds it intact, and that tier."""
        key = codec.block_key(self.fingerprint, b.block_hash)
        with self._queued_lock:
            unsaved = self._unsaved.get(key)
        if unsaved is not None and unsaved[0] == b.block_hash and tuple(unsaved[1]) == tuple(b.token_ids):
            tier = self.local[0]  # evicted moments ago, not yet written: counted as a hit of the tier it goes to
            with tier.lock:
                tier.stats.hits += 1
                tier.stats.loads += 1
            return unsaved[2], tier
        for tier in self.tiers:
            if tier.shared and not tier.healthy():
                continue
            t0 = time.monotonic()
            name = codec.shared_key(self.fingerprint, b.block_hash, self.secret) if tier.shared else key
            blob = tier.get(name)
            if blob is None:
                with tier.lock:
                    tier.stats.misses += 1
                continue
            try:
                if isinstance(blob, codec.KVBlock):
                    kv = blob.check(self.fingerprint, b.block_hash, b.token_ids, self.block_shape, self.dtype)
                elif tier.shared:
                    kv = codec.unseal(
                        blob,
                        self.fingerprint,
                        b.block_hash,
                        b.token_ids,
                        self.block_shape,
                        self.dtype,
                        self.secret,
                        name,
                    )
                else:
                    kv = codec.decode(blob, self.fingerprint, b.block_hash, b.token_ids, self.block_shape, self.dtype)
            except codec.BadBlock as e:
                log.warning("KV store: %s tier: %s (%s); recomputing instead", tier.name, e, name)
                with tier.lock:
                    tier.stats.errors += 1
                    tier.stats.misses += 1
                forget = getattr(tier, "forget", None)
                if forget is not None:
                    forget(name)
                continue
            with tier.lock:
                tier.stats.hits += 1
                tier.stats.loads += 1
                tier.stats.load_seconds += time.monotonic() - t0
            return kv, tier
        return None

    # ---- introspection and shutdown
    def stats(self) -> dict:
        return {
            "tiers": {t.name: {**t.stats.as_dict(), "healthy": t.healthy()} for t in self.tiers},
            "queried_blocks": self.queried_blocks,
            "hit_blocks": self.hit_blocks,
            "dropped_saves": self.dropped_saves,
            "pending_loads": self.pending_loads,
            # for the router's prefix index: how many blocks the local tiers hold at most (a disk
            # that host memory writes through to mirrors it: the larger of the two, not the sum)
            "lower_capacity_blocks": (max if self._through is not None else sum)(
                [getattr(t, "capacity_bytes", 0) for t in self.local] or [0]
            )
            // max(1, self.block_bytes + 512),
            "shared": bool(self.shared),
        }

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the threads. The saver first writes what is queued, then what host memory holds
        and the disk does not down to disk, so a restart finds it; all within `timeout_s`."""
        if self._closed:
            return
        self._closed = True
        self._close_by = time.monotonic() + timeout_s
        self._save_q.put(None)
        self._load_q.put(None)
        for t in self._threads:
            t.join(timeout=max(0.1, self._close_by + 1.0 - time.monotonic()))
        if self._threads[0].is_alive():  # a write that hangs (a dead network disk): not our wait
            log.warning("KV store: closing: the saver is still writing after %.0f s; left behind", timeout_s)
        for tier in self.tiers:
            tier.close()
