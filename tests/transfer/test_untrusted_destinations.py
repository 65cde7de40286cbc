"""What a prefill worker is told about a KV destination comes in a request: it is checked before
anything is computed or written, and one receiver that stops reading holds up only its own
transfers.

- A destination that does not fit its prompt (tokens past the prompt, too few blocks), or output
  to resume outside the vocabulary or the context, is a 400 at `add_request`, and nothing is left
  half-added: it once stopped the engine at its next step, for everyone.
- Shared-memory cache files are mapped only when they are a decode worker's cache files of this
  user in this worker's --kv-shm-dir, of the size their layout says: any other path (a file to
  overwrite, a link, a file to create) is refused, and AutoKVSender sends over TCP instead.
- A receiver that completes the handshake and never reads: before, every transfer of that
  prefill worker queued behind it; now the others go on their own lane, and its own transfer
  fails once the kernel's send timeout says no byte moved.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest
import torch

from pdserve import auth
from pdserve.engine.sampling_params import InvalidRequest
from pdserve.kv.shm_files import KVFileRefused, new_kv_paths
from pdserve.transfer import sender as sender_mod
from pdserve.transfer.auto import AutoKVSender
from pdserve.transfer.bridge import PrefillBridge
from pdserve.transfer.connector import KVDestination, KVTransferError
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import ShmKVSender, TcpKVSender, destination_slots, map_shared_cache

SECRET = b"test-secret-0123456789"
LAYERS, BLOCKS, BLOCK, HEADS, DIM = 2, 16, 4, 2, 8
SHAPE = [BLOCKS, BLOCK, HEADS, DIM]


# ---------------------------------------------------------------- the engine's checks


@pytest.fixture
def engine(tiny_llm):
    e = tiny_llm.engine
    e.bridge = PrefillBridge(TcpKVSender(secret=SECRET), e.model_config.num_hidden_layers)
    yield e
    e.bridge.sender.close()


def _dest(**kw) -> KVDestination:
    return KVDestination(**{"transfer_id": "t", "address": "tcp://127.0.0.1:1", "block_ids": [0, 1, 2],
                            "block_size": 4, "start_token": 0, "num_tokens": 10, **kw})  # fmt: skip


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"resume_token_ids": [10**9]}, "resumed token ids"),
        ({"resume_token_ids": [-7]}, "resumed token ids"),
        ({"resume_token_ids": [1] * 5000}, "context"),
        ({"kv_destination": _dest(num_tokens=11)}, "of a 10-token prompt"),
        ({"kv_destination": _dest(start_token=8, num_tokens=4)}, "covers tokens"),
        ({"kv_destination": _dest(block_ids=[0, 1])}, "cannot hold"),
    ],
)
def test_bad_internal_inputs_are_refused_and_leave_nothing_behind(engine, kw, message):
    prompt = list(range(1, 11))
    with pytest.raises(InvalidRequest, match=message):
        engine.add_request("r", prompt, **kw)
    assert "r" not in engine.seqs and not engine.bridge.dests and not engine.has_unfinished_requests()
    engine.add_request("r", prompt)  # the id is free, and the engine steps on
    while engine.has_unfinished_requests():
        engine.step()


# ---------------------------------------------------------------- shared-memory files


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "shm"
    d.mkdir()
    return str(d)


@pytest.fixture
def receiver(cache_dir):
    """The decode side, naming the cache files it keeps its KV in (`paths` here)."""
    paths = new_kv_paths(cache_dir, LAYERS)
    maps = map_shared_cache(paths, SHAPE, "float32")
    rx = KVReceiverServer([(maps[2 * i], maps[2 * i + 1]) for i in range(LAYERS)], scheme="shm",
                          secret=SECRET, shm_paths=paths)  # fmt: skip
    rx.paths = paths
    yield rx
    rx.close()


def _shm_dest(address, paths, block_ids=(0, 1, 2, 3)) -> KVDestination:
    return KVDestination("s", address, list(block_ids), BLOCK, 0, 12, shm_paths=list(paths),
                         shm_shape=list(SHAPE), shm_dtype="float32")  # fmt: skip


def test_a_decode_workers_cache_files_are_mapped(cache_dir, receiver):
    sender = ShmKVSender(secret=SECRET, shm_dir=cache_dir)
    try:
        caches = sender.caches_for(_shm_dest(receiver.address, receiver.paths), LAYERS)
        caches[0][0, 0, 0, 0] = 7.0
        assert receiver.kv_caches[0][0][0, 0, 0, 0] == 7.0  # the same memory
    finally:
        sender.close()


def _refusal(sender, dest) -> str:
    with pytest.raises(KVFileRefused) as e:
        sender.caches_for(dest, LAYERS)
    return str(e.value)


def test_other_files_are_never_created_grown_or_written(cache_dir, tmp_path, receiver):
    paths = receiver.paths
    sender = ShmKVSender(secret=SECRET, shm_dir=cache_dir)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    outside = new_kv_paths(str(tmp_path), LAYERS)  # a cache file's name, in another directory
    map_shared_cache(outside, SHAPE, "float32")
    link = os.path.join(cache_dir, os.path.basename(paths[0]).replace("-0k", "-9k"))
    os.symlink(victim, link)
    missing = new_kv_paths(cache_dir, LAYERS)
    try:
        assert "not a pdserve KV cache file" in _refusal(sender, _shm_dest(receiver.address, [str(victim), *paths[1:]]))
        assert "not in this worker's shared-memory directory" in _refusal(
            sender, _shm_dest(receiver.address, [outside[0], *paths[1:]])
        )
        assert "cannot open" in _refusal(sender, _shm_dest(receiver.address, [link, *paths[1:]]))  # O_NOFOLLOW
        assert "cannot open" in _refusal(sender, _shm_dest(receiver.address, missing))
        assert "its layout says" in _refusal(sender, KVDestination(
            "s", "tcp://x:1", [0], BLOCK, 0, 4, shm_paths=paths, shm_shape=[BLOCKS * 2, BLOCK, HEADS, DIM],
            shm_dtype="float32"))  # fmt: skip
        assert "for 2 layers" in _refusal(sender, _shm_dest(receiver.address, paths[:2]))
        assert "outside" in _refusal(sender, _shm_dest(receiver.address, paths, block_ids=[0, BLOCKS]))
        with pytest.raises(KVTransferError, match="refused"):
            sender.begin(_shm_dest(receiver.address, [str(victim), *paths[1:]]), LAYERS)
    finally:
        sender.close()
    assert victim.read_text() == "precious"
    assert not any(os.path.exists(p) for p in missing)
    assert all(os.path.getsize(p) == BLOCKS * BLOCK * HEADS * DIM * 4 for p in paths)


def test_only_the_named_receivers_own_files_of_this_cluster_are_written(cache_dir, receiver):
    """Cache files of another worker, or of another deployment of the same user on this host
    (its receiver fails our handshake), are not mapped: a receiver names its own files."""
    others = new_kv_paths(cache_dir, LAYERS)  # another worker's, of the right size
    map_shared_cache(others, SHAPE, "float32")
    theirs = KVReceiverServer(receiver.kv_caches, scheme="shm", secret=b"another-deployments-secret",
                              shm_paths=receiver.paths)  # fmt: skip
    sender = ShmKVSender(secret=SECRET, shm_dir=cache_dir)
    try:
        assert "does not name these cache files" in _refusal(sender, _shm_dest(receiver.address, others))
        assert "could not be asked" in _refusal(sender, _shm_dest(theirs.address, receiver.paths))
        assert sender.caches_for(_shm_dest(receiver.address, receiver.paths), LAYERS)
    finally:
        sender.close()
        theirs.close()


def test_a_receiver_of_this_cluster_cannot_claim_another_processs_cache_files(cache_dir, receiver):
    """A process holding the cluster secret that names another process's cache files as its own
    (another deployment's decode worker on this host, say): its word is not enough, the files'
    own process must hold the receiver's listening socket."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = [os.path.join(cache_dir, f"pdserve-kv-{child.pid}-0badc0de-{i // 2}{'kv'[i % 2]}")
                  for i in range(2 * LAYERS)]  # fmt: skip
        map_shared_cache(theirs, SHAPE, "float32")
        liar = KVReceiverServer(receiver.kv_caches, scheme="shm", secret=SECRET, shm_paths=theirs)
        sender = ShmKVSender(secret=SECRET, shm_dir=cache_dir)
        try:
            assert "is not the receiver at" in _refusal(sender, _shm_dest(liar.address, theirs))
            mixed = receiver.paths[:1] + theirs[1:]  # its own first file, then another process's
            assert "not one worker's set" in _refusal(sender, _shm_dest(receiver.address, mixed))
            assert sender.caches_for(_shm_dest(receiver.address, receiver.paths), LAYERS)  # the honest one
        finally:
            sender.close()
            liar.close()
    finally:
        child.kill()
        child.wait()
        for p in theirs:
            os.unlink(p)


def test_auto_sender_sends_over_tcp_what_it_will_not_write_in_place(cache_dir, tmp_path, caplog):
    kv = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(LAYERS)]
    rx = KVReceiverServer(kv, scheme="tcp", secret=SECRET)
    elsewhere = new_kv_paths(str(tmp_path), LAYERS)  # real cache files, but not in our --kv-shm-dir
    map_shared_cache(elsewhere, SHAPE, "float32")
    sender = AutoKVSender(secret=SECRET, shm_dir=cache_dir)
    try:
        dest = KVDestination("a", rx.address, list(range(4)), BLOCK, 0, 12, shm_paths=elsewhere,
                             shm_shape=list(SHAPE), shm_dtype="float32")  # fmt: skip
        slots = destination_slots(dest, 0, 12)
        rx.expect(dest, slots, LAYERS, deadline_s=30)
        sender.begin(dest, LAYERS)
        assert sender._by_tid["a"] is sender.tcp
        sent = [torch.randn(12, HEADS, DIM) for _ in range(LAYERS)]
        for layer, k in enumerate(sent):
            sender.save_layer("a", layer, 0, k, k)
        sender.finish("a")
        sender.wait_for_save("a", 30)
        rx.wait_for_all("a", 30)
        for layer, k in enumerate(sent):
            assert torch.equal(kv[layer][0].view(-1, HEADS, DIM)[slots], k)
        assert "sending over TCP" in caplog.text
    finally:
        sender.close()
        rx.close()


# ---------------------------------------------------------------- a receiver that stops reading


class _Tarpit:
    """Completes the cluster handshake, then never reads a byte (its buffers fill, and stay full)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before listen: accepted sockets inherit it
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.address = f"tcp://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            try:
                auth.kv_accept(c, SECRET)
            except Exception:
                c.close()
                continue
            self.conns.append(c)

    def close(self):
        self.sock.close()
        for c in self.conns:
            c.close()


def test_a_receiver_that_stops_reading_holds_up_only_its_own_transfer(monkeypatch):
    monkeypatch.setattr(sender_mod, "SEND_STALL_S", 2.0)
    tarpit = _Tarpit()
    kv = [(torch.zeros(SHAPE), torch.zeros(SHAPE)) for _ in range(LAYERS)]
    rx = KVReceiverServer(kv, scheme="tcp", secret=SECRET)
    sender = TcpKVSender(retry_window_s=0.5, secret=SECRET)
    try:
        stuck = KVDestination("stuck", tarpit.address, list(range(BLOCKS)), BLOCK, 0, BLOCKS * BLOCK)
        sender.begin(stuck, LAYERS)
        big = torch.randn(BLOCKS * BLOCK, HEADS, DIM).repeat(1024, 1, 1)  # 4 MB each: more than the buffers hold
        for layer in range(LAYERS):
            sender.save_layer("stuck", layer, 0, big, big)
        sender.finish("stuck")
        time.sleep(0.3)  # its lane is now blocked in a send
        dest = KVDestination("ok", rx.address, list(range(4)), BLOCK, 0, 12)
        slots = destination_slots(dest, 0, 12)
        rx.expect(dest, slots, LAYERS, deadline_s=30)
        sender.begin(dest, LAYERS)
        t0 = time.monotonic()
        for layer in range(LAYERS):
            k = torch.full((12, HEADS, DIM), float(layer))
            sender.save_layer("ok", layer, 0, k, k)
        sender.finish("ok")
        sender.wait_for_save("ok", 10)
        assert time.monotonic() - t0 < 2  # not behind the stuck transfer
        assert torch.equal(kv[1][0].view(-1, HEADS, DIM)[slots], torch.full((12, HEADS, DIM), 1.0))
        with pytest.raises(KVTransferError):  # the stuck one fails once no byte moved for SEND_STALL_S
            sender.wait_for_save("stuck", 20)
    finally:
        sender.close()
        rx.close()
        tarpit.close()


def test_no_in_place_write_after_the_receivers_lease(cache_dir, receiver):
    """A prefill queued past the decode worker's lease must not write into blocks that may be
    another request's by now: the shared-memory sender checks the lease before each layer."""
    sender = ShmKVSender(secret=SECRET, shm_dir=cache_dir)
    try:
        dest = _shm_dest(receiver.address, receiver.paths)
        dest.expires_unix = time.time() + 0.5  # inside the 1 s margin already
        sender.begin(dest, LAYERS)
        k = torch.ones(12, HEADS, DIM)
        with pytest.raises(KVTransferError, match="lease on its blocks ran out"):
            sender.save_layer("s", 0, 0, k, k)
        assert all(not c.any() for pair in receiver.kv_caches for c in pair)
        dest2 = _shm_dest(receiver.address, receiver.paths)
        dest2.transfer_id, dest2.expires_unix = "s2", time.time() + 60
        sender.begin(dest2, LAYERS)
        sender.save_layer("s2", 0, 0, k, k)  # in time: written
        assert receiver.kv_caches[0][0].any()
    finally:
        sender.close()
