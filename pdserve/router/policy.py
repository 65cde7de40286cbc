"""Placement decisions as pure functions of (candidates, request, load).

The router calls these; the simulator will call the very same ones. The
conductor's cache-aware score (seed 000 §5.1) joins them here.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence


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
