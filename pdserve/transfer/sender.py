"""Prefill side of the KV bridge: push over TCP, push in place through shared memory, or
serve pulls.

`save_layer` only queues: a sender thread does the socket work, so the next
layer's compute overlaps this layer's transfer (layer-wise pipelining). Each
receiver has a thread and a queue of its own (a "lane"), so a receiver that
stops reading holds up only its own transfers, and a send that makes no progress
for `SEND_STALL_S` fails its connection (then the usual retry, then the transfer). Sent
layers are kept until the receiver acknowledges the whole transfer, so a
connection cut at layer k (or closed by the receiver, which drops a connection
that sends it a bad frame) is healed by reconnecting and resending; the
receiver ignores what it already holds. Every connection opens with the
cluster handshake (`pdserve.auth.kv_connect`) before a byte of KV goes out.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve import auth
from pdserve.faults import KV_FAULTS, FaultSet
from pdserve.kv.shm_files import KVFileRefused, open_peer_kv_file, owner_holds_connection, same_worker, shm_files_digest
from pdserve.kv.slots import slot_mapping
from pdserve.transfer import wire
from pdserve.transfer.connector import KVDestination, KVSender, KVTransferError, TransferStats

log = logging.getLogger("pdserve.transfer")


@dataclass
class _Outgoing:
    dest: KVDestination
    frames: list[tuple[dict, list[torch.Tensor]]] = field(default_factory=list)
    finished: bool = False
    acked: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    stats: TransferStats = field(default_factory=TransferStats)
    held: list = field(default_factory=list)  # (start, n, layer) landed in place, notice not sent yet
    noticed_s: float = 0.0  # when the last notice of landed layers went
    sock: socket.socket | None = None  # the connection its frames last went on
    lost: int = 0  # connections that broke under it
    caches: list | None = None  # shared memory: the destination's mapped cache files


def layers_in(header: dict) -> int:
    """How many layers a frame carries: a layer frame one, an in-place notice maybe several."""
    return len(header["layers"]) if "layers" in header else int(header.get("op") == "layer")


def settle(t: _Outgoing, acked: bool, timeout_message: str) -> TransferStats:
    """The end of a sender's wait: its stats, or the reason it failed."""
    if not acked:
        raise KVTransferError(timeout_message)
    if t.error:
        raise KVTransferError(t.error)
    t.stats.finished_s = time.monotonic()
    return t.stats


def abandon(transfers: dict[str, _Outgoing]) -> None:
    """A closing sender's unacknowledged transfers fail now: whoever waits for one
    (`wait_for_save`) wakes instead of sleeping out its timeout, and a puller is told."""
    for tid, t in list(transfers.items()):
        if not t.acked.is_set():
            t.error = t.error or f"{tid}: the KV sender closed before the receiver acknowledged the transfer"
            t.finished = True
            t.acked.set()


def _host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


# A transfer whose connection breaks more often than this fails (its decode worker
# recomputes): a receiver that refuses a frame refuses it again when it is resent.
MAX_LOST_CONNECTIONS = 3
# A send to a receiver that accepts no byte for this long fails its connection (the kernel's
# SO_SNDTIMEO: per send call, so a slow link that moves some bytes is not cut). A receiver
# that stopped reading would otherwise hold its lane forever.
SEND_STALL_S = 30.0
# A sender that writes into the receiver's blocks itself stops this long before the receiver's
# lease runs out (`KVDestination.expires_unix`): past it the blocks may be another request's.
IN_PLACE_MARGIN_S = 1.0


def check_lease(dest: KVDestination) -> None:
    """Before an in-place write: KVTransferError once the receiver may have freed the blocks."""
    if dest.expires_unix and time.time() > dest.expires_unix - IN_PLACE_MARGIN_S:
        raise KVTransferError(
            f"{dest.transfer_id}: the receiver's lease on its blocks ran out before this layer was ready; "
            "not writing into them (the decode worker recomputes)"
        )


# A lane (a receiver's thread and queue) with nothing to send for this long ends; the next
# transfer to that receiver starts a new one.
LANE_IDLE_S = 60.0


class _Lane:
    """One receiver's queue of frames and the thread that writes them to its connection."""

    def __init__(self, address: str):
        self.address = address
        self.q: queue.Queue = queue.Queue()
        self.lock = threading.Lock()  # held by whoever writes to this receiver's socket
        self.queued = 0  # frames put on the queue and not yet sent (the sender's _count_lock)


class TcpKVSender(KVSender):
    """Push: connect to the decode worker's receiver and send frames."""

    def __init__(self, wire_mode: str = "none", retry_window_s: float = 5.0, lease_s: float = 120.0, *, secret: bytes):
        if wire_mode not in wire.WIRE_MODES:
            raise ValueError(f"wire mode must be one of {wire.WIRE_MODES}")
        self.secret = wire.require_secret(secret)
        self.wire_mode = wire_mode
        self.retry_window_s = retry_window_s
        self.lease_s = lease_s  # a transfer nobody waits for is dropped after this
        self.faults = FaultSet.from_env(KV_FAULTS)  # armed only by tests and the chaos benchmark
        self._transfers: dict[str, _Outgoing] = {}
        self._socks: dict[str, socket.socket] = {}  # each written under its lane's lock
        self._lanes: dict[str, _Lane] = {}  # receiver address -> its lane (while it has work)
        self._count_lock = threading.Lock()  # lanes and their counts of queued frames
        self._closed = False
        self.total_bytes = 0
        self.inline_frames = 0  # frames the caller's thread sent itself (_send_now)
        self._slots_key: tuple | None = None
        self._slots: tuple = ()

    # ---- contract
    def begin(self, dest, num_layers):
        t = _Outgoing(dest)
        t.stats.started_s = time.monotonic()
        for tid, old in list(self._transfers.items()):  # leases of transfers nobody waited for
            # (only those whose layers were all queued: one still waiting for its prefill is live)
            if (old.finished or old.acked.is_set()) and t.stats.started_s - old.stats.started_s > self.lease_s:
                self._transfers.pop(tid, None)
        self._transfers[dest.transfer_id] = t

    def save_layer(self, transfer_id, layer, token_start, k, v):
        t = self._transfers[transfer_id]
        kp, kh = wire.encode(k, self.wire_mode)
        vp, _ = wire.encode(v, self.wire_mode)
        header = {"op": "layer", "tid": transfer_id, "layer": layer, "start": token_start, "n": k.shape[0], **kh}
        self._enqueue(t, header, kp + vp)

    def finish(self, transfer_id):
        t = self._transfers[transfer_id]
        t.finished = True
        self._put((t, {"op": "done", "tid": transfer_id}, []))

    def wait_for_save(self, transfer_id, timeout_s):
        t = self._transfers.get(transfer_id)
        if t is None:
            raise KVTransferError(f"{transfer_id}: no such transfer here (aborted, or dropped after its lease)")
        ok = t.acked.wait(timeout_s)
        self._transfers.pop(transfer_id, None)
        return settle(t, ok, f"{transfer_id}: receiver did not acknowledge within {timeout_s}s")

    def abort(self, transfer_id: str, reason: str) -> None:
        t = self._transfers.pop(transfer_id, None)
        if t is not None:
            self._put((t, {"op": "abort", "tid": transfer_id, "reason": reason}, []))

    def fail(self, transfer_id: str, reason: str) -> None:
        t = self._transfers.get(transfer_id)
        if t is not None and not t.acked.is_set():
            t.error = f"{transfer_id}: {reason}"
            t.acked.set()  # its waiter wakes with the error; its frames not sent yet are dropped
            self._put((t, {"op": "abort", "tid": transfer_id, "reason": reason}, []))  # D frees the blocks

    def close(self):
        self._closed = True
        with self._count_lock:
            for lane in self._lanes.values():
                lane.q.put(None)
        abandon(self._transfers)  # their queued frames will not go now
        for s in list(self._socks.values()):
            s.close()

    @property
    def _queued(self) -> int:
        """Frames queued on every lane and not sent yet."""
        with self._count_lock:
            return sum(lane.queued for lane in self._lanes.values())

    def inject_fault(self, spec: str) -> None:
        """Arm faults at run time (the chaos benchmark, through the worker's fault route): the
        KV faults of pdserve/faults.py. ValueError for a bad spec or a fault that is not the sender's."""
        self.faults.arm(spec)

    # ---- internals
    def _enqueue(self, t: _Outgoing, header: dict, payload: list[torch.Tensor]) -> None:
        t.frames.append((header, payload))
        self._put((t, header, payload))

    def _put(self, item: tuple) -> None:
        """Queue a frame on its receiver's lane."""
        with self._count_lock:
            lane = self._lane(item[0].dest.address)
            lane.queued += 1
            lane.q.put(item)

    def _lane(self, address: str) -> _Lane:
        """The receiver's lane, started if it has none (with self._count_lock held)."""
        lane = self._lanes.get(address)
        if lane is None:
            lane = self._lanes[address] = _Lane(address)
            threading.Thread(target=self._send_loop, args=(lane,), name="kv-send", daemon=True).start()
        return lane

    def _lane_lock(self, address: str) -> threading.Lock | None:
        with self._count_lock:
            lane = self._lanes.get(address)
            return lane.lock if lane is not None else None

    def _send_loop(self, lane: _Lane):
        while not self._closed:
            try:
                item = lane.q.get(timeout=LANE_IDLE_S)
            except queue.Empty:
                with self._count_lock:  # nothing came: end, unless a frame is being put right now
                    if lane.q.empty():
                        self._lanes.pop(lane.address, None)
                        return
                continue
            if item is None:
                return
            with lane.lock:
                try:
                    t, header, payload = item
                    # frames of a transfer already settled, failed or dropped are moot; its abort is not
                    live = self._transfers.get(t.dest.transfer_id) is t and t.error is None or header["op"] == "abort"
                    if live and t.dest.address is not None:
                        self._send_with_retry(t, header, payload)
                finally:
                    with self._count_lock:
                        lane.queued -= 1

    def _send_now(self, t: _Outgoing, header: dict) -> bool:
        """Send a frame without payload from the caller's thread, sparing the hop to the
        sender thread (on two cores a third runnable thread costs 100-200 us a frame).
        Only when nothing queued would be passed and the connection is up; never blocks:
        a full socket buffer, a broken connection or a busy sender thread answers False
        and the caller queues the frame, so the thread's retry and resend heal it."""
        lane = self._lanes.get(t.dest.address)  # (a dict read: atomic; no lock on the notice path)
        if lane is None or self.faults or not lane.lock.acquire(blocking=False):
            return False  # (no lane: no connection either; the first frame goes through the thread)
        try:
            if lane.queued:  # changed under _count_lock by whoever queues: a frame queued now waits for us
                return False
            sock = self._socks.get(t.dest.address)
            if sock is None or (t.sock is not None and t.sock is not sock):  # a new one: resend first
                return False
            raw = wire.header_bytes(header)
            try:
                n = sock.send(raw, socket.MSG_DONTWAIT)
            except OSError:
                return False
            if n < len(raw):  # half a frame went: drop the connection; the thread sends it whole on a new one
                self._drop(t.dest.address)
                return False
            t.sock = sock
            t.stats.layers += layers_in(header)
            self.inline_frames += 1
            return True
        finally:
            lane.lock.release()

    def _send_with_retry(self, t: _Outgoing, header: dict, payload) -> None:
        deadline = time.monotonic() + self.retry_window_s
        while True:
            try:
                sock = self._sock(t.dest.address)
                if self.faults:
                    self.faults.before_kv_frame(header.get("layer", -1), sock)
                if t.sock is not None and t.sock is not sock and header["op"] != "abort":
                    # a new connection: the receiver may lack what went on the old one
                    for h, p in t.frames:
                        if h is not header:
                            self.total_bytes += wire.send_frame(sock, *self._ready(h, p))
                n = wire.send_frame(sock, *self._ready(header, payload))
                t.sock = sock
                self.total_bytes += n
                t.stats.bytes += n
                t.stats.layers += layers_in(header)
                return
            except auth.AuthError as e:  # retrying cannot help: fail the transfer now
                t.error = f"{header['tid']}: the KV receiver at {t.dest.address} refused our cluster token ({e})"
                t.acked.set()
                return
            except OSError as e:
                self._drop(t.dest.address)
                if time.monotonic() > deadline:
                    t.error = f"{header['tid']}: sending to {t.dest.address} failed: {e}"
                    t.acked.set()
                    return
                t.stats.retries += 1
                time.sleep(0.05)

    def _destination(self, t: _Outgoing, token_start: int, n: int) -> tuple[torch.Tensor, list]:
        """The receiver's slots for tokens [token_start, token_start + n) and their runs of
        consecutive slots; every layer of a chunk lands in the same ones, so the last
        answer is kept (backends that write in place use it)."""
        key = (t.dest.transfer_id, token_start, n)
        if self._slots_key != key:
            slots = destination_slots(t.dest, token_start, n)
            self._slots_key, self._slots = key, (slots, wire.slot_runs(slots))
        return self._slots

    def _ready(self, header: dict, payload: list) -> tuple[dict, list]:
        """The frame as it may go out now (a backend that moves the bytes some other
        way first waits here until they have landed)."""
        return header, payload

    def _sock(self, address: str) -> socket.socket:
        s = self._socks.get(address)
        if s is None:
            s = socket.create_connection(_host_port(address), timeout=5)
            try:
                auth.kv_connect(s, self.secret)
            except OSError:
                s.close()
                raise
            s.settimeout(None)
            # sends (not the ack reader's receives) give up on a receiver that stopped reading
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(SEND_STALL_S), 0))
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks[address] = s
            threading.Thread(target=self._read_acks, args=(s, address), daemon=True).start()
        return s

    def _drop(self, address: str) -> None:
        s = self._socks.pop(address, None)
        if s is not None:
            try:
                s.shutdown(socket.SHUT_RDWR)  # wakes its ack reader, which close() alone does not
            except OSError:
                pass
            s.close()

    def _read_acks(self, sock: socket.socket, address: str) -> None:
        try:
            while True:
                h = wire.recv_header(sock, max_payload=0)  # acks carry no payload
                if h is None:
                    break
                self._on_ack(h)
        except wire.FrameError as e:
            log.warning("bad frame from the KV receiver at %s: %s; reconnecting", address, e)
            try:  # nobody reads this connection now: a send blocked on it must fail, not wait
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        except OSError:
            pass
        self._lost(sock, address)

    def _lost(self, sock: socket.socket, address: str) -> None:
        """A connection ended (the receiver refused a frame or restarted, or a send on it
        failed): what went on it may not have landed. Transfers that used it resend
        everything on their next frame, which goes on a new connection; those whose `done`
        already went get it queued again, to carry the resend."""
        with self._lane_lock(address) or contextlib.nullcontext():  # no lane: no one writes to it
            if self._closed:
                return
            found = self._socks.get(address) is sock  # else the sender thread dropped it, and counted
            if found:
                log.info("the KV receiver at %s closed our connection; resending on a new one", address)
                self._drop(address)
        for t in list(self._transfers.values()):
            if t.sock is not sock or t.acked.is_set():
                continue
            t.lost += 1
            if t.lost > MAX_LOST_CONNECTIONS:  # it refuses what we resend: give up, D recomputes
                t.error = f"{t.dest.transfer_id}: the connection to the KV receiver at {address} broke {t.lost} times"
                t.acked.set()
                continue
            if found:
                t.stats.retries += 1
            if t.finished:
                self._put((t, {"op": "done", "tid": t.dest.transfer_id}, []))

    def _on_ack(self, h: dict) -> None:
        t = self._transfers.get(h.get("tid"))
        if t is None or h.get("op") != "ack":
            return
        if h.get("ok"):
            t.acked.set()
        elif h.get("missing_layers"):
            t.error = f"{h['tid']}: receiver is missing layers {h['missing_layers']}"
            t.acked.set()
        else:
            t.error = f"{h['tid']}: receiver refused: {h.get('error')}"
            t.acked.set()


class ShmKVSender(TcpKVSender):
    """Push on one host: write K/V straight into the decode worker's shared-memory
    cache (one copy, no socket payload); only a notice frame travels.

    A notice costs the sender 100-400 us on this VM (loopback TCP and waking the
    receiver: docs/disaggregation.md, session 7), as much as copying 1-3 MB.
    Layers that land less than `notice_gap_s` after the last notice wait for the
    next one, which names them all, or for `finish`; the decode side waits for
    the whole transfer anyway. A layer-wise prefill here (a layer every 10 ms or
    more for long prompts) still notifies layer by layer; an eager burst of 30
    layers in 10 ms sends 3 notices instead of 30 (0.62x -> 0.83x of memcpy)."""

    def __init__(
        self, retry_window_s: float = 5.0, notice_gap_s: float = 0.005, *, secret: bytes, shm_dir: str = "/dev/shm"
    ):
        super().__init__("none", retry_window_s, secret=secret)
        self.notice_gap_s = notice_gap_s
        self.shm_dir = shm_dir  # the only directory whose cache files this sender maps
        self._maps: dict[tuple, list[torch.Tensor]] = {}

    def caches_for(self, dest: KVDestination, num_layers: int) -> list[torch.Tensor]:
        """The destination's cache files mapped (kept for its next transfers): KVFileRefused
        when they are not a decode worker's cache files here (`map_peer_cache`), or its
        blocks are not in them."""
        key = (dest.address, tuple(dest.shm_paths), tuple(dest.shm_shape), dest.shm_dtype)
        caches = self._maps.get(key)
        if caches is None:
            for old in [k for k in self._maps if not os.path.exists(k[1][0])]:
                del self._maps[old]  # its worker is gone: unmapping frees the memory its files held
            caches = map_peer_cache(dest.shm_paths, dest.shm_shape, dest.shm_dtype, self.shm_dir, num_layers)
            self._check_owner(dest)  # (mapping writes nothing: refused here, the maps just go)
            self._maps[key] = caches
        num_blocks, block_size = dest.shm_shape[0], dest.shm_shape[1]
        if block_size != dest.block_size:
            raise KVFileRefused(f"block size {dest.block_size} does not match the cache layout {dest.shm_shape}")
        if any(not 0 <= b < num_blocks for b in dest.block_ids):
            raise KVFileRefused(f"block ids outside the destination cache's {num_blocks} blocks")
        if len(dest.block_ids) * block_size < dest.num_tokens:
            raise KVFileRefused(f"{len(dest.block_ids)} blocks cannot hold {dest.num_tokens} tokens")
        return caches

    def _check_owner(self, dest: KVDestination) -> None:
        """The files must be the named receiver's own, and the receiver of this deployment: it
        passes the cluster handshake and names these very files (op "shm_files"). Else a caller
        holding our token could name the cache files of another deployment of the same user on
        this host, or another worker's files, and have us write into them."""
        if not same_worker(list(dest.shm_paths)):
            raise KVFileRefused("the cache files are not one worker's set")
        try:
            with socket.create_connection(_host_port(dest.address), timeout=5) as s:
                auth.kv_connect(s, self.secret)
                wire.send_frame(s, {"op": "shm_files", "tid": ""})
                reply = wire.recv_header(s, max_payload=0)
                if not reply or reply.get("digest") != shm_files_digest(list(dest.shm_paths)):
                    raise KVFileRefused(f"the receiver at {dest.address} does not name these cache files as its own")
                # the answer is the receiver's word: the files' own process must be the one that
                # accepted this very connection (read while it is open)
                if not owner_holds_connection(dest.shm_paths[0], _host_port(dest.address)[1], s.getsockname()[:2]):
                    raise KVFileRefused(
                        f"the process these cache files are named after is not the receiver at {dest.address}"
                    )
        except (OSError, wire.FrameError) as e:  # auth.AuthError included
            raise KVFileRefused(f"the receiver at {dest.address} could not be asked for its cache files: {e}") from None

    def begin(self, dest, num_layers):
        try:
            caches = self.caches_for(dest, num_layers)
        except KVFileRefused as e:
            raise KVTransferError(f"shared-memory KV destination refused: {e}") from None
        super().begin(dest, num_layers)
        # held by the transfer: the mapping outlives its entry in _maps (dropped once the files
        # are gone) for as long as the transfer writes
        self._transfers[dest.transfer_id].caches = caches

    def save_layer(self, transfer_id, layer, token_start, k, v):
        if k.is_cuda or v.is_cuda:
            raise KVTransferError(
                "shared-memory KV transfer writes host memory: hand it host tensors (PrefillBridge stages "
                "a CUDA cache's rows there) or send over TCP"
            )
        t = self._transfers[transfer_id]
        d = t.dest
        check_lease(d)
        kc, vc = t.caches[2 * layer], t.caches[2 * layer + 1]
        if tuple(k.shape[1:]) != tuple(kc.shape[-2:]) or token_start + k.shape[0] > len(d.block_ids) * d.block_size:
            # a layout that does not fit this model: fail the transfer (its decode worker
            # recomputes), never the step that produced it
            t.error = f"{transfer_id}: K/V rows {tuple(k.shape)} do not fit the destination cache {tuple(kc.shape)}"
            t.acked.set()
            return
        slots, runs = self._destination(t, token_start, k.shape[0])
        wire.copy_into_slots(kc.view(-1, *kc.shape[-2:]), slots, k, runs)
        wire.copy_into_slots(vc.view(-1, *vc.shape[-2:]), slots, v, runs)
        t.stats.bytes += 2 * k.numel() * kc.element_size()
        if t.held and t.held[0][:2] != (token_start, k.shape[0]):  # another chunk: one notice names one
            self._notify(t)
        t.held.append((token_start, k.shape[0], layer))
        if self.faults or time.monotonic() - t.noticed_s >= self.notice_gap_s:
            self._notify(t)

    def finish(self, transfer_id):
        t = self._transfers[transfer_id]
        t.finished = True
        self._notify(t)
        self._send(t, {"op": "done", "tid": transfer_id})

    def _notify(self, t: _Outgoing) -> None:
        """One notice for the layers held: `layer` for one, `layers` for several."""
        if not t.held:
            return
        (start, n, _), layers = t.held[0], [layer for *_, layer in t.held]
        header = {"op": "layer", "tid": t.dest.transfer_id, "start": start, "n": n, "inplace": True}
        if len(layers) == 1:
            header["layer"] = layers[0]
        else:
            header["layers"] = layers
        t.held = []
        t.noticed_s = time.monotonic()
        t.frames.append((header, []))  # resent on a new connection if this one breaks
        self._send(t, header)

    def _send(self, t: _Outgoing, header: dict) -> None:
        if not self._send_now(t, header):
            self._put((t, header, []))


def destination_slots(dest: KVDestination, start: int, n: int) -> torch.Tensor:
    """The receiver's flat slot for each token in [start, start + n)."""
    return slot_mapping(dest.block_ids, start, start + n, dest.block_size)


def map_shared_cache(paths: list[str], shape: list[int], dtype: str) -> list[torch.Tensor]:
    """Map (creating or growing them as needed) KV cache files: [k0, v0, k1, v1, ...], each
    of `shape`. For caches this process owns; a peer's files go through `map_peer_cache`."""
    numel = 1
    for s in shape:
        numel *= s
    return [torch.from_file(p, shared=True, size=numel, dtype=wire.DTYPES[dtype]).view(shape) for p in paths]


def map_peer_cache(paths: list[str], shape: list[int], dtype: str, shm_dir: str, num_layers: int):
    """Map a decode worker's cache files, named in a request: each one checked first
    (`open_peer_kv_file`: a pdserve cache file of this user in `shm_dir`, of exactly the
    size `shape` and `dtype` give) and mapped through its open descriptor, so nothing is
    created, grown or swapped. KVFileRefused says why not."""
    if dtype not in wire.DTYPES:
        raise KVFileRefused(f"unknown KV dtype {dtype!r}")
    if len(shape) != 4 or any(not isinstance(s, int) or s <= 0 for s in shape):
        raise KVFileRefused(f"cache shape {shape} is not [blocks, block size, KV heads, head dim]")
    if len(paths) != 2 * num_layers:
        raise KVFileRefused(f"{len(paths)} cache files for {num_layers} layers (one K and one V each)")
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    nbytes = numel * torch.empty((), dtype=wire.DTYPES[dtype]).element_size()
    maps = []
    for path in paths:
        fd = open_peer_kv_file(path, shm_dir, nbytes)
        try:
            maps.append(torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=wire.DTYPES[dtype]))
        finally:
            os.close(fd)
    return [m.view(shape) for m in maps]
