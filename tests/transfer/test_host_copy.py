"""pdserve/transfer/host_copy.py on CPU caches: the no-copy path, which must still round-trip."""

import pytest
import torch

from pdserve.transfer import host_copy, wire


def test_cpu_tensors_pass_through_unchanged():
    x = torch.randn(5, 2, 8, dtype=torch.bfloat16)
    assert host_copy.to_host(x) is x  # no copy added on the CPU path
    assert host_copy.to_device(x, torch.device("cpu")) is x
    assert host_copy.receives_in_place(x)


def test_round_trip_through_the_wire_layout():
    """Gather rows out of a cache, stage them for the socket, rebuild them from the raw bytes
    a receiver holds, land them in another cache: the rows come back bit for bit."""
    cache = torch.randn(64, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([3, 4, 5, 40, 41])
    rows = host_copy.to_host(cache.index_select(0, slots))
    payload, fields = wire.encode(rows, "none")
    raw = torch.cat([p.contiguous().view(torch.uint8).flatten() for p in payload])
    back, _ = wire.decode(raw, fields, tuple(rows.shape), 0)
    target = torch.zeros_like(cache)
    wire.copy_into_slots(target, torch.tensor([0, 1, 2, 9, 10]), host_copy.to_device(back, target.device))
    assert torch.equal(target[[0, 1, 2, 9, 10]].view(torch.int16), cache[slots].view(torch.int16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_rows_stage_through_pinned_host_memory():
    x = torch.randn(7, 2, 16, device="cuda", dtype=torch.bfloat16)
    host = host_copy.to_host(x)
    assert not host.is_cuda and host.is_pinned()
    assert torch.equal(host, x.cpu())
    assert not host_copy.receives_in_place(x)
    assert torch.equal(host_copy.to_device(host, x.device), x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_shared_memory_sender_refuses_cuda_rows():
    from pdserve import auth
    from pdserve.transfer.connector import KVTransferError
    from pdserve.transfer.sender import ShmKVSender

    sender = ShmKVSender(secret=b"s" * auth.MIN_SECRET_BYTES)
    try:
        x = torch.zeros(2, 2, 8, device="cuda")
        with pytest.raises(KVTransferError, match="host tensors"):
            sender.save_layer("t", 0, 0, x, x)
    finally:
        sender.close()
