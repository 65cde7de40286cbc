"""Pull mode: the prefill worker keeps each layer's KV until the decode worker asks for it.

The decode worker opens the connection (`KVReceiverServer.pull`), names the
transfer, and reads the same frames a push would send, layer by layer as
the prefill produces them; its acknowledgement comes back on that
connection. Useful when the decode side should control when bytes move: a
decode worker under memory pressure can take a request's KV only once it
has room for it.

Only a peer that passed the cluster handshake may pull, and only a transfer
this worker has begun (or begins within `wait_for_begin_s`); its request and
acknowledgement frames carry no payload.
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from pdserve.transfer import wire
from pdserve.transfer.connector import KVSender, KVTransferError
from pdserve.transfer.sender import SEND_STALL_S, _Outgoing, abandon, settle

log = logging.getLogger("pdserve.transfer")


# A decode worker pulls each request's KV on a connection of its own, for as long as the pull
# takes: this bounds the threads authenticated pullers can make a prefill worker hold, well
# above what its decode workers pull at once (their running sequences).
MAX_PULL_CONNECTIONS = 512
# An authenticated puller must name its transfer, and acknowledge it once streamed, within this.
PULL_WAIT_S = 30.0


class PullKVExporter(KVSender):
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        wire_mode: str = "none",
        wait_for_begin_s: float = 10.0,
        lease_s: float = 120.0,
        *,
        secret: bytes,
    ):
        self.wire_mode = wire_mode
        self.wait_for_begin_s = wait_for_begin_s
        self.lease_s = lease_s
        self._transfers: dict[str, _Outgoing] = {}
        self._aborted: dict[str, str] = {}  # transfer id -> why, for pulls that come after
        self._cv = threading.Condition()
        self._listener = wire.KVListener(
            host, port, secret, self._serve, "kv-export", max_connections=MAX_PULL_CONNECTIONS
        )
        self.address = f"tcp://{host}:{self._listener.port}"
        self._closed = False
        self.total_bytes = 0

    @property
    def refused_connections(self) -> int:
        """Connections closed because the peer failed the cluster handshake."""
        return self._listener.refused

    # ---- contract
    def begin(self, dest, num_layers):
        t = _Outgoing(dest)
        t.stats.started_s = time.monotonic()
        with self._cv:
            # transfers whose wait never came (the prefill failed before it): only finished ones,
            # a prompt queued or computing for longer than the lease still streams its layers
            for tid, old in list(self._transfers.items()):
                if old.finished and t.stats.started_s - old.stats.started_s > self.lease_s:
                    del self._transfers[tid]
            self._transfers[dest.transfer_id] = t
            self._cv.notify_all()

    def save_layer(self, transfer_id, layer, token_start, k, v):
        kp, kh = wire.encode(k, self.wire_mode)
        vp, _ = wire.encode(v, self.wire_mode)
        header = {"op": "layer", "tid": transfer_id, "layer": layer, "start": token_start, "n": k.shape[0], **kh}
        with self._cv:
            self._transfers[transfer_id].frames.append((header, kp + vp))
            self._cv.notify_all()

    def finish(self, transfer_id):
        with self._cv:
            self._transfers[transfer_id].finished = True
            self._cv.notify_all()

    def wait_for_save(self, transfer_id, timeout_s):
        t = self._transfers.get(transfer_id)
        if t is None:
            raise KVTransferError(f"{transfer_id}: no such transfer here (aborted, or dropped after its lease)")
        ok = t.acked.wait(timeout_s)
        with self._cv:
            self._transfers.pop(transfer_id, None)
            if not ok:  # a pull still streaming it tells its puller and ends
                t.error, t.finished = t.error or f"{transfer_id}: the prefill worker gave up waiting for the pull", True
                self._cv.notify_all()
        return settle(t, ok, f"{transfer_id}: nobody pulled the KV within {timeout_s}s")

    def abort(self, transfer_id, reason):
        with self._cv:
            t = self._transfers.pop(transfer_id, None)
            if t is not None:
                t.error, t.finished = f"aborted: {reason}", True
                # a pull that comes later learns why (the oldest reasons go first)
                self._aborted[transfer_id] = t.error
                while len(self._aborted) > 1024:
                    self._aborted.pop(next(iter(self._aborted)))
                self._cv.notify_all()

    def fail(self, transfer_id, reason):
        with self._cv:
            t = self._transfers.get(transfer_id)
            if t is not None and not t.acked.is_set():
                t.error, t.finished = f"{transfer_id}: {reason}", True
                t.acked.set()
                self._cv.notify_all()  # a pull in progress sends the puller an abort

    def close(self):
        self._closed = True
        self._listener.close()
        with self._cv:
            abandon(self._transfers)
            self._cv.notify_all()  # pulls in progress send the puller an abort

    # ---- serving pulls
    def _serve(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # a puller that stops reading (hung, cut off, its host gone without a FIN) fails the send
        # instead of holding this thread and the transfer's frames forever (per send call, as the
        # push sender's: a slow link that moves some bytes is not cut)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_STALL_S), 0))
        tid = None
        try:
            h = wire.recv_header_within(sock, PULL_WAIT_S, SEND_STALL_S, max_payload=0)
            if h is None:
                return
            if h.get("op") != "pull":
                raise wire.FrameError(f"expected a pull request, got {str(h)[:100]}")
            tid = str(h.get("tid"))
            sock.settimeout(None)  # sends are bounded per call by SO_SNDTIMEO, not as a whole
            t = self._await_transfer(tid)
            if t is None:
                reason = self._aborted.get(tid, "no such transfer here")
                wire.send_frame(sock, {"op": "abort", "tid": tid, "reason": reason})
                return
            if not self._stream(sock, t):
                return  # aborted: the puller was told
            try:  # the puller acknowledges once the frames it read landed: moments, not minutes
                ack = wire.recv_header_within(sock, PULL_WAIT_S, SEND_STALL_S, max_payload=0)
            except OSError as e:  # wire.IdleTimeout and TimeoutError included
                ack = f"no acknowledgement ({e or type(e).__name__})"
            if isinstance(ack, dict) and ack.get("op") == "ack" and ack.get("ok"):
                t.acked.set()
            else:
                t.error = f"{tid}: puller refused: {ack}"
                t.acked.set()
        except wire.FrameError as e:
            log.warning("closing the KV pull connection from %s: bad frame: %s", wire.peer_name(sock), e)
        except OSError as e:
            log.info("pull of %s broke: %s", tid, e)  # the puller may come back and pull again
        finally:
            sock.close()

    def _await_transfer(self, tid: str) -> _Outgoing | None:
        """The pull may arrive before the prefill request that begins the transfer."""
        deadline = time.monotonic() + self.wait_for_begin_s
        with self._cv:
            while tid not in self._transfers and tid not in self._aborted:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(left)
            return self._transfers.get(tid)

    def _stream(self, sock: socket.socket, t: _Outgoing) -> bool:
        """Send the transfer's frames as they come, then `done`; False if it was aborted."""
        sent = 0
        while True:
            with self._cv:
                while sent == len(t.frames) and not t.finished and not self._closed:
                    self._cv.wait(1.0)
                if self._closed and not t.finished:
                    t.error = t.error or "the KV exporter closed"
                batch = t.frames[sent:]
                finished, error = t.finished, t.error
            if error:
                wire.send_frame(sock, {"op": "abort", "tid": t.dest.transfer_id, "reason": error})
                return False
            for header, payload in batch:
                n = wire.send_frame(sock, header, payload)
                t.stats.bytes += n
                t.stats.layers += 1
                self.total_bytes += n
            sent += len(batch)
            if finished and sent == len(t.frames):
                wire.send_frame(sock, {"op": "done", "tid": t.dest.transfer_id})
                return True
