"""L2: a bounded pool of this worker's host memory, least recently used first out.

It holds blocks decoded (`codec.KVBlock`: the tensor and what names it), since
nothing outside this process can touch them: a save is one copy out of the pool
and a load one copy back, with no encoding and no checksum. Blocks the pool drops
to stay within its bound are handed to `spill` (the disk tier below, when there
is one, which encodes them, or only marks them recently used where the store
already wrote them through to it), so a block leaves the worker only when every
tier under it is full too. Byte strings are kept as they are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from pdserve.kvstore.codec import KVBlock
from pdserve.kvstore.tier import KVTier


def _size(data: bytes | KVBlock) -> int:
    return data.nbytes if isinstance(data, KVBlock) else len(data)


class HostTier(KVTier):
    name = "host"
    holds_blocks = True

    def __init__(self, capacity_bytes: int, spill: Callable[[str, bytes | KVBlock], object] | None = None):
        super().__init__()
        if capacity_bytes <= 0:
            raise ValueError("the host tier needs a positive capacity")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.spill = spill
        self._blocks: OrderedDict[str, bytes | KVBlock] = OrderedDict()
        # dropped, and on their way to `spill`: still found here until the tier below has them,
        # so a block is never in neither tier for the time a disk write takes
        self._spilling: dict[str, bytes | KVBlock] = {}

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self._blocks or key in self._spilling

    def get(self, key: str) -> bytes | KVBlock | None:
        with self.lock:
            data = self._blocks.get(key)
            if data is not None:
                self._blocks.move_to_end(key)
            else:
                data = self._spilling.get(key)
            if data is not None:
                self.stats.bytes_out += _size(data)
            return data

    def put(self, key: str, data: bytes | KVBlock) -> bool:
        size = _size(data)
        if size > self.capacity_bytes:
            with self.lock:
                self.stats.errors += 1
            return False
        dropped = []
        with self.lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return True
            while self.used_bytes + size > self.capacity_bytes:
                old_key, old = self._blocks.popitem(last=False)
                self.used_bytes -= _size(old)
                self.stats.evictions += 1
                dropped.append((old_key, old))
                if self.spill is not None:
                    self._spilling[old_key] = old
            self._blocks[key] = data
            self.used_bytes += size
            self.stats.bytes_in += size
            self.stats.stores += 1
        if self.spill is not None:
            for old_key, old in dropped:  # outside the lock: the disk is slow
                try:
                    self.spill(old_key, old)
                finally:
                    with self.lock:
                        self._spilling.pop(old_key, None)
        return True

    def blocks(self) -> list[tuple[str, bytes | KVBlock]]:
        """What the tier holds now, least recently used first."""
        with self.lock:
            return list(self._blocks.items())

    def __len__(self) -> int:
        return len(self._blocks)

    def close(self) -> None:
        with self.lock:
            self._blocks.clear()
            self._spilling.clear()
            self.used_bytes = 0
