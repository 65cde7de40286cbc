"""The simulated clock: a heap of timed callbacks, run in time order.

Ties run in the order they were scheduled (a counter breaks them), so a run
is deterministic. Nothing here knows about requests or instances.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """`at(t, fn, *args)` schedules; `run()` pops events until none are left."""

    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._count = itertools.count()
        self.num_events = 0

    def at(self, t_s: float, fn: Callable, *args) -> None:
        if t_s < self.now:
            raise ValueError(f"cannot schedule into the past ({t_s} < {self.now})")
        heapq.heappush(self._heap, (t_s, next(self._count), fn, args))

    def after(self, delay_s: float, fn: Callable, *args) -> None:
        self.at(self.now + delay_s, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until_s: float | None = None) -> float:
        """Run events in time order; stop when none are left (or past `until_s`). Returns the clock."""
        heap = self._heap
        while heap:
            if until_s is not None and heap[0][0] > until_s:
                self.now = until_s
                break
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.num_events += 1
            fn(*args)
        return self.now
