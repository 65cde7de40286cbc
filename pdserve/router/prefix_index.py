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

Wire format, JSON only (ints are the 64-bit hashes):
  events:   {"epoch": str, "events": [{"seq": int, "kind": "stored"|"evicted"|"cleared",
                                      "block_hashes": [int, ...]}, ...]}
  snapshot: {"epoch": str, "seq": int (last event it includes), "block_hashes": [int, ...]}
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Iterable, Sequence


@dataclass
class _WorkerCache:
    epoch: str = ""
    next_seq: int = 1
    synced: bool = False
    hashes: set[int] = field(default_factory=set)
    num_gaps: int = 0


class PrefixIndex:
    """Per worker, the set of cached block hashes; thread-safe."""

    def __init__(self):
        self._workers: dict[str, _WorkerCache] = {}
        self._lock = threading.Lock()

    # ---- updates from workers
    def apply_events(self, worker_id: str, epoch: str, events: Iterable[dict]) -> bool:
        """Apply numbered events in order. Returns False when the worker is (now)
        unsynced and must send a snapshot."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None or w.epoch != epoch:  # new or restarted: expect event 1 of an empty cache
                w = self._workers[worker_id] = _WorkerCache(epoch=epoch, synced=True)
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
                w.next_seq = seq + 1
            return w.synced

    def apply_snapshot(self, worker_id: str, epoch: str, seq: int, block_hashes: Iterable[int]) -> None:
        """Replace a worker's set with everything it caches as of event `seq`."""
        with self._lock:
            old = self._workers.get(worker_id)
            self._workers[worker_id] = _WorkerCache(epoch=epoch, next_seq=int(seq) + 1, synced=True,
                                                    hashes=set(int(h) for h in block_hashes),
                                                    num_gaps=old.num_gaps if old else 0)

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

    def hit_ratio(self, worker_id: str, request_block_hashes: Sequence[int], block_size: int,
                  prompt_tokens: int) -> float:
        """H_i of the placement score: the cached share of the prompt on this worker."""
        if prompt_tokens <= 0:
            return 0.0
        cached_tokens = self.hit_blocks(worker_id, request_block_hashes) * block_size
        return min(1.0, cached_tokens / prompt_tokens)

    def stats(self) -> dict[str, dict]:
        with self._lock:
            return {wid: {"epoch": w.epoch, "synced": w.synced, "num_blocks": len(w.hashes),
                          "next_seq": w.next_seq, "num_gaps": w.num_gaps}
                    for wid, w in self._workers.items()}

    # ---- internals
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
