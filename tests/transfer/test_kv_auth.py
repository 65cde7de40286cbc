"""Every KV connection is authenticated with the cluster secret and every frame is bounded.

For each endpoint that accepts connections (the decode worker's receiver, the prefill
worker's pull exporter, the NIXL receiver's metadata channel): a peer that says nothing,
hangs up, holds another secret, or sends a frame without the handshake is refused,
logged and counted, and gets nothing but the challenge; nothing it sent reaches the
cache. Senders that meet an endpoint of another cluster fail their transfer at once.
A frame larger than its transfer can hold is refused before anything is allocated.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import stat
import struct
import threading
import time

import pytest
import torch

from pdserve import auth
from pdserve.kv.shm_files import new_kv_paths
from pdserve.transfer import wire
from pdserve.transfer.connector import KVDestination, KVTransferError
from pdserve.transfer.pull import PullKVExporter
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import ShmKVSender, TcpKVSender, destination_slots, map_shared_cache

SECRET = b"test-secret-0123456789"
OTHER = b"another-clusters-secret"  # a peer of another deployment, or a guess
LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 16, 4, 2, 8
TOKENS = 20
HELLO = len(b"PDKV-AUTH-v1") + 32  # what the accepting side sends first: its magic and challenge


def caches(paths=()):
    shape = [BLOCKS, BLOCK, HEADS, DIM]
    if paths:
        maps = map_shared_cache(list(paths), shape, "float32")
        return [(maps[2 * i], maps[2 * i + 1]) for i in range(LAYERS)]
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]


def untouched(kv) -> bool:
    return all(not k.any() and not v.any() for k, v in kv)


def destination(address: str, tid: str = "t1", pull: bool = False, paths=()) -> KVDestination:
    return KVDestination(
        tid,
        address,
        list(range(2, 2 + BLOCKS - 2)),
        BLOCK,
        0,
        TOKENS,
        pull=pull,
        shm_paths=list(paths),
        shm_shape=[BLOCKS, BLOCK, HEADS, DIM] if paths else [],
        shm_dtype="float32" if paths else "",
    )


def expect(rx: KVReceiverServer, tid: str = "t1", pull: bool = False) -> KVDestination:
    dest = destination(rx.address, tid, pull)
    rx.expect(dest, destination_slots(dest, 0, TOKENS), LAYERS, deadline_s=60)
    return dest


def layers() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(TOKENS, HEADS, DIM), torch.randn(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]


def push(sender, dest: KVDestination, kv_layers) -> None:
    sender.begin(dest, LAYERS)
    for layer, (k, v) in enumerate(kv_layers):
        sender.save_layer(dest.transfer_id, layer, 0, k, v)
    sender.finish(dest.transfer_id)


def assert_landed(kv, dest: KVDestination, kv_layers) -> None:
    slots = destination_slots(dest, 0, TOKENS)
    for layer, (k, v) in enumerate(kv_layers):
        assert torch.equal(kv[layer][0].view(-1, HEADS, DIM)[slots], k)
        assert torch.equal(kv[layer][1].view(-1, HEADS, DIM)[slots], v)


def host_port(address: str) -> tuple[str, int]:
    host, port = address.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def read_to_end(sock: socket.socket, timeout_s: float = 10) -> bytes:
    """Everything the endpoint sends until it closes the connection."""
    sock.settimeout(timeout_s)
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:  # it closed with our bytes unread
        pass
    return got


# ---------------------------------------------------------------- peers without the secret


def idle(address: str, frame: bytes) -> bytes:
    """Connects and says nothing: refused when the handshake times out."""
    with socket.create_connection(host_port(address)) as s:
        return read_to_end(s)


def hang_up(address: str, frame: bytes) -> bytes:
    """Reads the challenge and leaves: it has no answer."""
    with socket.create_connection(host_port(address)) as s:
        hello = s.recv(HELLO, socket.MSG_WAITALL)
        s.shutdown(socket.SHUT_WR)
        return hello + read_to_end(s)


def wrong_secret(address: str, frame: bytes) -> bytes:
    """Answers the challenge with another secret, and sends its frame anyway."""
    with socket.create_connection(host_port(address)) as s:
        with pytest.raises(auth.AuthError):
            auth.kv_connect(s, OTHER)
        try:
            s.sendall(frame)
        except OSError:
            pass
        return read_to_end(s)


def raw_frame(address: str, frame: bytes) -> bytes:
    """Sends a well-formed frame without any handshake."""
    with socket.create_connection(host_port(address)) as s:
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # refused (and reset) before we were done
            pass
        return read_to_end(s)


PEERS = [idle, hang_up, wrong_secret, raw_frame]


@pytest.fixture
def quick_handshakes(monkeypatch):
    """Endpoints give up on a silent peer after 0.3 s instead of 5 s."""
    monkeypatch.setattr(auth, "kv_accept", functools.partial(auth.kv_accept, timeout_s=0.3))


def refusal_logged(caplog, n: int = 1) -> bool:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused KV connection from ")]
    return len(lines) == n and lines[0].startswith("refused KV connection from 127.0.0.1:")


def layer_frame(tid: str, layer: int, k: torch.Tensor, v: torch.Tensor) -> bytes:
    header = {"op": "layer", "tid": tid, "layer": layer, "start": 0, "n": k.shape[0], "dtype": "float32"}
    return wire.header_bytes(header, 2 * k.numel() * 4) + k.numpy().tobytes() + v.numpy().tobytes()


@pytest.mark.parametrize("peer", PEERS)
def test_receiver_refuses_peers_without_the_secret(peer, quick_handshakes, caplog):
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        dest = expect(rx)
        data = layers()
        frames = b"".join(layer_frame("t1", i, k, v) for i, (k, v) in enumerate(data))
        got = peer(rx.address, frames + wire.header_bytes({"op": "done", "tid": "t1"}))
        assert len(got) <= HELLO  # the challenge, and not even an acknowledgement
        assert rx.refused_connections == 1 and refusal_logged(caplog)
        assert untouched(kv) and not rx.is_complete("t1")
        # the right secret works, on the same receiver
        sender = TcpKVSender(secret=SECRET)
        push(sender, dest, data)
        sender.wait_for_save("t1", 30)
        assert_landed(kv, dest, data)
        assert rx.refused_connections == 1
        sender.close()
    finally:
        rx.close()


@pytest.mark.parametrize("peer", PEERS)
def test_pull_exporter_serves_no_kv_to_peers_without_the_secret(peer, quick_handshakes, caplog):
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    exporter = PullKVExporter(secret=SECRET)
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        dest = expect(rx, pull=True)
        data = layers()
        push(exporter, dest, data)  # every layer waits in the exporter for its puller
        got = peer(exporter.address, wire.header_bytes({"op": "pull", "tid": "t1"}))
        assert len(got) <= HELLO  # no KV leaked
        assert exporter.refused_connections == 1 and refusal_logged(caplog)
        assert not exporter._transfers["t1"].acked.is_set()
        rx.pull(exporter.address, "t1")  # the decode worker of this cluster
        rx.wait_for_all("t1", 30)
        exporter.wait_for_save("t1", 30)
        assert_landed(kv, dest, data)
    finally:
        exporter.close()
        rx.close()


@pytest.mark.parametrize("peer", PEERS)
def test_nixl_receiver_gives_no_metadata_to_peers_without_the_secret(peer, quick_handshakes, caplog):
    """The metadata names the agent and the cache's addresses: only for this cluster."""
    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlKVReceiver, NixlKVSender

    caplog.set_level(logging.WARNING, "pdserve.transfer")
    kv = caches()
    rx = NixlKVReceiver(kv, secret=SECRET)
    sender = None
    try:
        dest = expect(rx)
        got = peer(rx.address, wire.header_bytes({"op": "nixl_md"}))
        assert len(got) <= HELLO
        assert rx.refused_connections == 1 and refusal_logged(caplog)
        sender = NixlKVSender(secret=SECRET)
        data = layers()
        push(sender, dest, data)
        sender.wait_for_save("t1", 30)
        assert_landed(kv, dest, data)
        assert sender.nixl_bytes > 0
    finally:
        if sender is not None:
            sender.close()
        rx.close()


# ---------------------------------------------------------------- senders meeting another cluster


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_push_to_a_receiver_of_another_cluster_fails_at_once(transport, tmp_path):
    """The handshake is mutual: our sender will not send KV to an endpoint that cannot
    prove it holds our secret, and fails the transfer instead of retrying."""
    paths = new_kv_paths(str(tmp_path), LAYERS) if transport == "shm" else []
    kv = caches(paths)
    rx = KVReceiverServer(kv, scheme=transport, secret=OTHER, shm_paths=paths)
    sender = (
        ShmKVSender(retry_window_s=30, secret=SECRET, shm_dir=str(tmp_path))
        if transport == "shm"
        else TcpKVSender(retry_window_s=30, secret=SECRET)
    )
    try:
        dest = destination(rx.address, paths=paths)
        rx.expect(dest, destination_slots(dest, 0, TOKENS), LAYERS, deadline_s=60)
        t0 = time.monotonic()
        if transport == "shm":  # asked whose the files are before a byte is written: refused at begin
            with pytest.raises(KVTransferError, match="could not be asked for its cache files"):
                sender.begin(dest, LAYERS)
        else:
            push(sender, dest, layers())
            with pytest.raises(KVTransferError, match="refused our cluster token"):
                sender.wait_for_save("t1", 30)
        assert time.monotonic() - t0 < 5  # not the 30 s retry window
        assert rx.refused_connections >= 1 and not rx.is_complete("t1")
        assert untouched(kv)
    finally:
        sender.close()
        rx.close()


def test_pull_from_an_exporter_of_another_cluster_fails_the_transfer():
    exporter = PullKVExporter(secret=OTHER)
    rx = KVReceiverServer(caches(), secret=SECRET)
    try:
        dest = expect(rx, pull=True)
        push(exporter, dest, layers())
        rx.pull(exporter.address, "t1")
        with pytest.raises(KVTransferError, match="refused our cluster token"):
            rx.wait_for_all("t1", 10)
        assert exporter.refused_connections == 1
    finally:
        exporter.close()
        rx.close()


def test_nixl_sender_fetches_no_metadata_from_another_cluster():
    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlKVReceiver, NixlKVSender

    rx = NixlKVReceiver(caches(), secret=OTHER)
    sender = NixlKVSender(secret=SECRET)
    try:
        with pytest.raises(KVTransferError, match="refused our cluster token"):
            sender.begin(destination(rx.address), LAYERS)
        assert rx.refused_connections == 1
    finally:
        sender.close()
        rx.close()


@pytest.mark.parametrize(
    "make",
    [
        lambda s: KVReceiverServer(caches(), secret=s),
        lambda s: PullKVExporter(secret=s),
        lambda s: TcpKVSender(secret=s),
        lambda s: ShmKVSender(secret=s),
    ],
)
@pytest.mark.parametrize("secret", [b"", b"short", "a-str-not-bytes-0123456789"])
def test_endpoints_need_a_real_secret(make, secret):
    with pytest.raises(ValueError, match="cluster secret"):
        make(secret)


# ---------------------------------------------------------------- bounds


class RecordingBuffer(wire.StagingBuffer):
    """A staging buffer that remembers the most it ever held."""

    most = 0

    def receive(self, sock, nbytes):
        view = super().receive(sock, nbytes)
        RecordingBuffer.most = max(RecordingBuffer.most, self._buf.numel())
        return view


@pytest.fixture
def staging(monkeypatch):
    RecordingBuffer.most = 0
    monkeypatch.setattr(wire, "StagingBuffer", RecordingBuffer)
    return RecordingBuffer


def authenticated(address: str) -> socket.socket:
    s = socket.create_connection(host_port(address))
    auth.kv_connect(s, SECRET)
    return s


ROW_BYTES = 2 * TOKENS * HEADS * DIM * 4  # K and V of the whole transfer in float32


@pytest.mark.parametrize(
    "header",
    [
        {"op": "layer", "tid": "t1", "layer": 0, "start": 0, "n": TOKENS, "dtype": "float32", "nbytes": 10**13},
        {"op": "layer", "tid": "t1", "layer": 0, "start": 0, "n": TOKENS, "dtype": "float32", "nbytes": ROW_BYTES + 4},
        {"op": "layer", "tid": "t1", "layer": 0, "start": 0, "n": TOKENS, "dtype": "int8", "nbytes": ROW_BYTES},
        {"op": "layer", "tid": "t1", "layer": 0, "start": 0, "n": TOKENS, "dtype": "bogus", "nbytes": 64},
        {"op": "layer", "tid": "t1", "layer": 0, "start": 0, "n": 10**9, "dtype": "float32", "nbytes": 10**9},
        {"op": "layer", "tid": "t1", "layer": 0, "start": 0, "n": TOKENS, "inplace": True, "nbytes": 64},
        {"op": "layer", "tid": "ghost", "nbytes": 10**13},
        {"op": "layer", "tid": "t1", "nbytes": -1},
        {"op": "layer", "tid": "t1", "nbytes": True},
        {"op": "done", "tid": "t1", "nbytes": 1000},
        {"op": "abort", "tid": "t1", "nbytes": 1 << 20},
    ],
    ids=[
        "huge",
        "one-row-over",
        "int8-sized-as-float32",
        "bad-dtype",
        "outside-transfer",
        "notice-with-payload",
        "huge-unknown",
        "negative",
        "bool",
        "done-with-payload",
        "abort-with-payload",
    ],
)
def test_oversized_frames_are_refused_without_allocating(header, staging, caplog):
    caplog.set_level(logging.WARNING, "pdserve.transfer")
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        dest = expect(rx)
        with authenticated(rx.address) as s:
            raw = json_header(header)
            s.sendall(raw)  # the header alone: the receiver must not wait for (or allocate) a payload
            assert read_to_end(s) == b""
        assert staging.most == 0 and untouched(kv) and not rx.is_complete("t1")
        assert any("closing the KV connection" in r.getMessage() for r in caplog.records)
        sender = TcpKVSender(secret=SECRET)  # the receiver still takes transfers
        data = layers()
        push(sender, dest, data)
        sender.wait_for_save("t1", 30)
        assert_landed(kv, dest, data)
        sender.close()
    finally:
        rx.close()


def json_header(header: dict) -> bytes:
    import json

    raw = json.dumps(header).encode()
    return struct.pack("!I", len(raw)) + raw


def test_frames_for_unknown_or_cancelled_transfers_are_dropped_unallocated(staging):
    """A sender may still be sending a transfer the decode side gave up on: its frames are
    read through a small fixed buffer and dropped, and the connection stays in sync."""
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    try:
        expect(rx, "gone")
        rx.cancel("gone")
        big = torch.randn((2 << 20) // (HEADS * DIM * 4), HEADS, DIM)  # 4 MiB of K and V a frame
        with authenticated(rx.address) as s:
            for tid in ("ghost", "gone"):
                s.sendall(layer_frame(tid, 0, big, big))
            s.sendall(wire.header_bytes({"op": "done", "tid": "ghost"}))
            ack = wire.recv_header(s, max_payload=0)
        assert ack == {"op": "ack", "tid": "ghost", "ok": False, "error": "transfer not expected here", "nbytes": 0}
        assert staging.most == 0 and untouched(kv)
    finally:
        rx.close()


def test_frames_within_bounds_use_a_buffer_no_larger_than_the_transfer(staging):
    """Compressed frames go through staging: it holds at most two of the largest frames the
    transfer can take (it doubles when it grows)."""
    kv = caches()
    rx = KVReceiverServer(kv, secret=SECRET)
    sender = TcpKVSender("int8", secret=SECRET)
    try:
        dest = expect(rx)
        push(sender, dest, layers())
        sender.wait_for_save("t1", 30)
        assert 0 < staging.most <= 2 * ROW_BYTES
    finally:
        sender.close()
        rx.close()


def test_sender_refuses_acknowledgements_with_a_payload():
    """A receiver (of this cluster, but broken) answering `done` with a payload of a
    terabyte: the sender reads no payload, drops the connection, and after a few tries
    fails the transfer instead of waiting forever."""
    srv = socket.create_server(("127.0.0.1", 0))
    connections = []

    def serve():
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            connections.append(c)
            threading.Thread(target=answer, args=(c,), daemon=True).start()

    def answer(c):
        try:
            auth.kv_accept(c, SECRET)
            while (h := wire.recv_header(c)) is not None:
                wire.discard(c, h["nbytes"])
                if h["op"] == "done":
                    c.sendall(wire.header_bytes({"op": "ack", "tid": h["tid"], "ok": True}, 10**12))
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    sender = TcpKVSender(secret=SECRET)
    try:
        push(sender, destination(f"tcp://127.0.0.1:{srv.getsockname()[1]}"), layers())
        with pytest.raises(KVTransferError, match="broke"):
            sender.wait_for_save("t1", 30)
        assert 1 < len(connections) <= 5
    finally:
        sender.close()
        srv.close()


# ---------------------------------------------------------------- shared memory


def test_shared_memory_kv_files_are_private(tiny_model_dir, tmp_path):
    """The decode worker's cache files: this user only, whatever the umask."""
    from pdserve import LLM

    old = os.umask(0)
    try:
        engine = LLM(
            tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=8, kv_cache_shm_dir=str(tmp_path)
        ).engine
    finally:
        os.umask(old)
    paths = engine.runner.kv_shm_paths
    assert paths
    for p in paths:
        st = os.stat(p)
        assert stat.S_IMODE(st.st_mode) == 0o600, (p, oct(st.st_mode))
        assert st.st_uid == os.getuid()
