"""The KV receiver against authenticated peers that misbehave, over real sockets.

- A frame still arriving when its transfer is cancelled (lease expired, request aborted)
  never writes into the transfer's blocks afterwards: they may be another request's by then.
- A peer that stalls inside a frame, or sends nothing for long, loses its connection, and
  a listener serves a bounded number of connections.
- Silent unauthenticated peers cannot keep a real handshake out.
- "done" is acknowledged only when every token position of every layer arrived.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
import torch

from pdserve import auth
from pdserve.transfer import wire
from pdserve.transfer.receiver import KVReceiverServer, _Coverage
from pdserve.transfer.sender import TcpKVSender, destination_slots
from tests.transfer.test_kv_auth import (
    DIM,
    HEADS,
    LAYERS,
    SECRET,
    TOKENS,
    assert_landed,
    authenticated,
    caches,
    destination,
    host_port,
    layers,
    push,
    read_to_end,
)

QUICK = 0.3  # the stall and idle timeouts these tests run with, instead of 30 s and 600 s


def raw_frame(tid: str, layer: int, start: int, k: torch.Tensor, v: torch.Tensor, mode: str = "none") -> bytes:
    """A layer frame as a sender writes it: K then V (each with its scales when compressed)."""
    (kq, *kscale), fields = wire.encode(k, mode)
    (vq, *vscale), _ = wire.encode(v, mode)
    parts = [kq, *kscale, vq, *vscale]
    payload = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)
    header = {"op": "layer", "tid": tid, "layer": layer, "start": start, "n": k.shape[0], **fields}
    return wire.header_bytes(header, len(payload)) + payload


def done(s: socket.socket, tid: str) -> dict:
    s.sendall(wire.header_bytes({"op": "done", "tid": tid}))
    s.settimeout(10)
    return wire.recv_header(s, max_payload=0)


def expect_as(rx: KVReceiverServer, tid: str):
    """A reservation `tid` over the same blocks as every other one here (the blocks a
    cancelled reservation freed, handed to the next)."""
    dest = destination(rx.address, tid)
    slots = destination_slots(dest, 0, TOKENS)
    rx.expect(dest, slots, LAYERS, deadline_s=60)
    return dest, slots


def rows(kv, layer: int, which: int, slots: torch.Tensor) -> torch.Tensor:
    return kv[layer][which].view(-1, HEADS, DIM)[slots]


def wait_until(cond, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def log_has(caplog, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- late frames (cancel is a fence)


def sevens_for_a(rx: KVReceiverServer):
    """Transfer A expected at `rx`: its slots, and a layer-0 frame of all sevens for them."""
    _, slots = expect_as(rx, "A")
    pattern = torch.full((TOKENS, HEADS, DIM), 7.0)
    return slots, pattern, raw_frame("A", 0, 0, pattern, pattern)


def test_a_frame_cancelled_mid_way_does_not_land_in_the_next_reservations_blocks(caplog):
    """The audit's attack: half a layer frame for A, A's lease runs out and its blocks go
    to B, then the rest of A's frame. It must not reach B's rows (raw frame, received
    straight into the cache)."""
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        slots, pattern, frame = sevens_for_a(rx)
        header_len = len(frame) - 2 * pattern.numel() * 4
        with authenticated(rx.address) as s:
            s.sendall(frame[: header_len + 64])  # the header and 16 floats of K, then silence
            assert wait_until(lambda: rows(kv, 0, 0, slots).flatten()[15] == 7.0)
            rx.cancel("A")  # what the lease reaper does once it freed A's blocks
            expect_as(rx, "B")
            s.sendall(frame[header_len + 64 :])
            ack = done(s, "B")  # the connection is still in sync: the rest was read and dropped
        assert ack["ok"] is False and ack["missing_layers"] == [0, 1]
        assert not rows(kv, 0, 0, slots).flatten()[16:].any()  # nothing after the cancel
        assert not rows(kv, 0, 1, slots).any()  # nor V
        assert log_has(caplog, "was cancelled while")
        # and B's own transfer lands
        sender = TcpKVSender(secret=SECRET)
        data = layers()
        push(sender, destination(rx.address, "B"), data)
        sender.wait_for_save("B", 30)
        sender.close()
        assert_landed(kv, destination(rx.address, "B"), data)
    finally:
        rx.close()


def test_a_staged_frame_cancelled_before_it_lands_is_dropped(monkeypatch, caplog):
    """A compressed frame goes through a staging buffer and lands from a helper thread: if
    its transfer is cancelled in between, the copy into the slots does not happen."""
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    decoding, go = threading.Event(), threading.Event()
    decode = wire.decode

    def slow_decode(*args, **kwargs):  # the landing thread, holding A, before it copies
        decoding.set()
        assert go.wait(10)
        return decode(*args, **kwargs)

    monkeypatch.setattr(wire, "decode", slow_decode)
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        _, slots = expect_as(rx, "A")
        pattern = torch.full((TOKENS, HEADS, DIM), 7.0)
        with authenticated(rx.address) as s:
            s.sendall(raw_frame("A", 0, 0, pattern, pattern, "int8"))
            assert decoding.wait(10)
            rx.cancel("A")  # returns at once: nothing is being written yet
            expect_as(rx, "B")
            go.set()
            ack = done(s, "B")  # "done" waits for the frames before it to land (or be dropped)
        assert ack["ok"] is False
        assert not rows(kv, 0, 0, slots).any() and not rows(kv, 0, 1, slots).any()
        assert log_has(caplog, "was cancelled before its layer-0 frame landed")
    finally:
        go.set()
        rx.close()


def test_cancel_does_not_wait_for_a_silent_sender():
    """The lease bounds how long a silent sender holds the blocks: cancel never waits on it."""
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        slots, pattern, frame = sevens_for_a(rx)
        with authenticated(rx.address) as s:
            s.sendall(frame[: len(frame) - 100])
            assert wait_until(lambda: rows(kv, 0, 1, slots).flatten()[0] == 7.0)  # deep inside V
            t0 = time.monotonic()
            rx.cancel("A")
            assert time.monotonic() - t0 < 5  # a wait for the silent sender would last its 30 s stall timeout
    finally:
        rx.close()


# ---------------------------------------------------------------- timeouts and the connection cap


def _partial_frames():
    k = torch.ones(TOKENS, HEADS, DIM)
    unknown = wire.header_bytes({"op": "layer", "tid": "ghost", "layer": 0, "start": 0, "n": 1}, 1 << 20)
    return {
        "unknown-transfer-half-payload": unknown + b"\0" * 1000,  # the audit's t14
        "raw-half-payload": raw_frame("t1", 0, 0, k, k)[:-100],  # straight into the cache
        "staged-half-payload": raw_frame("t1", 0, 0, k, k, "int8")[:-100],  # through staging
        "half-length": b"\0\0",
        "half-header": wire.header_bytes({"op": "done", "tid": "t1"})[:10],
    }


@pytest.mark.parametrize("sent", list(_partial_frames()))
def test_a_peer_that_stalls_inside_a_frame_is_dropped(sent, caplog):
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET, stall_timeout_s=QUICK)
    try:
        dest, _ = expect_as(rx, "t1")
        with authenticated(rx.address) as s:
            s.sendall(_partial_frames()[sent])
            t0 = time.monotonic()
            assert read_to_end(s, timeout_s=3) == b""  # it closed on us
            assert time.monotonic() - t0 < 2
        assert log_has(caplog, "inside a frame; the partial frame is discarded")
        assert wait_until(lambda: rx.connections == 0)
        # what it half sent counts for nothing, and a real sender still gets through
        assert not rx.is_complete("t1")
        sender = TcpKVSender(secret=SECRET)
        data = layers()
        push(sender, dest, data)
        sender.wait_for_save("t1", 30)
        sender.close()
        assert_landed(kv, dest, data)
    finally:
        rx.close()


def test_stalled_connections_give_back_their_threads():
    """The audit's t14, smaller: many half frames, then silence; threads return."""
    kv = caches()
    before = threading.active_count()
    rx = KVReceiverServer(kv, secret=SECRET, stall_timeout_s=QUICK)
    socks = []
    try:
        for i in range(20):
            s = authenticated(rx.address)
            h = {"op": "layer", "tid": f"ghost-{i}", "layer": 0, "start": 0, "n": 1}
            s.sendall(wire.header_bytes(h, 1 << 20) + b"\0" * 1000)
            socks.append(s)
        assert wait_until(lambda: rx.connections == 0, 3)
        assert wait_until(lambda: threading.active_count() <= before + 1, 3)  # + the accept loop
    finally:
        for s in socks:
            s.close()
        rx.close()


def test_an_idle_connection_is_closed_and_a_pooled_sender_reconnects(caplog):
    caplog.set_level(logging.INFO, "pdserve.transfer")
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET, idle_timeout_s=QUICK)
    sender = TcpKVSender(secret=SECRET)
    try:
        with authenticated(rx.address) as s:
            assert done(s, "nobody")["ok"] is False  # a frame, then nothing more
            t0 = time.monotonic()
            assert read_to_end(s, timeout_s=3) == b""
            assert time.monotonic() - t0 < 2
        assert log_has(caplog, "idle: no frame in 0.3s")
        # a sender's pooled connection is closed between transfers; it reconnects
        for tid in ("first", "second"):
            dest = destination(rx.address, tid)
            rx.expect(dest, destination_slots(dest, 0, TOKENS), LAYERS, deadline_s=60)
            data = layers()
            push(sender, dest, data)
            sender.wait_for_save(tid, 30)
            assert_landed(kv, dest, data)
            assert wait_until(lambda: rx.connections == 0, 3)  # idle: closed
    finally:
        sender.close()
        rx.close()


def test_connections_beyond_the_cap_are_refused(caplog):
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    rx = KVReceiverServer(caches(), secret=SECRET, max_connections=2)
    held = []
    try:
        held = [authenticated(rx.address) for _ in range(2)]
        assert wait_until(lambda: rx.connections == 2)
        with authenticated(rx.address) as extra:  # passes the handshake, then is closed
            assert read_to_end(extra, timeout_s=3) == b""
        assert log_has(caplog, "2 KV connections are open, the most this kv-recv endpoint serves")
        assert all(done(s, "x")["ok"] is False for s in held)  # the two served are untouched
        held.pop().close()
        assert wait_until(lambda: rx.connections == 1)
        with authenticated(rx.address) as again:  # room again
            assert done(again, "x")["ok"] is False
    finally:
        for s in held:
            s.close()
        rx.close()


# ---------------------------------------------------------------- the handshake slots


def test_silent_unauthenticated_peers_cannot_keep_a_handshake_out(monkeypatch, caplog):
    """All handshake slots held by silent peers: a new connection ends the oldest pending
    handshake instead of waiting (the audit's t03: a real one waited 4.2 s of its 5)."""
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    monkeypatch.setattr(wire, "MAX_PENDING_HANDSHAKES", 8)
    rx = KVReceiverServer(caches(), secret=SECRET)
    silent = []
    try:
        for _ in range(12):
            silent.append(socket.create_connection(host_port(rx.address)))
        time.sleep(0.2)  # all taken in
        for _ in range(3):  # a real peer, three times over: at once, not when a silent one times out (5 s)
            t0 = time.monotonic()
            s = socket.create_connection(host_port(rx.address))
            auth.kv_connect(s, SECRET, timeout_s=2.0)
            assert done(s, "x")["ok"] is False
            s.close()
            assert time.monotonic() - t0 < 2.0
        assert log_has(caplog, "handshake slots were taken")
    finally:
        for s in silent:
            s.close()
        rx.close()


# ---------------------------------------------------------------- "done" means every token


def test_done_counts_token_positions_not_frame_sizes():
    """Frames for [0, 10) twice and [5, 15) add up to 30 tokens of 20, but cover 15: not done
    until [15, 20) comes too."""
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        dest, _ = expect_as(rx, "t1")
        data = layers()
        with authenticated(rx.address) as s:
            for layer, (k, v) in enumerate(data):
                for a, b in ((0, 10), (0, 10), (5, 15)):
                    s.sendall(raw_frame("t1", layer, a, k[a:b], v[a:b]))
            ack = done(s, "t1")
            assert ack["ok"] is False and ack["missing_layers"] == [0, 1]
            assert not rx.is_complete("t1")
            for layer, (k, v) in enumerate(data):
                s.sendall(raw_frame("t1", layer, 10, k[10:], v[10:]))
            assert done(s, "t1")["ok"] is True
        assert rx.is_complete("t1")
        assert_landed(kv, dest, data)
    finally:
        rx.close()


def test_in_place_notices_are_refused_by_a_receiver_nobody_writes_into(caplog):
    """Over TCP a notice saying a layer landed in place carried nothing: it must not count."""
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    rx = KVReceiverServer(caches(), secret=SECRET)  # a tcp receiver: no shared memory
    try:
        expect_as(rx, "t1")
        with authenticated(rx.address) as s:
            notice = {"op": "layer", "tid": "t1", "start": 0, "n": TOKENS, "inplace": True}
            s.sendall(wire.header_bytes(dict(notice, layers=list(range(LAYERS)))))
            s.sendall(wire.header_bytes({"op": "done", "tid": "t1"}))
            assert read_to_end(s, timeout_s=3) == b""  # no acknowledgement: closed
        assert not rx.is_complete("t1")
        assert log_has(caplog, "an in-place notice, but senders cannot write into this tcp receiver's cache")
    finally:
        rx.close()


def test_coverage_is_the_union_of_ranges():
    import random

    rng = random.Random(0)
    for _ in range(200):
        c, seen = _Coverage(), set()
        for _ in range(rng.randint(1, 30)):
            lo = rng.randint(0, 60)
            hi = lo + rng.randint(0, 12)
            c.add(lo, hi)
            seen.update(range(lo, hi))
            assert c.total == len(seen)
            runs = c.runs()
            assert all(a < b for a, b in runs)
            assert all(b1 < a2 for (_, b1), (a2, _) in zip(runs, runs[1:]))  # disjoint, not touching
            assert {p for a, b in runs for p in range(a, b)} == seen


def test_a_flood_of_refused_connections_is_counted_not_logged_line_by_line(caplog):
    """One local client churning silent connects wrote 6,755 warning lines in 16 s: refusals
    are logged one by one up to a burst a minute, then summed in one line."""
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    now = [100.0]
    refusals = wire._RefusalLog(burst=3, window_s=60, clock=lambda: now[0])
    for i in range(10):
        refusals.warn("refused KV connection from %s", i)
    now[0] += 61
    refusals.warn("refused KV connection from %s", "later")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "refused KV connection from 0",
        "refused KV connection from 1",
        "refused KV connection from 2",
        lines[3],
        "refused KV connection from later",
    ]
    assert lines[3] == "7 more KV connections were refused in the last 61 s (not logged one by one)"
