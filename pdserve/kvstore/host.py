"""L2: a bounded pool of this worker's host memory, least recently used first out.

Blocks the pool drops to stay within its bound are handed to `spill` (the disk
tier below, when there is one), so a block leaves the worker only when every
tier under it is full too.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pdserve.kvstore.tier import KVTier


class HostTier(KVTier):
    name = "host"

    def __init__(self, capacity_bytes: int, spill: Callable[[str, bytes], object] | None = None):
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError("the host tier needs a positive capacity")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.spill = spill
        self._blocks: OrderedDict[str, bytes] = OrderedDict()

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self._blocks

    def get(self, key: str) -> bytes | None:
        with self.lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
                self.stats.bytes_out += len(data)
            return data

    def put(self, key: str, data: bytes) -> bool:
        if len(data) > self.capacity_bytes:
            with self.lock:
                self.stats.errors += 1
            return False
        dropped = []
        with self.lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            while self.used_bytes + len(data) > self.capacity_bytes:
                old_key, old = self._blocks.popitem(last=False)
                self.used_bytes -= len(old)
                self.stats.evictions += 1
                dropped.append((old_key, old))
            self._blocks[key] = data
            self.used_bytes += len(data)
            self.stats.bytes_in += len(data)
            self.stats.stores += 1
        if self.spill is not None:
            for old_key, old in dropped:  # outside the lock: the disk is slow
                self.spill(old_key, old)
        return True

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        with self.lock:
            self._blocks.clear()
            self.used_bytes = 0
