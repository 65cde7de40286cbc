"""Frames on a KV socket, and KV compression for the wire.

A frame is a 4-byte big-endian header length, a JSON header, then
`header["nbytes"]` bytes of raw tensor data. The receiver reads the payload
with `recv_into` straight into a reusable buffer. No pickle, ever: a peer can
only make us parse JSON and copy bytes into slots we reserved.
"""
from __future__ import annotations

import json
import socket
import struct

import torch

_LEN = struct.Struct("!I")
MAX_HEADER_BYTES = 1 << 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
WIRE_MODES = ("none", "int8", "fp8")


class FrameError(ConnectionError):
    pass


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


def recv_header(sock: socket.socket) -> dict | None:
    """Next frame's header, or None when the peer closed cleanly between frames."""
    first = sock.recv(_LEN.size, socket.MSG_WAITALL)
    if not first:
        return None
    if len(first) < _LEN.size:
        raise FrameError("connection closed inside a frame length")
    (n,) = _LEN.unpack(first)
    if n > MAX_HEADER_BYTES:
        raise FrameError(f"frame header of {n} bytes is larger than allowed")
    raw = bytearray(n)
    recv_exact(sock, memoryview(raw))
    try:
        header = json.loads(raw)
    except ValueError as e:
        raise FrameError(f"frame header is not JSON: {e}") from e
    if not isinstance(header, dict) or not isinstance(header.get("nbytes", 0), int):
        raise FrameError("frame header must be an object with an integer nbytes")
    return header


def serve_connections(listener: socket.socket, handler, name: str) -> None:
    """Accept connections until the listener closes; each gets `handler(sock)` in its own thread."""
    import threading

    def loop():
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:  # closed: we are shutting down
                return
            threading.Thread(target=handler, args=(sock,), name=name, daemon=True).start()

    threading.Thread(target=loop, name=f"{name}-accept", daemon=True).start()


class StagingBuffer:
    """A growable byte buffer that payloads are received into, reused across frames."""

    def __init__(self):
        self._buf = torch.empty(0, dtype=torch.uint8)

    def receive(self, sock: socket.socket, nbytes: int) -> torch.Tensor:
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(max(nbytes, 2 * self._buf.numel()), dtype=torch.uint8)
        view = self._buf[:nbytes]
        recv_exact(sock, memoryview(view.numpy()))
        return view


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


def copy_into_slots(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                    runs: list[tuple[int, int, int]] | None = None) -> None:
    """cache[slots] = x along dim 0 of `cache` ([num_slots, ...]), run by run when
    the slots form few runs (contiguous copies), else one scatter. `runs`, when the
    caller has them (the same slots for every layer), saves recomputing them."""
    runs = slot_runs(slots) if runs is None else runs
    if few_runs(runs, slots.numel()):
        x = x.to(cache.dtype)
        for off, first, n in runs:
            cache[first:first + n].copy_(x[off:off + n])
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
    dtype = DTYPES.get(header.get("dtype"))
    if dtype is None:
        raise FrameError(f"unknown dtype {header.get('dtype')!r} in frame")
    n = 1
    for s in shape:
        n *= s
    size = n * torch.empty(0, dtype=dtype).element_size()
    if offset + size > raw.numel():
        raise FrameError("frame payload shorter than its header says")
    x = raw[offset:offset + size].view(dtype).view(shape)
    offset += size
    if header.get("scaled"):
        scale_shape = shape[:-1] + (1,)
        ssize = n // shape[-1] * 4
        if offset + ssize > raw.numel():
            raise FrameError("frame payload shorter than its header says")
        scale = raw[offset:offset + ssize].view(torch.float32).view(scale_shape)
        offset += ssize
        x = x.float() * scale
    return x, offset
