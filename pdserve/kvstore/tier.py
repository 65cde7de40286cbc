"""A tier of the KV store: somewhere below a worker's block pool that holds KV blocks.

Tiers store opaque byte strings under string keys. What a block's bytes mean,
and whether they can be trusted, is the codec's business (`kvstore/codec.py`):
a tier never interprets them. A tier may drop anything at any time (it is a
cache); `get` returning None is a miss, never an error the caller must handle.

The tiers, nearest first: `host` (a bounded pool of this process's DRAM),
`disk` (a bounded local directory that survives a restart) and `mooncake`
(Mooncake Store, shared by every worker of the cluster).
"""

from __future__ import annotations

import abc
import threading
from dataclasses import dataclass, fields


@dataclass
class TierStats:
    """Counters of one tier; read by the metrics endpoint, bumped by the tier and the KV store."""

    hits: int = 0  # blocks found and loaded
    misses: int = 0  # blocks looked for and not there (a corrupt or foreign block counts here too)
    bytes_in: int = 0  # written to the tier
    bytes_out: int = 0  # read from the tier
    stores: int = 0  # blocks written
    evictions: int = 0  # blocks the tier dropped to stay within its bound
    errors: int = 0  # failed calls, corrupt or foreign blocks, refused writes
    load_seconds: float = 0.0  # time spent in get(), summed
    loads: int = 0  # get() calls timed in load_seconds

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KVTier(abc.ABC):
    """One tier. Methods may be called from several threads; implementations lock."""

    name: str = ""
    shared: bool = False  # True when every worker of the cluster sees the same blocks
    holds_blocks: bool = False  # True when put/get take decoded `codec.KVBlock`s (in-process tiers)
    persistent: bool = False  # True when its blocks outlive the process (a restart finds them)

    def __init__(self) -> None:
        self.stats = TierStats()
        self.lock = threading.Lock()

    @abc.abstractmethod
    def contains(self, key: str) -> bool:
        """Whether `get(key)` would find the block now (it may be gone by then)."""

    @abc.abstractmethod
    def get(self, key: str) -> bytes | None:
        """The bytes stored under `key`, or None. Never raises for a miss or a dead backend."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> bool:
        """Store `data` under `key` (replacing nothing if it is there); False if refused."""

    def touch(self, key: str) -> bool:
        """Whether the tier holds `key`, which then counts as just used (the last to be evicted)."""
        return self.contains(key)

    def count_prefix(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, the tier holds in a row."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    def count_prefix_now(self, keys: list[str]) -> int:
        """`count_prefix` for the engine thread, which every running stream waits on: a tier
        behind a network answers at once, from what it knows, or not at all (0)."""
        return self.count_prefix(keys) if self.healthy() else 0

    def healthy(self) -> bool:
        """False while the backend is unreachable (the shared store's master is down) or refuses
        writes (the disk is full)."""
        return True

    def close(self) -> None:  # noqa: B027 - optional: most tiers have nothing to release
        """Release what the tier holds in memory; a disk tier keeps its files."""
