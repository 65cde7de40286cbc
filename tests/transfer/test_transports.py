"""Each KV transport lands exactly the bytes it was given in the reserved slots,
whatever the slot layout: consecutive blocks (received in place, run by run),
a few fragments, or scattered blocks (received into staging, then scattered)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from pdserve import auth
from pdserve.kv.shm_files import new_kv_paths
from pdserve.transfer import wire
from pdserve.transfer.connector import KVDestination, KVTransferError
from pdserve.transfer.pull import PullKVExporter
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import ShmKVSender, TcpKVSender, destination_slots, map_shared_cache

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 3, 24, 4, 2, 8
SECRET = b"test-secret-0123456789"  # the cluster secret every KV endpoint here shares


def test_slot_runs():
    assert wire.slot_runs(torch.tensor([], dtype=torch.long)) == []
    assert wire.slot_runs(torch.tensor([5, 6, 7, 12, 13, 3])) == [(0, 5, 3), (3, 12, 2), (5, 3, 1)]
    assert wire.slot_runs(torch.arange(10, 20)) == [(0, 10, 10)]


@pytest.mark.parametrize("runs", [None, []])
def test_copy_into_slots_both_paths(runs):
    cache = torch.zeros(40, 3)
    slots = torch.tensor([9, 10, 11, 30, 31, 2])
    x = torch.randn(6, 3)
    wire.copy_into_slots(cache, slots, x, None if runs is None else wire.slot_runs(slots))
    assert torch.equal(cache[slots], x)
    outside = torch.ones(cache.shape[0], dtype=torch.bool)
    outside[slots] = False
    assert not cache[outside].any()  # nothing written elsewhere


LAYOUTS = {
    "consecutive": list(range(3, 3 + 10)),
    "fragmented": [7, 8, 9, 0, 1, 2, 15, 16, 17, 18],
    "scattered": [20, 3, 11, 7, 1, 14, 9, 22, 5, 17],
}


def _caches(paths=None):
    shape = [BLOCKS, BLOCK, HEADS, DIM]
    if paths:
        maps = map_shared_cache(paths, shape, "float32")
        return [(maps[2 * i], maps[2 * i + 1]) for i in range(LAYERS)]
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]


@pytest.fixture
def shm_paths(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    paths = new_kv_paths(base, LAYERS)  # named as a decode worker names them: a sender maps no other
    yield paths
    for p in paths:
        if os.path.exists(p):
            os.unlink(p)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_transport_lands_every_layout(layout, transport, shm_paths):
    paths = shm_paths if transport == "shm" else []
    kv = _caches(paths)
    rx = KVReceiverServer(kv, scheme=transport, secret=SECRET, shm_paths=paths)
    sender = ShmKVSender(secret=SECRET) if transport == "shm" else TcpKVSender(secret=SECRET)
    tokens, start = 37, 5  # the receiver already holds tokens [0, 5): incremental
    dest = KVDestination(
        "t1",
        rx.address,
        LAYOUTS[layout],
        BLOCK,
        start,
        tokens,
        shm_paths=paths,
        shm_shape=[BLOCKS, BLOCK, HEADS, DIM] if paths else [],
        shm_dtype="float32" if paths else "",
    )
    slots = destination_slots(dest, start, tokens - start)
    rx.expect(dest, slots, LAYERS, deadline_s=30)
    sent = {}
    sender.begin(dest, LAYERS)
    for layer in range(LAYERS):
        for lo, hi in ((start, 20), (20, tokens)):  # two chunks per layer, as chunked prefill sends
            k, v = torch.randn(hi - lo, HEADS, DIM), torch.randn(hi - lo, HEADS, DIM)
            sent[layer, lo] = (k, v)
            sender.save_layer("t1", layer, lo, k, v)
    sender.finish("t1")
    rx.wait_for_all("t1", 30)
    sender.wait_for_save("t1", 30)
    for (layer, lo), (k, v) in sent.items():
        s = slots[lo - start : lo - start + k.shape[0]]
        k_cache, v_cache = kv[layer]
        assert torch.equal(k_cache.view(-1, HEADS, DIM)[s], k), (layer, lo)
        assert torch.equal(v_cache.view(-1, HEADS, DIM)[s], v), (layer, lo)
    # nothing outside the reserved slots was touched
    mask = torch.ones(BLOCKS * BLOCK, dtype=torch.bool)
    mask[slots] = False
    for k_cache, v_cache in kv:
        assert k_cache.view(-1, HEADS, DIM)[mask].abs().sum() == 0
        assert v_cache.view(-1, HEADS, DIM)[mask].abs().sum() == 0
    sender.close()
    rx.close()


def test_stale_kv_files_of_dead_workers_are_swept(tmp_path):
    """A killed decode worker cannot remove its /dev/shm cache; the next one does."""
    import subprocess
    import sys

    from pdserve.kv.shm_files import sweep_stale_kv_files

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    ).stdout.strip()
    stale = tmp_path / f"pdserve-kv-{dead}-0123abcd-7k"
    live = tmp_path / f"pdserve-kv-{os.getpid()}-0123abcd-7v"
    other = tmp_path / "not-ours-123"
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert sweep_stale_kv_files(str(tmp_path)) == [stale.name]
    assert not stale.exists() and live.exists() and other.exists()


@pytest.mark.parametrize("layout,window", [("consecutive", 2), ("scattered", 2), ("scattered", 1), ("consecutive", 0)])
def test_nixl_write_lands_every_layout(layout, window):
    """NIXL (UCX over TCP on host memory) WRITEs into the reserved slots; the notice
    frame only follows a completed WRITE; no more than `window` WRITEs are posted at
    once (0: all of them)."""
    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlKVReceiver, NixlKVSender

    kv = _caches()
    rx = NixlKVReceiver(kv, secret=SECRET)
    sender = NixlKVSender(writes_in_flight=window, secret=SECRET)
    most = []
    post = sender._post_batch
    sender._post_batch = lambda through=None: (post(through), most.append(sender._posted))
    try:
        tokens, start = 37, 5
        dest = KVDestination("n1", rx.address, LAYOUTS[layout], BLOCK, start, tokens)
        assert rx.address.startswith("nixl://")
        slots = destination_slots(dest, start, tokens - start)
        rx.expect(dest, slots, LAYERS, deadline_s=30)
        sent = {}
        sender.begin(dest, LAYERS)
        for layer in range(LAYERS):
            k, v = torch.randn(tokens - start, HEADS, DIM), torch.randn(tokens - start, HEADS, DIM)
            sent[layer] = (k, v)
            sender.save_layer("n1", layer, start, k, v)
        sender.finish("n1")
        rx.wait_for_all("n1", 30)
        sender.wait_for_save("n1", 30)
        assert sender.nixl_bytes == 2 * LAYERS * (tokens - start) * HEADS * DIM * 4
        assert sender.nixl_fallbacks == 0
        assert max(most) <= (window or LAYERS) and sender._posted == 0 and sender.nixl_transfers <= LAYERS
        for layer, (k, v) in sent.items():
            assert torch.equal(kv[layer][0].view(-1, HEADS, DIM)[slots], k)
            assert torch.equal(kv[layer][1].view(-1, HEADS, DIM)[slots], v)
    finally:
        sender.close()
        rx.close()


def test_nixl_posts_queued_layers_as_one_transfer():
    """With one transfer in flight, the layers saved while it flies are posted together
    as one transfer when it lands; every layer still lands and is noticed."""
    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlKVReceiver, NixlKVSender

    kv = _caches()
    rx = NixlKVReceiver(kv, secret=SECRET)
    sender = NixlKVSender(writes_in_flight=1, secret=SECRET)
    try:
        dest = KVDestination("n1", rx.address, LAYOUTS["fragmented"], BLOCK, 0, 30)
        slots = destination_slots(dest, 0, 30)
        rx.expect(dest, slots, LAYERS, deadline_s=30)
        sender.begin(dest, LAYERS)
        sent = [(torch.randn(30, HEADS, DIM), torch.randn(30, HEADS, DIM)) for _ in range(LAYERS)]
        with sender._count_lock:
            lane = sender._lane(dest.address)
        with lane.lock:  # the sender thread cannot settle layer 0 before all are saved
            for layer, (k, v) in enumerate(sent):
                sender.save_layer("n1", layer, 0, k, v)
            assert sender.nixl_transfers == 1 and len(sender._unposted) == LAYERS - 1
        sender.finish("n1")
        rx.wait_for_all("n1", 30)
        sender.wait_for_save("n1", 30)
        assert sender.nixl_transfers == 2 and sender.nixl_fallbacks == 0 and sender._posted == 0
        assert sender.nixl_bytes == 2 * LAYERS * 30 * HEADS * DIM * 4
        for layer, (k, v) in enumerate(sent):
            assert torch.equal(kv[layer][0].view(-1, HEADS, DIM)[slots], k)
            assert torch.equal(kv[layer][1].view(-1, HEADS, DIM)[slots], v)
    finally:
        sender.close()
        rx.close()


def test_nixl_layers_queued_past_the_lease_are_not_written_in_place():
    """A layer saved within the receiver's lease but queued behind earlier WRITEs until past it
    is never posted as a WRITE (the blocks may be another request's by then): its frame goes over
    TCP, which the receiver lands only while it still expects the transfer."""
    import time

    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlKVReceiver, NixlKVSender

    kv = _caches()
    rx = NixlKVReceiver(kv, secret=SECRET)
    sender = NixlKVSender(writes_in_flight=1, secret=SECRET)
    try:
        dest = KVDestination("n1", rx.address, LAYOUTS["consecutive"], BLOCK, 0, 30, expires_unix=time.time() + 60)
        slots = destination_slots(dest, 0, 30)
        rx.expect(dest, slots, LAYERS, deadline_s=30)
        sender.begin(dest, LAYERS)
        sent = [(torch.randn(30, HEADS, DIM), torch.randn(30, HEADS, DIM)) for _ in range(LAYERS)]
        with sender._count_lock:
            lane = sender._lane(dest.address)
        with lane.lock:  # layers 1.. wait behind layer 0's WRITE
            for layer, (k, v) in enumerate(sent):
                sender.save_layer("n1", layer, 0, k, v)
            assert sender.nixl_transfers == 1 and len(sender._unposted) == LAYERS - 1
            sender._transfers["n1"].dest.expires_unix = time.time()  # the lease ran out meanwhile
        sender.finish("n1")
        rx.wait_for_all("n1", 30)
        sender.wait_for_save("n1", 30)
        assert sender.nixl_transfers == 1 and sender.nixl_fallbacks == LAYERS - 1
        for layer, (k, v) in enumerate(sent):  # (still expected here: the TCP frames landed)
            assert torch.equal(kv[layer][0].view(-1, HEADS, DIM)[slots], k)
            assert torch.equal(kv[layer][1].view(-1, HEADS, DIM)[slots], v)
    finally:
        sender.close()
        rx.close()


def test_nixl_agents_are_built_with_a_progress_thread_that_pauses():
    """NIXL's Python agent asks for a progress thread that never pauses (one core spun per
    agent); make_agent hands it a config whose pthrDelay cannot go below ours."""
    nixl = pytest.importorskip("pdserve.transfer.nixl")
    if not nixl.nixl_available():
        pytest.skip("nixl-cu12 is not installed")
    import nixl_cu12._api as api

    original = api.nixlBind.nixlAgentConfig
    with nixl._progress_delay(75):
        cfg = api.nixlBind.nixlAgentConfig()
        cfg.pthrDelay = 0  # what nixl_agent writes
        assert cfg.pthrDelay == 75 and isinstance(cfg, original)
    assert api.nixlBind.nixlAgentConfig is original
    with nixl._progress_delay(0):
        assert api.nixlBind.nixlAgentConfig is original
    agent = nixl.make_agent("test-delay", progress_delay_us=75)
    assert agent.name.startswith("test-delay-")


def _shm_transfer(paths, sender, between_layers=None, rx=None, kv=None):
    """One 30-token transfer over shared memory; returns (sender stats, frames before done)."""
    kv = kv or _caches(paths)
    rx = rx or KVReceiverServer(kv, scheme="shm", secret=SECRET, shm_paths=paths)
    tokens = 30
    dest = KVDestination(
        "t1",
        rx.address,
        LAYOUTS["consecutive"],
        BLOCK,
        0,
        tokens,
        shm_paths=paths,
        shm_shape=[BLOCKS, BLOCK, HEADS, DIM],
        shm_dtype="float32",
    )
    rx.expect(dest, destination_slots(dest, 0, tokens), LAYERS, deadline_s=30)
    sender.begin(dest, LAYERS)
    sent = []
    for layer in range(LAYERS):
        if between_layers:
            between_layers(layer)
        k, v = torch.randn(tokens, HEADS, DIM), torch.randn(tokens, HEADS, DIM)
        sent.append((k, v))
        sender.save_layer("t1", layer, 0, k, v)
    frames = len(sender._transfers["t1"].frames)
    sender.finish("t1")
    rx.wait_for_all("t1", 30)
    stats = sender.wait_for_save("t1", 30)
    s = destination_slots(dest, 0, tokens)
    for layer, (k, v) in enumerate(sent):
        assert torch.equal(kv[layer][0].view(-1, HEADS, DIM)[s], k)
        assert torch.equal(kv[layer][1].view(-1, HEADS, DIM)[s], v)
    sender.close()
    rx.close()
    return stats, frames


def test_shm_notices_sent_inline_survive_a_broken_connection(shm_paths):
    """The shared-memory sender writes layer notices from the caller's thread while the
    sender thread is idle; a connection that breaks under it sends the notice through
    the thread instead, which reconnects and resends, and the transfer still completes."""
    import time

    sender = ShmKVSender(notice_gap_s=0, secret=SECRET)  # a notice per layer

    def between(layer):
        deadline = time.monotonic() + 10
        while sender._queued and time.monotonic() < deadline:  # the thread drains, as between layers
            time.sleep(0.01)  # a prefill apart
        if layer == 1:  # the connection breaks between two inline notices
            sender._socks[next(iter(sender._socks))].shutdown(socket.SHUT_RDWR)

    stats, frames = _shm_transfer(shm_paths, sender, between)
    assert frames == LAYERS
    assert sender.inline_frames >= 2  # the last layer's notice and the done frame
    assert stats.retries >= 1 and stats.layers == LAYERS


def test_shm_notices_of_a_burst_name_several_layers(shm_paths):
    """Layers landing faster than the notice gap wait for one notice that names them all."""
    sender = ShmKVSender(notice_gap_s=60, secret=SECRET)
    stats, frames = _shm_transfer(shm_paths, sender)
    assert frames == 1  # layer 0 alone; the others go with the done frame's notice
    assert stats.layers == LAYERS and stats.retries == 0


@pytest.mark.parametrize("transport", ["tcp", "shm", "pull"])
def test_sender_abort_reaches_the_receiver(transport, shm_paths):
    """A transfer the prefill side gives up on is failed on the decode side at once (its
    blocks can be freed), not held until the receiver's deadline."""
    import time

    from pdserve.transfer.connector import KVTransferError

    paths = shm_paths if transport == "shm" else []
    kv = _caches(paths)
    rx = KVReceiverServer(kv, scheme="shm" if paths else "tcp", secret=SECRET, shm_paths=paths)
    sender = {"shm": ShmKVSender, "tcp": TcpKVSender, "pull": PullKVExporter}[transport](secret=SECRET)
    dest = KVDestination(
        "t1",
        rx.address,
        LAYOUTS["consecutive"],
        BLOCK,
        0,
        30,
        pull=transport == "pull",
        shm_paths=paths,
        shm_shape=[BLOCKS, BLOCK, HEADS, DIM] if paths else [],
        shm_dtype="float32" if paths else "",
    )
    rx.expect(dest, destination_slots(dest, 0, 30), LAYERS, deadline_s=60)
    if transport == "pull":
        rx.pull(sender.address, "t1")
    sender.begin(dest, LAYERS)
    sender.save_layer("t1", 0, 0, torch.randn(30, HEADS, DIM), torch.randn(30, HEADS, DIM))
    sender.abort("t1", "the request was cancelled")
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="aborted: the request was cancelled"):
        rx.wait_for_all("t1", 30)
    assert time.monotonic() - t0 < 10
    sender.close()
    rx.close()


def test_malformed_notices_close_their_connection_only(shm_paths):
    """A notice naming several layers must be in place and name valid layers; a peer that
    sends anything else loses its connection, and a transfer on another connection lands."""
    import socket as socketlib

    kv = _caches(shm_paths)
    rx = KVReceiverServer(kv, scheme="shm", secret=SECRET, shm_paths=shm_paths)
    dest = KVDestination(
        "t1",
        rx.address,
        LAYOUTS["consecutive"],
        BLOCK,
        0,
        30,
        shm_paths=shm_paths,
        shm_shape=[BLOCKS, BLOCK, HEADS, DIM],
        shm_dtype="float32",
    )
    rx.expect(dest, destination_slots(dest, 0, 30), LAYERS, deadline_s=30)
    host, port = rx.address.split("://")[1].rsplit(":", 1)
    for bad in (
        {"op": "layer", "tid": "t1", "start": 0, "n": 30, "layers": [0, 1]},  # not in place
        {"op": "layer", "tid": "t1", "start": 0, "n": 30, "inplace": True, "layers": ["x"]},
        {"op": "layer", "tid": "t1", "start": 0, "n": 30, "inplace": True, "layers": [LAYERS]},
    ):
        with socketlib.create_connection((host, int(port))) as s:
            auth.kv_connect(s, SECRET)
            wire.send_frame(s, bad)
            s.settimeout(10)
            assert s.recv(1) == b""  # the receiver closed this connection
    assert not rx.is_complete("t1")
    stats, _ = _shm_transfer(shm_paths, ShmKVSender(notice_gap_s=60, secret=SECRET), rx=rx, kv=kv)
    assert stats.layers == LAYERS


def _wait(cond, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_pull_exporter_lets_go_of_silent_and_abandoned_pullers(monkeypatch):
    """An authenticated puller that never names its transfer, or one whose transfer the prefill
    worker gave up on, does not hold an exporter thread (and the transfer's frames) forever."""
    import pdserve.transfer.pull as pull

    monkeypatch.setattr(pull, "PULL_WAIT_S", 0.5)
    exporter = PullKVExporter(secret=SECRET)
    host, port = exporter.address.removeprefix("tcp://").rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=5)
    auth.kv_connect(silent, SECRET)
    _wait(lambda: exporter._listener.active == 1)
    _wait(lambda: exporter._listener.active == 0)  # no pull request within PULL_WAIT_S
    silent.close()

    dest = KVDestination("t1", "tcp://127.0.0.1:1", LAYOUTS["consecutive"], BLOCK, 0, 30, pull=True)
    exporter.begin(dest, LAYERS)
    exporter.save_layer("t1", 0, 0, torch.randn(30, HEADS, DIM), torch.randn(30, HEADS, DIM))
    puller = socket.create_connection((host, int(port)), timeout=5)
    auth.kv_connect(puller, SECRET)
    wire.send_frame(puller, {"op": "pull", "tid": "t1"})
    first = wire.recv_header(puller)
    assert first["op"] == "layer"
    wire.recv_exact(puller, memoryview(bytearray(first["nbytes"])))
    with pytest.raises(KVTransferError, match="nobody pulled"):
        exporter.wait_for_save("t1", timeout_s=0.2)  # the prefill worker gives up on it
    end = wire.recv_header(puller)
    assert end["op"] == "abort" and "gave up" in end["reason"]
    _wait(lambda: exporter._listener.active == 0)
    puller.close()
    exporter.close()


def test_pull_exporter_lease_keeps_transfers_still_streaming():
    """The lease drops transfers nobody waited for, only once finished: a prompt that computes for
    longer than the lease keeps its transfer (it once lost it and its layers raised KeyError)."""
    import time

    exporter = PullKVExporter(secret=SECRET, lease_s=0.05)
    try:
        exporter.begin(KVDestination("long", "tcp://127.0.0.1:1", LAYOUTS["consecutive"], BLOCK, 0, 30), LAYERS)
        exporter.begin(KVDestination("done", "tcp://127.0.0.1:1", LAYOUTS["consecutive"], BLOCK, 0, 30), LAYERS)
        exporter.finish("done")
        time.sleep(0.1)
        exporter.begin(KVDestination("next", "tcp://127.0.0.1:1", LAYOUTS["consecutive"], BLOCK, 0, 30), LAYERS)
        assert set(exporter._transfers) == {"long", "next"}
        exporter.save_layer("long", 0, 0, torch.randn(30, HEADS, DIM), torch.randn(30, HEADS, DIM))
    finally:
        exporter.close()


def test_nixl_receiver_that_does_not_answer_stalls_the_engine_thread_once(monkeypatch):
    """The metadata fetch runs on the prefill worker's engine thread: a receiver that accepts and
    never answers (stopped, cut off) costs METADATA_TIMEOUT_S once, then fails its transfers at
    once for METADATA_RETRY_S."""
    import time

    pytest.importorskip("nixl_cu12")
    import pdserve.transfer.nixl as nixl
    from pdserve.transfer.nixl import NixlKVSender

    monkeypatch.setattr(nixl, "METADATA_TIMEOUT_S", 0.5)
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(8)  # the kernel accepts; nothing ever answers the handshake
    sender = NixlKVSender(secret=SECRET)
    dest = KVDestination("t1", f"nixl://127.0.0.1:{mute.getsockname()[1]}", LAYOUTS["consecutive"], BLOCK, 0, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="did not complete authentication in time"):
            sender.begin(dest, LAYERS)
        assert 0.4 < time.monotonic() - t0 < 3
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match="not asked again"):
            sender.begin(KVDestination("t2", dest.address, dest.block_ids, BLOCK, 0, 30), LAYERS)
        assert time.monotonic() - t0 < 0.1
    finally:
        sender.close()
        mute.close()
