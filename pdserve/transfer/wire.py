"""Frames on a KV socket, and KV compression for the wire.

A KV connection opens with the cluster handshake (`pdserve.auth.kv_accept` /
`kv_connect`): nothing of an unauthenticated peer is ever parsed. Then frames:
a 4-byte big-endian header length, a JSON header, then `header["nbytes"]`
bytes of raw tensor data. The receiver reads the payload with `recv_into`
straight into a reusable buffer. No pickle, ever: a peer can only make us
parse JSON and copy bytes into slots we reserved.

Bounds: headers are at most `MAX_HEADER_BYTES`, payloads at most
`MAX_FRAME_BYTES` (each reader passes a tighter bound where it knows one), and
a layer frame's payload must be exactly the K and V of its tokens
(`layer_frame_bytes`), so a header cannot make a reader allocate more than the
transfer it names can hold.
"""

from __future__ import annotations

import json
import logging
import socket
import struct
import threading
import time

import torch

from pdserve import auth

log = logging.getLogger("pdserve.transfer")

_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 16
# No frame is larger: one layer of one chunk. A 128k-token prompt of a 70B model (8 KV heads
# of 128, bf16) is 512 MiB per layer frame, float32 1 GiB.
MAX_FRAME_BYTES = 1 << 31
# Threads unauthenticated peers can hold at once, each for at most the handshake timeout. A
# pending handshake costs a small thread and a socket, so there are plenty; when they are all
# taken, the oldest is dropped for the new connection (a legitimate handshake takes one round
# trip, so silent peers cannot keep it out unless they open this many connections within it).
MAX_PENDING_HANDSHAKES = 128
_DISCARD_CHUNK = 1 << 16
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
WIRE_MODES = ("none", "int8", "fp8")


class FrameError(ConnectionError):
    pass


class IdleTimeout(ConnectionError):
    """No frame began within a connection's idle timeout (`recv_header_within`)."""


def require_secret(secret: bytes) -> bytes:
    """Every KV endpoint needs the cluster secret: fail at construction, not at first use."""
    if not isinstance(secret, bytes) or len(secret) < auth.MIN_SECRET_BYTES:
        raise ValueError(f"a KV endpoint needs the cluster secret (bytes, at least {auth.MIN_SECRET_BYTES})")
    return secret


def send_frame(sock: socket.socket, header: dict, payload: list[torch.Tensor] = ()) -> int:
    """Send one frame; payload tensors go out as their raw bytes (no extra copy)."""
    views = [memoryview(t.contiguous().view(torch.uint8).numpy()) for t in payload]
    nbytes = sum(v.nbytes for v in views)
    sock.sendall(header_bytes(header, nbytes))
    for v in views:
        sock.sendall(v)
    return nbytes


def header_bytes(header: dict, nbytes: int = 0) -> bytes:
    """A frame's length-prefixed header; `nbytes` of payload follow it on the wire."""
    raw = json.dumps(dict(header, nbytes=nbytes), separators=(",", ":")).encode()
    return _LEN.pack(len(raw)) + raw


def recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if n == 0:
            raise FrameError("peer closed the connection mid-frame")
        got += n


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def recv_header(sock: socket.socket, max_payload: int = MAX_FRAME_BYTES) -> dict | None:
    """Next frame's header, or None when the peer closed cleanly between frames.

    The header is an object whose `nbytes` (0 when absent) is at most `max_payload`,
    and whose `op` and `tid`, when present, are strings."""
    first = sock.recv(_LEN.size, socket.MSG_WAITALL)
    if not first:
        return None
    if len(first) < _LEN.size:
        raise FrameError("connection closed inside a frame length")
    return _read_header(sock, first, max_payload)


def recv_header_within(
    sock: socket.socket, idle_s: float, stall_s: float, max_payload: int = MAX_FRAME_BYTES
) -> dict | None:
    """`recv_header` under two timeouts: IdleTimeout when no frame begins within `idle_s`,
    TimeoutError when the peer, once a frame began, sends nothing for `stall_s`. Leaves the
    socket's timeout at `stall_s` (for the payload that follows)."""
    sock.settimeout(idle_s)
    try:
        first = sock.recv(_LEN.size)
    except TimeoutError:
        raise IdleTimeout(f"no frame in {idle_s:g}s") from None
    finally:
        sock.settimeout(stall_s)
    if not first:
        return None
    if len(first) < _LEN.size:
        rest = bytearray(_LEN.size - len(first))
        recv_exact(sock, memoryview(rest))
        first += rest
    return _read_header(sock, first, max_payload)


def _read_header(sock: socket.socket, length: bytes, max_payload: int) -> dict:
    (n,) = _LEN.unpack(length)
    if n > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {n} bytes is larger than allowed")
    raw = bytearray(n)
    recv_exact(sock, memoryview(raw))
    try:
        header = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as e:  # deep nesting overflows the decoder's stack
        raise FrameError(f"frame header is not JSON: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise FrameError("frame header must be a JSON object")
    nbytes = header.setdefault("nbytes", 0)
    if type(nbytes) is not int or not 0 <= nbytes <= max_payload:  # bool is an int: not here
        raise FrameError(f"frame payload of {str(nbytes)[:40]} bytes (at most {max_payload} allowed here)")
    if not all(isinstance(header.get(k, ""), str) for k in ("op", "tid")):
        raise FrameError("frame op and tid must be strings")
    return header


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop a payload nobody will keep (its transfer is unknown here, cancelled or
    failed), through a small fixed buffer: its size costs time, never memory."""
    scratch = memoryview(bytearray(min(nbytes, _DISCARD_CHUNK)))
    while nbytes:
        n = sock.recv_into(scratch[:nbytes])
        if n == 0:
            raise FrameError("peer closed the connection mid-frame")
        nbytes -= n


def peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "?"
    return f"{host}:{port}"


class KVListener:
    """A listening socket whose connections each get a thread that runs the cluster
    handshake and, only if the peer passed it, `handler(sock)`. A refused connection is
    closed, logged with the peer's address, and counted in `refused`.

    At most `max_pending` connections are in the handshake at once; a new one beyond that
    drops the oldest still pending. At most `max_connections` (None: no cap) authenticated
    connections are served at once; one beyond that is closed, logged, and counted in
    `over_limit`."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        handler,
        name: str,
        *,
        max_connections: int | None = None,
        max_pending: int | None = None,
    ):
        self.secret = require_secret(secret)
        self.refused = 0
        self._refusals = _RefusalLog()
        self.over_limit = 0
        self.max_connections = max_connections
        self.max_pending = max_pending or MAX_PENDING_HANDSHAKES
        self._handler, self._name = handler, name
        self._sock = socket.create_server((host, port))
        self.port = self._sock.getsockname()[1]
        self._pending = threading.BoundedSemaphore(self.max_pending)
        self._handshaking: dict[int, socket.socket] = {}  # in the handshake, oldest first
        self._active = 0  # authenticated connections being served
        self._count_lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept_loop, name=f"{name}-accept", daemon=True).start()

    @property
    def active(self) -> int:
        return self._active

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError as e:
                if self._closed:
                    return
                # out of descriptors under a flood of connections, or one reset before we took
                # it: keep listening
                log.warning("accepting a KV connection failed: %s", e)
                time.sleep(0.05)
                continue
            if not self._pending.acquire(blocking=False):
                self._drop_oldest_handshake()  # its thread frees its slot at once
                self._pending.acquire()
            with self._count_lock:
                self._handshaking[id(sock)] = sock
            threading.Thread(target=self._authenticated, args=(sock, addr), name=self._name, daemon=True).start()

    def _drop_oldest_handshake(self) -> None:
        """Every handshake slot is taken: end the oldest handshake (its thread then sees the
        connection closed, refuses it and frees its slot)."""
        with self._count_lock:
            if not self._handshaking:
                return
            key = next(iter(self._handshaking))
            sock = self._handshaking.pop(key)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _authenticated(self, sock: socket.socket, addr) -> None:
        try:
            try:
                auth.kv_accept(sock, self.secret)
            finally:
                with self._count_lock:
                    dropped = self._handshaking.pop(id(sock), None) is None
            if dropped:
                raise auth.AuthError("handshake dropped")
        except OSError as e:  # AuthError, or the peer reset the connection
            if dropped:
                e = f"still unauthenticated when all {self.max_pending} handshake slots were taken ({e})"
            self._refusals.warn("refused KV connection from %s:%s: %s", addr[0], addr[1], e)
            with self._count_lock:
                self.refused += 1
            sock.close()
            return
        finally:
            self._pending.release()
        with self._count_lock:
            full = self.max_connections is not None and self._active >= self.max_connections
            if full:
                self.over_limit += 1
            else:
                self._active += 1
        if full:
            self._refusals.warn(
                "refused KV connection from %s:%s: %d KV connections are open, the most this %s endpoint serves",
                addr[0],
                addr[1],
                self.max_connections,
                self._name,
            )
            sock.close()
            return
        try:
            self._handler(sock)
        finally:
            with self._count_lock:
                self._active -= 1


class _RefusalLog:
    """Refused KV connections, logged one by one up to `burst` a minute, then counted: a flood
    of unauthenticated connects (thousands a second) must not fill the disk with log lines."""

    def __init__(self, burst: int = 20, window_s: float = 60.0, clock=time.monotonic):
        self.burst, self.window_s, self.clock = burst, window_s, clock
        self._lock = threading.Lock()
        self._window_start = float("-inf")
        self._logged = 0
        self._suppressed = 0

    def warn(self, msg: str, *args) -> None:
        now = self.clock()
        with self._lock:
            if now - self._window_start >= self.window_s:
                if self._suppressed:
                    log.warning(
                        "%d more KV connections were refused in the last %.0f s (not logged one by one)",
                        self._suppressed,
                        now - self._window_start,
                    )
                self._window_start, self._logged, self._suppressed = now, 0, 0
            if self._logged >= self.burst:
                self._suppressed += 1
                return
            self._logged += 1
        log.warning(msg, *args)


class StagingBuffer:
    """A growable byte buffer that payloads are received into, reused across frames.
    Callers bound `nbytes` first (`layer_frame_bytes`): it grows to what it is asked."""

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)

    def receive(self, sock: socket.socket, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, 2 * self._buf.numel()), dtype=torch.uint8)
        view = self._buf[:nbytes]
        recv_exact(sock, memoryview(view.numpy()))
        return view


def frame_dtype(header: dict) -> torch.dtype:
    dtype = DTYPES.get(header["dtype"]) if isinstance(header.get("dtype"), str) else None
    if dtype is None:
        raise FrameError(f"unknown dtype {str(header.get('dtype'))[:40]!r} in frame")
    return dtype


def layer_frame_bytes(header: dict, n: int, row: tuple[int, int]) -> int:
    """The payload a layer frame must carry: K and V of `n` tokens of `row` (heads, dim)
    in the frame's wire dtype, plus a float32 scale per token and head each when scaled."""
    heads, dim = row
    per_token = heads * dim * frame_dtype(header).itemsize
    if header.get("scaled"):
        per_token += heads * 4
    return 2 * n * per_token


# ---------------------------------------------------------------- slots


def slot_runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """Split flat slot ids into runs of consecutive slots: (offset in `slots`, first slot, length).

    A fresh decode worker hands out consecutive blocks, so a transfer is usually a
    handful of runs; copying (or receiving) run by run moves the bytes once, at
    memcpy speed, where a per-row scatter pays a second pass."""
    n = slots.numel()
    if n == 0:
        return []
    breaks = (torch.nonzero(slots[1:] - slots[:-1] != 1).flatten() + 1).tolist()
    starts = [0] + breaks
    ends = breaks + [n]
    first = slots[starts].tolist()
    return [(a, f, b - a) for a, f, b in zip(starts, first, ends)]


def few_runs(runs: list, n: int) -> bool:
    """Whether copying run by run beats one scatter (runs of >= ~8 slots)."""
    return len(runs) <= max(4, n // 8)


def copy_into_slots(
    cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, runs: list[tuple[int, int, int]] | None = None
) -> None:
    """cache[slots] = x along dim 0 of `cache` ([num_slots, ...]), run by run when
    the slots form few runs (contiguous copies), else one scatter. `runs`, when the
    caller has them (the same slots for every layer), saves recomputing them."""
    runs = slot_runs(slots) if runs is None else runs
    if few_runs(runs, slots.numel()):
        x = x.to(cache.dtype)
        for off, first, n in runs:
            cache[first : first + n].copy_(x[off : off + n])
    else:
        cache.index_copy_(0, slots, x.to(cache.dtype))


# ---------------------------------------------------------------- compression


def encode(x: torch.Tensor, mode: str) -> tuple[list[torch.Tensor], dict]:
    """[n, heads, dim] -> tensors to send and the header fields to decode them."""
    if mode == "none":
        return [x], {"dtype": str(x.dtype).removeprefix("torch.")}
    xf = x.float()
    # one scale per (token, head): K and V outliers are per head
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8)
    if mode == "int8":
        scale = amax / 127.0
        q = (xf / scale).round().clamp(-127, 127).to(torch.int8)
    elif mode == "fp8":
        scale = amax / 448.0  # largest finite float8_e4m3fn
        q = (xf / scale).to(torch.float8_e4m3fn)
    else:
        raise ValueError(f"unknown wire mode {mode!r}; one of {WIRE_MODES}")
    return [q, scale], {"dtype": str(q.dtype).removeprefix("torch."), "scaled": True}


def decode(raw: torch.Tensor, header: dict, shape: tuple[int, ...], offset: int) -> tuple[torch.Tensor, int]:
    """Rebuild one tensor of `shape` from `raw` at `offset`; returns it and the next offset."""
    dtype = frame_dtype(header)
    n = 1
    for s in shape:
        n *= s
    size = n * torch.empty(0, dtype=dtype).element_size()
    if offset + size > raw.numel():
        raise FrameError("frame payload shorter than its header says")
    x = raw[offset : offset + size].view(dtype).view(shape)
    offset += size
    if header.get("scaled"):
        scale_shape = shape[:-1] + (1,)
        ssize = n // shape[-1] * 4
        if offset + ssize > raw.numel():
            raise FrameError("frame payload shorter than its header says")
        scale = raw[offset : offset + ssize].view(torch.float32).view(scale_shape)
        offset += ssize
        x = x.float() * scale
    return x, offset
