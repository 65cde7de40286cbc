"""Decode side of the KV bridge: a TCP endpoint that lands KV frames in reserved slots.

Pushed transfers arrive on connections the prefill worker opens; pulled ones on
a connection this side opens (`pull`). Both are read by the same frame loop,
and only after the cluster handshake (`pdserve.auth`) passed both ways.
A frame for a transfer we do not expect (unknown, cancelled, expired) is read
through a small fixed buffer and dropped: it can never land in blocks someone
else owns now, nor make us allocate its size. A layer frame must carry exactly
the K and V of its tokens; any other frame carries no payload.

A frame already on its way when its transfer is cancelled must not land either: its
blocks may belong to another request by then. Every write into a transfer's slots (the
socket's copy straight into the cache, or the copy out of a staging buffer) happens in
short steps under the transfer's `write_lock`, each after checking the transfer is still
live, and a step never waits for the network. So `cancel` returns within one such step,
and after it returns nothing more is written into those slots; the rest of the frame is
read and dropped. (The caller must cancel before it hands the blocks to someone else.)

A connection is dropped when its peer stalls inside a frame (`KV_STALL_TIMEOUT_S`) or
sends no frame for `KV_IDLE_TIMEOUT_S`, and a listener serves at most
`KV_MAX_CONNECTIONS` authenticated connections.
"""

from __future__ import annotations

import bisect
import collections
import logging
import select
import socket
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve import auth
from pdserve.kv.shm_files import shm_files_digest
from pdserve.transfer import host_copy, wire
from pdserve.transfer.connector import KVDestination, KVReceiver, KVTransferError, TransferStats

log = logging.getLogger("pdserve.transfer")

# A sender writes a frame out of memory as soon as it began it: a peer that sends nothing for
# this long inside a frame is gone or hostile, and its partial frame is dropped with it.
KV_STALL_TIMEOUT_S = 30.0
# No transfer outlives the longest reservation lease (max_kv_lease_s, 600 s by default), so a
# connection with no frame for longer carries nothing anybody waits for. A sender whose pooled
# connection was closed reconnects (and resends) on its next frame.
KV_IDLE_TIMEOUT_S = 600.0
# Each prefill worker keeps one connection to a decode worker (two while it reconnects), so
# this is a far larger cluster than we run; it bounds the threads (two a connection) and
# staging buffers that authenticated peers can make us hold.
KV_MAX_CONNECTIONS = 128
# The most bytes one locked step copies off the socket into the cache: bounds how long
# `cancel` can wait for a write in progress (a memcpy of this much).
_WRITE_STEP_BYTES = 8 << 20
# Receivers whose cache a sender writes itself, then sends in-place notices.
_WRITTEN_IN_PLACE = ("shm", "nixl")


class _Coverage:
    """The token positions of one layer that frames landed: disjoint sorted [lo, hi) runs
    (touching runs merged), so a range sent twice, or overlapping another, counts once."""

    __slots__ = ("_starts", "_ends", "total")

    def __init__(self):
        self._starts: list[int] = []
        self._ends: list[int] = []
        self.total = 0  # positions covered

    def add(self, lo: int, hi: int) -> None:
        if hi <= lo:
            return
        i = bisect.bisect_left(self._ends, lo)  # first run ending at or after lo
        j = bisect.bisect_right(self._starts, hi)  # first run starting after hi
        if i < j:  # runs i..j-1 overlap or touch [lo, hi): merge them into it
            self.total -= sum(b - a for a, b in zip(self._starts[i:j], self._ends[i:j]))
            lo, hi = min(lo, self._starts[i]), max(hi, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [lo], [hi]
        self.total += hi - lo

    def runs(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))


@dataclass
class _Expected:
    dest: KVDestination
    slots: torch.Tensor
    num_layers: int
    covered: list[_Coverage] = field(default_factory=list)  # per layer: token positions landed
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    stats: TransferStats = field(default_factory=TransferStats)
    runs: dict = field(default_factory=dict)  # (offset, n) -> runs of consecutive slots
    # held for each step that writes into `slots`; `live` turns False under it on cancel
    write_lock: threading.Lock = field(default_factory=threading.Lock)
    live: bool = True

    @property
    def tokens(self) -> int:
        return self.dest.num_tokens - self.dest.start_token

    def layer_complete(self, layer: int) -> bool:
        return self.covered[layer].total >= self.tokens


class KVReceiverServer(KVReceiver):
    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        host: str = "127.0.0.1",
        port: int = 0,
        scheme: str = "tcp",
        *,
        secret: bytes,
        stall_timeout_s: float = KV_STALL_TIMEOUT_S,
        idle_timeout_s: float = KV_IDLE_TIMEOUT_S,
        max_connections: int = KV_MAX_CONNECTIONS,
        shm_paths: list[str] = (),
    ):
        self.kv_caches = kv_caches
        # the files `kv_caches` live in, when a sender on this host may write them itself: it
        # asks (op "shm_files") and writes only into the files this receiver names
        self.shm_files_digest = shm_files_digest(list(shm_paths)) if shm_paths else ""
        self.secret = wire.require_secret(secret)
        self.scheme = scheme
        # ids of transfers whose in-place sender said it is done with them though they did not
        # complete (an abort, or a done for one given up here): drained by the engine, which
        # then need not fence their blocks; bounded, oldest dropped
        self.senders_finished: collections.deque[str] = collections.deque(maxlen=4096)
        # server-side bounds: no header field can lengthen or lift them
        self.stall_timeout_s = stall_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._listener = wire.KVListener(host, port, secret, self._serve, "kv-recv", max_connections=max_connections)
        self.address = f"{scheme}://{host}:{self._listener.port}"
        self._closed = False

    @property
    def refused_connections(self) -> int:
        """Connections closed because the peer failed the cluster handshake."""
        return self._listener.refused

    @property
    def connections(self) -> int:
        """Authenticated connections being served now (pull connections not counted)."""
        return self._listener.active

    # ---- contract
    def expect(self, dest, slots, num_layers, deadline_s):
        # deadline_s is not kept here: the engine holds the reservation's lease and, once
        # it runs out, frees the blocks and the worker cancels the transfer
        e = _Expected(dest, slots, num_layers, covered=[_Coverage() for _ in range(num_layers)])
        e.stats.started_s = time.monotonic()
        with self._lock:
            old = self._expected.get(dest.transfer_id)
            self._expected[dest.transfer_id] = e
        if old is not None:  # the same id again: the old reservation's blocks are gone
            self._retire(old)

    def wait_for_all(self, transfer_id, timeout_s):
        e = self._get(transfer_id)
        if e.tokens <= 0:
            return e.stats
        if not e.done.wait(timeout_s) or e.error:
            raise KVTransferError(e.error or f"{transfer_id}: transfer did not complete in {timeout_s}s")
        return e.stats

    def is_complete(self, transfer_id: str) -> bool:
        e = self._expected.get(transfer_id)
        return e is not None and (e.tokens <= 0 or (e.done.is_set() and not e.error))

    def cancel(self, transfer_id):
        """Forget a transfer. Once this returns, nothing more is written into its slots: a
        frame of it still arriving is read and dropped. Call it before the blocks are freed."""
        with self._lock:
            e = self._expected.pop(transfer_id, None)
        if e is not None:
            self._retire(e)

    def fail(self, transfer_id: str, reason: str) -> None:
        """Give up on a transfer now (its sender is known to be gone): waiters wake with
        KVTransferError instead of sleeping to the deadline. No-op once it completed."""
        self._fail(transfer_id, reason)

    def close(self):
        self._closed = True
        self._listener.close()

    # ---- pull: we open the connection and ask for the transfer
    def pull(self, address: str, transfer_id: str) -> threading.Event:
        """Connect to the exporter at `address` and read the transfer as it is produced, in
        a thread of its own. Returns an event set once the request is out (or has failed)."""
        host, port = address.split("://", 1)[1].rsplit(":", 1)
        requested = threading.Event()

        def run():
            try:
                sock = socket.create_connection((host, int(port)), timeout=10)
                try:
                    auth.kv_connect(sock, self.secret)
                except OSError:
                    sock.close()
                    raise
                sock.settimeout(None)
                wire.send_frame(sock, {"op": "pull", "tid": transfer_id})
                requested.set()
                self._serve(sock)
            except auth.AuthError as e:
                self._fail(transfer_id, f"the KV exporter at {address} refused our cluster token: {e}")
            except OSError as e:
                self._fail(transfer_id, f"pull from {address} failed: {e}")
            finally:
                requested.set()

        threading.Thread(target=run, name=f"kv-pull-{transfer_id}", daemon=True).start()
        return requested

    # ---- internals
    def _get(self, transfer_id) -> _Expected:
        e = self._expected.get(transfer_id)
        if e is None:
            raise KVTransferError(f"no transfer {transfer_id!r} is expected here")
        return e

    @staticmethod
    def _retire(e: _Expected) -> None:
        with e.write_lock:  # waits for a write step in progress: a memcpy, never the network
            e.live = False

    def _fail(self, transfer_id: str, reason: str) -> None:
        with self._lock:
            e = self._expected.get(transfer_id)
            if e is None or e.error or e.done.is_set():
                return
            e.error = reason
        e.done.set()

    def _serve(self, sock: socket.socket) -> None:
        """Receive frames; land each layer in a helper thread while the next one arrives
        (two staging buffers), so the socket copy and the scatter into slots overlap."""
        from concurrent.futures import ThreadPoolExecutor

        staging = [wire.StagingBuffer(), wire.StagingBuffer()]
        landing = [None, None]
        pool = ThreadPoolExecutor(1, thread_name_prefix="kv-land")
        peer = wire.peer_name(sock)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        i = 0
        try:
            while True:
                header = wire.recv_header_within(sock, self.idle_timeout_s, self.stall_timeout_s)
                if header is None:
                    return
                if header["nbytes"]:
                    admitted = self._admit(header)
                    if admitted is None:  # no such transfer (any more): drop the bytes unkept
                        wire.discard(sock, header["nbytes"])
                        continue
                    e, views = admitted[0], self._direct_views(*admitted, header)
                    if views is not None:  # raw KV into few slot runs: straight into the cache
                        left = self._receive_into_slots(sock, e, views)
                        if left:
                            log.warning(
                                "transfer %s was cancelled while %s sent a layer-%s frame of it: "
                                "dropping its last %d bytes unwritten",
                                e.dest.transfer_id,
                                peer,
                                header.get("layer"),
                                left,
                            )
                            wire.discard(sock, left)
                            continue
                        self._mark_landed(e, header)
                        continue
                    if landing[i] is not None:
                        landing[i].result()  # this buffer's previous frame has landed
                    payload = staging[i].receive(sock, header["nbytes"])
                    landing[i] = pool.submit(self._on_frame, header, payload)
                    i ^= 1
                    continue
                for f in landing:  # frames before a "done" must have landed before it counts
                    if f is not None:
                        f.result()
                reply = self._on_frame(header, None)
                if isinstance(reply, tuple):  # (header, payload tensors)
                    wire.send_frame(sock, *reply)
                elif reply is not None:
                    wire.send_frame(sock, reply)
        except wire.IdleTimeout as err:
            log.info("closing the KV connection with %s: idle: %s", peer, err)
        except wire.FrameError as err:
            # a peer that breaks the protocol loses this connection; a sender retries on a new one
            log.warning("closing the KV connection with %s: bad frame: %s", peer, err)
        except TimeoutError:
            log.warning(
                "dropping the KV connection with %s: it sent nothing for %gs inside a frame; "
                "the partial frame is discarded",
                peer,
                self.stall_timeout_s,
            )
        except OSError as err:
            # The sender retries on a new connection; the deadline fails what never comes.
            log.info("KV connection with %s closed: %s", peer, err)
        finally:
            pool.shutdown(wait=True)
            sock.close()

    def _receive_into_slots(self, sock: socket.socket, e: _Expected, views: list[torch.Tensor]) -> int:
        """Receive a frame's payload straight into `views` (the transfer's cache rows).

        Waits for bytes with the lock released, then takes what has arrived (never waiting)
        under `e.write_lock`, after checking the transfer is still live. Returns 0 once it
        all landed, or the bytes still to come when the transfer was cancelled mid-frame (the
        caller drops them). TimeoutError when the peer stalls."""
        bufs = [memoryview(v.view(torch.uint8).numpy()).cast("B") for v in views]
        left = sum(b.nbytes for b in bufs)
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        wait_ms = max(1, int(self.stall_timeout_s * 1000))
        sock.settimeout(0.0)
        try:
            for buf in bufs:
                got = 0
                while got < len(buf):
                    if not poller.poll(wait_ms):
                        raise TimeoutError(f"no byte in {self.stall_timeout_s:g}s")
                    with e.write_lock:
                        if not e.live:
                            return left
                        try:
                            n = sock.recv_into(buf[got : got + _WRITE_STEP_BYTES])
                        except BlockingIOError:
                            continue
                    if n == 0:
                        raise wire.FrameError("peer closed the connection mid-frame")
                    got += n
                    left -= n
        finally:
            sock.settimeout(self.stall_timeout_s)
        return 0

    def _on_frame(self, h: dict, payload) -> dict | None:
        tid, op = h.get("tid"), h.get("op")
        if op == "shm_files":  # which cache files are ours (none: "")
            return {"op": "shm_files", "digest": self.shm_files_digest}
        e = self._expected.get(tid)
        if (
            self.scheme in _WRITTEN_IN_PLACE
            and (op == "abort" or (op == "done" and e is None))
            and not h.get("inflight")
        ):
            # a sender that writes into our cache itself is done with this transfer (its writes
            # came before this frame): blocks the engine fences for it, or will, may go
            self.senders_finished.append(str(tid))
        if op == "abort":
            self._fail(tid, f"sender aborted: {h.get('reason', '')}")
            return None
        if e is None or e.error:
            return (
                {"op": "ack", "tid": tid, "ok": False, "error": "transfer not expected here"} if op == "done" else None
            )
        if op == "layer":
            if "layers" in h:  # an in-place notice naming several landed layers
                if not h.get("inplace") or not isinstance(h["layers"], list):
                    raise wire.FrameError("only an in-place notice may name several layers")
                if len(h["layers"]) > e.num_layers:
                    raise wire.FrameError(f"an in-place notice names {len(h['layers'])} layers")
                for layer in h["layers"]:
                    self._land_layer(e, dict(h, layer=layer), None)
            else:
                self._land_layer(e, h, payload)
            return None
        if op == "done":
            if e.done.is_set():  # a sender that reconnected says it again: once is counted
                return {"op": "ack", "tid": tid, "ok": True}
            missing = [i for i in range(e.num_layers) if not e.layer_complete(i)]
            if missing:
                return {"op": "ack", "tid": tid, "ok": False, "missing_layers": missing}
            e.stats.finished_s = time.monotonic()
            e.done.set()
            return {"op": "ack", "tid": tid, "ok": True}
        raise wire.FrameError(f"unknown op {op!r}")

    def _check_range(self, e: _Expected, h: dict) -> tuple[int, int, int, int]:
        try:
            layer, start, n = int(h["layer"]), int(h["start"]), int(h["n"])
        except (KeyError, TypeError, ValueError) as err:
            raise wire.FrameError(f"layer frame without a valid layer/start/n: {str(err)[:100]}") from None
        lo = start - e.dest.start_token
        if not (0 <= layer < e.num_layers and 0 <= lo and 0 <= n and lo + n <= e.tokens):
            raise wire.FrameError(f"frame for layer {layer} tokens {start}+{n} is outside the transfer")
        return layer, start, n, lo

    def _admit(self, h: dict) -> tuple[_Expected, int, int, int] | None:
        """(transfer, layer, n, lo) of a frame with a payload, once its size is checked
        against what that transfer can hold; None when the transfer is not expected here."""
        if h.get("op") != "layer" or h.get("inplace"):
            raise wire.FrameError(f"a {str(h.get('op'))[:40]!r} frame carries no payload")
        e = self._expected.get(h.get("tid"))
        if e is None or e.error:
            return None
        layer, _, n, lo = self._check_range(e, h)
        want = wire.layer_frame_bytes(h, n, tuple(self.kv_caches[layer][0].shape[-2:]))
        if h["nbytes"] != want:
            raise wire.FrameError(f"layer frame of {h['nbytes']} bytes for {n} tokens (K and V are {want})")
        return e, layer, n, lo

    def _direct_views(self, e: _Expected, layer: int, n: int, lo: int, h: dict) -> list[torch.Tensor] | None:
        """Where an admitted raw (uncompressed, same dtype) layer frame can be received in
        place: the K runs then the V runs of the reserved slots, when they are few. None ->
        take the staging path (compressed, converted or scattered frames)."""
        if h.get("scaled"):
            return None
        k_cache, v_cache = self.kv_caches[layer]
        if h.get("dtype") != str(k_cache.dtype).removeprefix("torch.") or not host_copy.receives_in_place(k_cache):
            return None
        row = tuple(k_cache.shape[-2:])
        runs = e.runs.get((lo, n))
        if runs is None:  # every layer of a chunk lands in the same slots: split them once
            runs = e.runs[(lo, n)] = wire.slot_runs(e.slots[lo : lo + n])
        if not wire.few_runs(runs, n):
            return None
        return [c.view(-1, *row)[first : first + m] for c in (k_cache, v_cache) for _, first, m in runs]

    def _land_layer(self, e: _Expected, h: dict, payload) -> None:
        layer, start, n, lo = self._check_range(e, h)
        if h.get("inplace") and self.scheme not in _WRITTEN_IN_PLACE:
            # only a sender that wrote into our cache itself (shared memory, RDMA) may say a
            # layer landed without sending it; here it would count tokens that never arrived
            raise wire.FrameError(
                f"an in-place notice, but senders cannot write into this {self.scheme} receiver's cache"
            )
        if not h.get("inplace") and n:
            if payload is None:
                raise wire.FrameError(f"layer frame for {n} tokens without their K and V")
            k_cache, v_cache = self.kv_caches[layer]
            shape = (n,) + tuple(k_cache.shape[-2:])
            k, off = wire.decode(payload, h, shape, 0)
            v, _ = wire.decode(payload, h, shape, off)
            k, v = host_copy.to_device(k, k_cache.device), host_copy.to_device(v, v_cache.device)
            slots = e.slots[lo : lo + n]
            runs = wire.slot_runs(slots)  # from the host copy of the slots, once for K and V
            slots = host_copy.to_device(slots, k_cache.device)  # a scatter indexes on the cache's device
            with e.write_lock:  # cancelled since the frame was admitted: its slots may be reused
                if not e.live:
                    log.warning(
                        "transfer %s was cancelled before its layer-%d frame landed: dropped unwritten",
                        e.dest.transfer_id,
                        layer,
                    )
                    return
                wire.copy_into_slots(k_cache.view(-1, *shape[1:]), slots, k, runs)
                wire.copy_into_slots(v_cache.view(-1, *shape[1:]), slots, v, runs)
        self._mark_landed(e, h)

    def _mark_landed(self, e: _Expected, h: dict) -> None:
        layer = int(h["layer"])
        lo = int(h["start"]) - e.dest.start_token  # checked by _check_range
        with self._lock:  # frames of one layer may land from two threads
            if not h.get("inplace"):
                e.stats.bytes += h["nbytes"]
            e.covered[layer].add(lo, lo + int(h["n"]))
            e.stats.layers += 1
