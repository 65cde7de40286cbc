"""Placement decisions as pure functions of (candidates, request, load).

The router calls these; the simulator will call the very same ones. The
conductor's cache-aware score (router/conductor.py's `prefill_score`) joins them here.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

# prefill placement policies the router offers (`--policy`); decode is always by KV headroom
POLICIES = ("least_loaded", "round_robin", "cache_aware", "consistent_hash")


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use


def least_loaded(cands: Sequence[Candidate]) -> Candidate:
    """Fewest queued-then-running requests, then the most free KV."""
    return min(cands, key=lambda c: (c.num_waiting, c.num_running, c.kv_usage, c.worker_id))


def most_kv_headroom(cands: Sequence[Candidate]) -> Candidate:
    """For decode: the instance with the most free KV blocks, then the fewest running."""
    return min(cands, key=lambda c: (c.kv_usage, c.num_running, c.worker_id))


class RoundRobin:
    """Stateful only in its counter; the choice is a function of it and the candidates."""

    def __init__(self):
        self._n = itertools.count()

    def __call__(self, cands: Sequence[Candidate]) -> Candidate:
        ordered = sorted(cands, key=lambda c: c.worker_id)
        return ordered[next(self._n) % len(ordered)]


def _ring_point(key: bytes) -> int:
    # blake2b, not Python's salted hash: every router process must build the same ring
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


def consistent_hash(key: int, worker_ids: Sequence[str], vnodes: int = 64) -> str:
    """The worker owning `key` on a hash ring: requests sharing a
    prefix go to one worker, and a worker joining or leaving moves only ~1/N keys.
    `vnodes` points per worker even out the arcs."""
    if not worker_ids:
        raise ValueError("no workers")
    ring = sorted((_ring_point(f"{w}#{i}".encode()), w) for w in worker_ids for i in range(vnodes))
    point = _ring_point(key.to_bytes(8, "little"))
    i = bisect.bisect_left(ring, (point, ""))
    return ring[i % len(ring)][1]
