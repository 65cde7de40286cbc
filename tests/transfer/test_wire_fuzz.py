"""Fuzzing the frame parser and the receiver behind an authenticated connection.

Whatever a peer that holds the secret sends (random bytes, JSON headers with random
fields, payloads shorter, longer or other than announced), the receiver only ever
closes that connection: no exception escapes its threads, it allocates no more than
its transfer can hold, writes nothing outside the reserved slots, and takes a valid
transfer afterwards.
"""

from __future__ import annotations

import json
import socket
import struct
import threading

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve import auth
from pdserve.transfer import wire
from pdserve.transfer.connector import KVDestination
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import TcpKVSender, destination_slots
from tests.transfer.test_kv_auth import RecordingBuffer

SECRET = b"test-secret-0123456789"
LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 8, 4, 2, 4
TOKENS, START = 10, 2  # the fuzzed transfer: tokens [2, 10) of a 10-token prompt, in blocks 1-3
FUZZ_BLOCKS, FINAL_BLOCKS = [1, 2, 3], [5, 6, 7]
# the largest frame the transfer can take: every token of K and V in float32 with scales
BOUND = 2 * (TOKENS - START) * (HEADS * DIM * 4 + HEADS * 4)
FUZZ = settings(
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# ---------------------------------------------------------------- strategies

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
small_ints = st.integers(-3, TOKENS + 3)


def _field(values):
    return st.one_of(values, json_values)


headers = st.fixed_dictionaries(
    {},
    optional={
        "op": _field(st.sampled_from(["layer", "done", "abort", "pull", "nixl_md", "ack"])),
        "tid": _field(st.sampled_from(["t1", "ghost"])),
        "layer": _field(small_ints),
        "layers": _field(st.lists(small_ints, max_size=4)),
        "start": _field(small_ints),
        "n": _field(small_ints),
        "dtype": _field(st.sampled_from(sorted(wire.DTYPES) + ["bogus"])),
        "scaled": _field(st.booleans()),
        "inplace": _field(st.booleans()),
        "reason": json_values,
        "nbytes": _field(
            st.one_of(
                st.integers(-2, BOUND + 8), st.sampled_from([10**13, wire.MAX_FRAME_BYTES, wire.MAX_FRAME_BYTES + 1])
            )
        ),
    },
)


@st.composite
def fitting_layer_frames(draw):
    """Layer frames inside the transfer whose size matches their tokens, or nearly: these
    reach the landing paths (in place, staged, notices) and the size checks."""
    n = draw(st.integers(0, TOKENS - START))
    start = draw(st.integers(START, TOKENS - n))
    h = {
        "op": "layer",
        "tid": "t1",
        "layer": draw(st.integers(0, LAYERS - 1)),
        "start": start,
        "n": n,
        "dtype": draw(st.sampled_from(["float32"] * 3 + sorted(wire.DTYPES))),
        "scaled": draw(st.booleans()),
    }
    size = wire.layer_frame_bytes(h, n, (HEADS, DIM))
    shape = draw(st.sampled_from(["exact", "exact", "notice", "notice of several", "empty", "off"]))
    if shape.startswith("notice"):
        h["inplace"] = True
        if shape == "notice of several":
            h["layers"] = draw(st.lists(st.integers(-1, LAYERS), max_size=3))
    h["nbytes"] = {"exact": size, "off": max(0, size + draw(st.integers(-8, 8)))}.get(shape, 0)
    return h


@st.composite
def frames(draw) -> bytes:
    """One frame as bytes: a header (valid JSON or not, its length true or not) and a payload."""
    kind = draw(st.sampled_from(["json", "fitting", "fitting", "garbage"]))
    if kind == "garbage":
        raw = draw(st.binary(max_size=64))
    else:
        header = draw(fitting_layer_frames() if kind == "fitting" else headers)
        raw = json.dumps(header).encode()
    length = {
        "true": len(raw),
        "near": max(0, len(raw) + draw(st.integers(-4, 4))),
        "any": draw(st.integers(0, 2**32 - 1)),
    }[draw(st.sampled_from(["true"] * 4 + ["near", "any"]))]
    nbytes = header.get("nbytes") if kind != "garbage" else None
    if isinstance(nbytes, int) and 0 <= nbytes <= BOUND and draw(st.sampled_from([True, True, True, False])):
        payload = draw(st.binary(min_size=nbytes, max_size=nbytes))  # as much as announced
    else:
        payload = draw(st.binary(max_size=64))
    return struct.pack("!I", length) + raw + payload


# ---------------------------------------------------------------- the parser alone


@FUZZ
@given(st.one_of(st.binary(max_size=300), frames()))
def test_frame_parser_returns_a_header_or_refuses_the_frame(data):
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.close()
        try:
            h = wire.recv_header(b)
        except wire.FrameError:
            return
        assert h is None or (
            isinstance(h, dict)
            and type(h["nbytes"]) is int
            and 0 <= h["nbytes"] <= wire.MAX_FRAME_BYTES
            and all(isinstance(h.get(k, ""), str) for k in ("op", "tid"))
        )
    finally:
        b.close()


def test_frame_parser_refuses_pathological_headers():
    for raw in (
        b"[" * 60000,
        b'{"nbytes": NaN}',
        b'{"nbytes": 1e999}',
        b'{"nbytes": true}',
        b"[1]",
        b'{"op": 1}',
        b'{"tid": ["t1"]}',
        b"\xff\xfe\x00",
    ):
        a, b = socket.socketpair()
        a.sendall(struct.pack("!I", len(raw)) + raw)
        a.close()
        try:
            try:
                wire.recv_header(b)
            except wire.FrameError:
                continue
            raise AssertionError(f"accepted {raw[:20]!r}")
        finally:
            b.close()


# ---------------------------------------------------------------- the receiver


def test_receiver_survives_fuzzed_frames(monkeypatch):
    escaped: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    monkeypatch.setattr(wire, "StagingBuffer", RecordingBuffer)
    RecordingBuffer.most = 0
    kv = [(torch.zeros(BLOCKS, BLOCK, HEADS, DIM), torch.zeros(BLOCKS, BLOCK, HEADS, DIM)) for _ in range(LAYERS)]
    rx = KVReceiverServer(kv, secret=SECRET)
    host, port = rx.address.split("://")[1].rsplit(":", 1)
    fuzzed = KVDestination("t1", rx.address, [0] + FUZZ_BLOCKS, BLOCK, START, TOKENS)
    fuzz_slots = destination_slots(fuzzed, START, TOKENS - START)
    try:

        @FUZZ
        @given(st.lists(frames(), min_size=1, max_size=3))
        def throw(batch):
            rx.cancel("t1")
            rx.expect(fuzzed, fuzz_slots, LAYERS, deadline_s=60)  # a fresh transfer for every example
            with socket.create_connection((host, int(port))) as s:
                auth.kv_connect(s, SECRET)
                try:
                    s.sendall(b"".join(batch))
                    s.shutdown(socket.SHUT_WR)
                except OSError:  # it closed on us already
                    pass
                s.settimeout(10)
                try:
                    while s.recv(1 << 16):  # until the receiver closes (acks may come first)
                        pass
                except ConnectionResetError:
                    pass
            assert not escaped, escaped
            assert RecordingBuffer.most <= 2 * BOUND  # the buffer doubles as it grows

        throw()
        # nothing landed outside the reserved slots
        outside = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
        outside[fuzz_slots] = False
        for k, v in kv:
            assert not k.view(-1, HEADS, DIM)[outside].any() and not v.view(-1, HEADS, DIM)[outside].any()
        # and the receiver still takes a real transfer
        final = KVDestination("final", rx.address, FINAL_BLOCKS, BLOCK, 0, 12)
        slots = destination_slots(final, 0, 12)
        rx.expect(final, slots, LAYERS, deadline_s=30)
        sender = TcpKVSender(secret=SECRET)
        data = [(torch.randn(12, HEADS, DIM), torch.randn(12, HEADS, DIM)) for _ in range(LAYERS)]
        sender.begin(final, LAYERS)
        for i, (k, v) in enumerate(data):
            sender.save_layer("final", i, 0, k, v)
        sender.finish("final")
        sender.wait_for_save("final", 30)
        rx.wait_for_all("final", 30)
        for i, (k, v) in enumerate(data):
            assert torch.equal(kv[i][0].view(-1, HEADS, DIM)[slots], k)
            assert torch.equal(kv[i][1].view(-1, HEADS, DIM)[slots], v)
        sender.close()
        assert not escaped, escaped
    finally:
        rx.close()
