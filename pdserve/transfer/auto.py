"""The KV sender a prefill worker uses: per destination, shared memory when the receiver's
cache files are visible from here, NIXL for a nixl:// receiver (when NIXL is importable),
a pull for a receiver that fetches, TCP otherwise."""

from __future__ import annotations

import logging
import os
import time

from pdserve.kv.shm_files import KVFileRefused
from pdserve.transfer import wire
from pdserve.transfer.connector import KVDestination, KVSender, KVTransferError
from pdserve.transfer.nixl import NixlKVSender, nixl_available
from pdserve.transfer.sender import ShmKVSender, TcpKVSender

log = logging.getLogger("pdserve.transfer")


SHM_REFUSAL_S = 60.0  # a destination refused for shared memory goes over TCP this long without a retry
SHM_REFUSALS_KEPT = 1024


class AutoKVSender(KVSender):
    """Shared memory when the destination's cache files are visible from here, TCP otherwise."""

    def __init__(
        self,
        wire_mode: str = "none",
        allow_shm: bool = True,
        retry_window_s: float = 5.0,
        exporter=None,
        *,
        secret: bytes,
        shm_dir: str = "/dev/shm",
    ):
        self.secret = wire.require_secret(secret)
        self.tcp = TcpKVSender(wire_mode, retry_window_s, secret=secret)
        self.shm = ShmKVSender(retry_window_s, secret=secret, shm_dir=shm_dir) if allow_shm and shm_dir else None
        if self.shm is not None:  # one set of faults: each fires once, whichever transport sends
            self.shm.faults = self.tcp.faults
        self.exporter = exporter  # PullKVExporter for destinations that pull
        self.wire_mode = wire_mode
        self.retry_window_s = retry_window_s
        self.nixl = None  # made on the first nixl:// destination, when NIXL is importable
        self._nixl_missing = False
        self._by_tid: dict[str, KVSender] = {}
        # (receiver, its files) we will not write in place, and until when: a refusal costs
        # opening every file and a round trip to the receiver, on the engine thread
        self._shm_refused: dict[tuple, float] = {}

    def _pick(self, dest: KVDestination, num_layers: int) -> KVSender:
        if dest.pull:
            if self.exporter is None:
                raise KVTransferError("this worker does not serve KV pulls")
            return self.exporter
        key = (dest.address, tuple(dest.shm_paths))
        now = time.monotonic()
        if (
            self.shm is not None
            and dest.shm_paths
            and self._shm_refused.get(key, 0.0) <= now
            and os.path.exists(dest.shm_paths[0])
        ):
            try:
                self.shm.caches_for(dest, num_layers)
                return self.shm
            except KVFileRefused as e:  # another --kv-shm-dir, another user, or a bad request: TCP
                if key not in self._shm_refused:
                    log.warning("not writing KV into the cache files of %s (%s); sending over TCP", dest.address, e)
                if len(self._shm_refused) >= SHM_REFUSALS_KEPT:
                    del self._shm_refused[next(iter(self._shm_refused))]
                self._shm_refused[key] = now + SHM_REFUSAL_S
        if dest.address.startswith("nixl://") and self.wire_mode == "none" and not self._nixl_missing:
            if self.nixl is None:
                if not nixl_available():  # the receiver takes TCP frames too
                    log.warning("NIXL is not importable here: KV for nixl:// receivers goes over TCP")
                    self._nixl_missing = True
                    return self.tcp
                self.nixl = NixlKVSender(self.retry_window_s, secret=self.secret)
                self.nixl.faults = self.tcp.faults
            return self.nixl
        return self.tcp

    def begin(self, dest, num_layers):
        s = self._by_tid[dest.transfer_id] = self._pick(dest, num_layers)
        s.begin(dest, num_layers)

    def save_layer(self, transfer_id, layer, token_start, k, v):
        self._by_tid[transfer_id].save_layer(transfer_id, layer, token_start, k, v)

    def finish(self, transfer_id):
        self._by_tid[transfer_id].finish(transfer_id)

    def wait_for_save(self, transfer_id, timeout_s):
        s = self._by_tid.pop(transfer_id)
        return s.wait_for_save(transfer_id, timeout_s)

    def abort(self, transfer_id, reason):
        s = self._by_tid.pop(transfer_id, None)
        if s is not None:
            s.abort(transfer_id, reason)

    def fail(self, transfer_id, reason):
        s = self._by_tid.get(transfer_id)  # kept: its wait_for_save says why
        if s is not None:
            s.fail(transfer_id, reason)

    def inject_fault(self, spec: str) -> None:
        """`TcpKVSender.inject_fault`, for whichever transport sends next."""
        self.tcp.inject_fault(spec)

    @property
    def refused_connections(self) -> int:
        """Pulls refused for failing the cluster handshake (the only connections we accept)."""
        return self.exporter.refused_connections if self.exporter is not None else 0

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in (self.tcp, self.shm, self.exporter, self.nixl) if s is not None)

    def close(self):
        for s in (self.tcp, self.shm, self.exporter, self.nixl):
            if s is not None:
                s.close()
