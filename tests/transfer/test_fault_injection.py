"""The KV sender's injected faults, in one process: parsed strictly, armed at run time,
and each healed by the real reconnect-and-resend path (tests/transfer/test_faults.py
runs them across real worker processes)."""

from __future__ import annotations

import logging

import pytest
import torch

from pdserve.faults import parse as parse_faults
from pdserve.kv.shm_files import new_kv_paths
from pdserve.transfer.auto import AutoKVSender
from pdserve.transfer.connector import KVDestination
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import ShmKVSender, TcpKVSender, destination_slots
from tests.transfer.test_kv_auth import BLOCK, BLOCKS, DIM, HEADS, LAYERS, SECRET, TOKENS, assert_landed, caches


def test_parse_faults():
    assert parse_faults("cut_at_layer=3,stall_at_layer=1:2.5, corrupt_at_layer=0,delay_prefill=0:1") == {
        "cut_at_layer": (3, 0.0),
        "stall_at_layer": (1, 2.5),
        "corrupt_at_layer": (0, 0.0),
        "delay_prefill": (0, 1.0),
    }
    assert parse_faults(None) == parse_faults("") == {}
    for bad in ("cut_at_layr=1", "cut_at_layer=x", "stall_at_layer=1:soon"):
        with pytest.raises(ValueError):
            parse_faults(bad)


def test_inject_fault_merges_sender_faults_only(monkeypatch):
    monkeypatch.setenv("PDSERVE_KV_FAULT", "stall_at_layer=5:1,delay_prefill=0:1")
    sender = AutoKVSender(secret=SECRET)
    try:
        assert sender.tcp.faults == {"stall_at_layer": (5, 1.0)}  # the worker's own fault is not the sender's
        sender.inject_fault("corrupt_at_layer=1")
        assert sender.shm.faults is sender.tcp.faults  # one set: each fault fires once, whichever transport
        assert sender.tcp.faults == {"stall_at_layer": (5, 1.0), "corrupt_at_layer": (1, 0.0)}
        for bad in ("delay_prefill=0:1", "nope=1", "cut_at_layer=one"):
            with pytest.raises(ValueError):
                sender.inject_fault(bad)
    finally:
        sender.close()


@pytest.mark.parametrize("layer", [0, LAYERS - 1])
@pytest.mark.parametrize("fault", ["corrupt_at_layer", "cut_at_layer"])
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_injected_fault_heals(transport, fault, layer, tmp_path, caplog):
    """A frame header of garbage at layer K: the receiver drops that connection with a clear
    line, the sender reconnects and resends, and the transfer completes, every byte in place.
    A cut connection heals the same way."""
    caplog.set_level(logging.INFO, "pdserve.transfer")
    paths = new_kv_paths(str(tmp_path), LAYERS) if transport == "shm" else []
    kv = caches(paths)
    rx = KVReceiverServer(kv, scheme=transport, secret=SECRET, shm_paths=paths)
    sender = ShmKVSender(secret=SECRET, shm_dir=str(tmp_path)) if transport == "shm" else TcpKVSender(secret=SECRET)
    try:
        sender.inject_fault(f"{fault}={layer}")
        dest = KVDestination(
            "t1",
            rx.address,
            list(range(2, BLOCKS)),
            BLOCK,
            0,
            TOKENS,
            shm_paths=paths,
            shm_shape=[BLOCKS, BLOCK, HEADS, DIM] if paths else [],
            shm_dtype="float32" if paths else "",
        )
        rx.expect(dest, destination_slots(dest, 0, TOKENS), LAYERS, deadline_s=60)
        data = [(torch.randn(TOKENS, HEADS, DIM), torch.randn(TOKENS, HEADS, DIM)) for _ in range(LAYERS)]
        sender.begin(dest, LAYERS)
        for i, (k, v) in enumerate(data):
            sender.save_layer("t1", i, 0, k, v)
        sender.finish("t1")
        stats = sender.wait_for_save("t1", 30)
        rx.wait_for_all("t1", 30)
        assert_landed(kv, dest, data)
        assert stats.retries >= 1 and not sender.faults  # it fired, once
        if fault == "corrupt_at_layer":
            lines = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
            assert any(
                m.startswith("closing the KV connection with 127.0.0.1:") and "bad frame: frame header is not JSON" in m
                for m in lines
            ), lines
    finally:
        sender.close()
        rx.close()
