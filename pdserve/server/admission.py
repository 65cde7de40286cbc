"""Admission control as pure functions, so the worker's server, the router and the
simulator refuse work by the same rule."""

from __future__ import annotations

import math
from collections import deque


def admit(num_waiting: int, max_waiting: int) -> bool:
    """Admit while fewer than `max_waiting` requests wait to start generating.

    A bounded queue keeps queueing delay bounded: past it, a client is better
    served by a prompt 429 than by a TTFT it cannot use.
    """
    return num_waiting < max_waiting


def retry_after_s(num_waiting: int, start_rate_per_s: float, *, floor_s: int = 1, ceil_s: int = 60) -> int:
    """Seconds until the current queue has probably drained, for `Retry-After`.

    `start_rate_per_s` is how fast waiting requests have recently started; with
    no history yet, fall back to the floor rather than guess a large number.
    """
    if start_rate_per_s <= 0:
        return floor_s
    return int(min(ceil_s, max(floor_s, math.ceil(num_waiting / start_rate_per_s))))


class RateMeter:
    """Events per second over the last `window_s` seconds (a sliding window)."""

    def __init__(self, window_s: float = 10.0):
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._count = 0

    def add(self, now_s: float, count: int = 1) -> None:
        self._events.append((now_s, count))
        self._count += count
        self._expire(now_s)

    def rate_per_s(self, now_s: float) -> float:
        self._expire(now_s)
        return self._count / self.window_s

    def _expire(self, now_s: float) -> None:
        while self._events and self._events[0][0] <= now_s - self.window_s:
            self._count -= self._events.popleft()[1]
