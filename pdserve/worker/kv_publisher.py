"""A worker's side of the router's prefix index (pdserve/router/prefix_index.py).

Each heartbeat carries the KV events drained from the block manager since the
last one, numbered 1, 2, 3, ... within this process's `epoch` (a fresh random
id per start, whose cache starts empty). Events lost with a failed heartbeat
leave a gap the router notices; it then answers `"kv_snapshot": true` and the
next heartbeat carries every cached hash. JSON only.
"""

from __future__ import annotations

import uuid


class KVEventPublisher:
    def __init__(self, epoch: str | None = None):
        self.epoch = epoch or uuid.uuid4().hex
        self.seq = 0  # number of the last event handed out
        self.want_snapshot = False  # set from the router's heartbeat reply

    def payload(self, events, cached_hashes: list[int] | None = None) -> dict:
        """Number `events` (KVEvent) and, with `cached_hashes`, add a snapshot as of the last of them."""
        out = []
        for e in events:
            self.seq += 1
            out.append({"seq": self.seq, "kind": e.kind, "block_hashes": list(e.block_hashes)})
        body = {"epoch": self.epoch, "events": out}
        if cached_hashes is not None:
            body["snapshot"] = {"seq": self.seq, "block_hashes": list(cached_hashes)}
        return body
