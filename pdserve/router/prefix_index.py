"""The router's global prefix index: which KV blocks each worker has cached.

Workers publish KV events (block stored / evicted / cache cleared, by chained
block hash, see pdserve/kv/hashing.py) numbered 1, 2, 3, ... within an
`epoch` that a worker picks afresh each time it starts. Because hashes chain,
a worker holding block i's hash holds the whole prefix up to block i, so the
cached share of a prompt is the count of its leading hashes the worker holds.

An epoch starts with an empty cache (a worker picks a new one whenever it
starts), so a worker seen from its event 1 on is known exactly. The index trusts
a worker's set only while it has seen every event since then or since the last
snapshot. A gap in the numbers (lost heartbeats, a router that restarted while
the worker lived on) marks the worker unsynced: it then counts as holding
nothing (placement falls back to load) until it sends a full snapshot, which
the router asks for in its heartbeat reply (`needs_snapshot`).

Below a worker's pool there may be KV tiers (pdserve/kvstore). The index
follows them from the same events, without more traffic: a worker with local
tiers (host memory, disk) writes what its pool evicts down to them, so an
"evicted" block moves to that worker's lower set (bounded by the tiers'
capacity in blocks, least recent out); a worker with the shared store
publishes what it computes, so a "stored" block joins the cluster-wide store
set, which every worker can load from. Both sets are estimates (a tier drops
blocks without telling), priced as such: a lower-tier block costs its load,
and a wrong guess costs only a recompute.

Wire format, JSON only (ints are the 64-bit hashes):
  events:   {"epoch": str, "events": [{"seq": int, "kind": "stored"|"evicted"|"cleared",
                                      "block_hashes": [int, ...]}, ...]}
  snapshot: {"epoch": str, "seq": int (last event it includes), "block_hashes": [int, ...]}
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field


@dataclass
class _WorkerCache:
    epoch: str = ""
    next_seq: int = 1
    synced: bool = False
    hashes: set[int] = field(default_factory=set)
    num_gaps: int = 0
    lower: OrderedDict = field(default_factory=OrderedDict)  # blocks in its own lower tiers (estimate)
    lower_capacity: int = 0  # how many blocks those tiers hold at most
    shares: bool = False  # it publishes what it computes to the shared store


STORE_CAPACITY_BLOCKS = 1 << 20  # bound on the router's estimate of the shared store's contents


class PrefixIndex:
    """Per worker, the set of cached block hashes; thread-safe."""

    def __init__(self):
        self._workers: dict[str, _WorkerCache] = {}
        self._store: OrderedDict[int, None] = OrderedDict()  # blocks in the shared store (estimate)
        self.store_capacity = STORE_CAPACITY_BLOCKS
        self._lock = threading.Lock()

    def set_tiers(self, worker_id: str, lower_capacity_blocks: int, shares: bool) -> None:
        """What a worker's heartbeat says of its tiers (its KV store's capacity, whether it shares)."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None:
                return
            w.lower_capacity, w.shares = max(0, int(lower_capacity_blocks)), bool(shares)
            while len(w.lower) > w.lower_capacity:
                w.lower.popitem(last=False)

    # ---- updates from workers
    def apply_events(self, worker_id: str, epoch: str, events: Iterable[dict]) -> bool:
        """Apply numbered events in order. Returns False when the worker is (now)
        unsynced and must send a snapshot."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or w.epoch != epoch:  # new or restarted: expect event 1 of an empty cache
                old = w
                w = self._workers[worker_id] = _WorkerCache(epoch=epoch, synced=True)
                if old is not None:  # a restart empties the pool, not the disk: keep the estimate
                    w.lower, w.lower_capacity, w.shares = old.lower, old.lower_capacity, old.shares
            for ev in events:
                seq = int(ev["seq"])
                if seq < w.next_seq:  # already covered by a snapshot or a resent batch
                    continue
                if not w.synced:
                    continue  # nothing to apply to until the snapshot arrives
                if seq > w.next_seq:  # events were lost (a failed heartbeat, say)
                    w.num_gaps += 1
                    self._unsync(w)
                    continue
                self._apply_one(w, ev["kind"], ev.get("block_hashes") or [])
                self._follow_tiers(w, ev["kind"], ev.get("block_hashes") or [])
                w.next_seq = seq + 1
            return w.synced

    def apply_snapshot(self, worker_id: str, epoch: str, seq: int, block_hashes: Iterable[int]) -> None:
        """Replace a worker's set with everything it caches as of event `seq`."""
        with self._lock:
            old = self._workers.get(worker_id)
            w = self._workers[worker_id] = _WorkerCache(
                epoch=epoch,
                next_seq=int(seq) + 1,
                synced=True,
                hashes=set(int(h) for h in block_hashes),
                num_gaps=old.num_gaps if old else 0,
            )
            if old is not None:
                w.lower, w.lower_capacity, w.shares = old.lower, old.lower_capacity, old.shares

    def remove(self, worker_id: str) -> None:
        with self._lock:
            self._workers.pop(worker_id, None)

    # ---- queries
    def needs_snapshot(self, worker_id: str) -> bool:
        with self._lock:
            w = self._workers.get(worker_id)
            return w is None or not w.synced

    def hit_blocks(self, worker_id: str, request_block_hashes: Sequence[int]) -> int:
        """How many leading blocks of the request this worker holds (0 if unsynced)."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or not w.synced:
                return 0
            n = 0
            for h in request_block_hashes:
                if h not in w.hashes:
                    break
                n += 1
            return n

    def lower_hit_blocks(self, worker_id: str, request_block_hashes: Sequence[int], start: int) -> int:
        """How many blocks from `start` on this worker can load from a lower tier: its own host or
        disk tier, or the shared store (0 for a worker that has none)."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or not (w.lower_capacity or w.shares):
                return 0
            n = 0
            for h in request_block_hashes[start:]:
                if not (h in w.lower or (w.shares and h in self._store)):
                    break
                n += 1
            return n

    def hit_ratio(
        self, worker_id: str, request_block_hashes: Sequence[int], block_size: int, prompt_tokens: int
    ) -> float:
        """H_i of the placement score: the cached share of the prompt on this worker."""
        if prompt_tokens <= 0:
            return 0.0
        cached_tokens = self.hit_blocks(worker_id, request_block_hashes) * block_size
        return min(1.0, cached_tokens / prompt_tokens)

    def stats(self) -> dict[str, dict]:
        with self._lock:
            return {
                wid: {
                    "epoch": w.epoch,
                    "synced": w.synced,
                    "num_blocks": len(w.hashes),
                    "next_seq": w.next_seq,
                    "num_gaps": w.num_gaps,
                    "num_lower_blocks": len(w.lower),
                    "shares": w.shares,
                }
                for wid, w in self._workers.items()
            }

    # ---- internals
    def _follow_tiers(self, w: _WorkerCache, kind: str, hashes: list[int]) -> None:
        if kind == "evicted" and w.lower_capacity:
            for h in hashes:
                w.lower[int(h)] = None
                w.lower.move_to_end(int(h))
            while len(w.lower) > w.lower_capacity:
                w.lower.popitem(last=False)
        elif kind == "stored" and w.shares:
            for h in hashes:
                self._store[int(h)] = None
                self._store.move_to_end(int(h))
            while len(self._store) > self.store_capacity:
                self._store.popitem(last=False)

    @staticmethod
    def _unsync(w: _WorkerCache) -> None:
        w.synced, w.next_seq = False, 1
        w.hashes.clear()

    @staticmethod
    def _apply_one(w: _WorkerCache, kind: str, hashes: list[int]) -> None:
        if kind == "stored":
            w.hashes.update(int(h) for h in hashes)
        elif kind == "evicted":
            w.hashes.difference_update(int(h) for h in hashes)
        elif kind == "cleared":
            # The block manager keeps blocks still in use; forgetting them all
            # only under-counts hits until they are stored again.
            w.hashes.clear()
        else:
            raise ValueError(f"unknown KV event kind {kind!r}")
