"""The embedded model, disaggregated in-process: output equals collocated for prompts of 10 to
3,000 tokens, over every transport and mode (push/pull, layer-wise/eager, incremental)."""

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.transfer.bridge import PrefillBridge
from pdserve.transfer.pull import PullKVExporter
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import ShmKVSender, TcpKVSender

pytestmark = pytest.mark.integration

SECRET = b"real-model-test-secret-0123"

LENGTHS = (10, 3000)
MAX = 8


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def engines():
    p = LLM(dtype="float32", max_num_batched_tokens=4096, num_gpu_blocks=640).engine
    d = LLM(dtype="float32", max_num_batched_tokens=4096, num_gpu_blocks=640, kv_cache_shm_dir="/dev/shm").engine
    return p, d


@pytest.fixture(scope="module")
def reference(engines, prompts):
    p, _ = engines
    outs = []
    for i, ids in enumerate(prompts):
        p.add_request(f"ref{i}", ids, SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True))
    finals = {}
    while p.has_unfinished_requests():
        finals.update({o.request_id: o for o in p.step() if o.finished})
    outs = [finals[f"ref{i}"].outputs[0].token_ids for i in range(len(prompts))]
    p.block_manager.reset_prefix_cache()
    return outs


def _run(p, d, rx, ids, rid, pull_from=None):
    params = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)
    dest = d.reserve_for_transfer(rid, ids, params, rx, deadline_s=120)
    if pull_from is not None:
        dest.pull = True
        rx.pull(pull_from.address, rid)
    p.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=1), kv_destination=dest)
    first = None
    while p.has_unfinished_requests():
        for o in p.step():
            first = o.outputs[0].token_ids[0]
    p.bridge.sender.wait_for_save(rid, 120)
    rx.wait_for_all(rid, 120)
    rx.cancel(rid)
    out = d.activate_transferred(rid, first, kv_complete=True)
    while d.has_unfinished_requests():
        for o in d.step():
            out = o
    return out.outputs[0].token_ids


@pytest.mark.parametrize("transport, layerwise", [("tcp", True), ("tcp", False), ("shm", True), ("pull", True)])
def test_every_transport_matches_collocated(engines, prompts, reference, transport, layerwise):
    p, d = engines
    exporter = None
    if transport == "pull":
        exporter = sender = PullKVExporter(secret=SECRET)
    else:
        sender = TcpKVSender(secret=SECRET) if transport == "tcp" else ShmKVSender(secret=SECRET)
    rx = KVReceiverServer(
        d.runner.kv_caches,
        scheme="shm" if transport == "shm" else "tcp",
        secret=SECRET,
        shm_paths=d.runner.kv_shm_paths,
    )
    p.bridge = PrefillBridge(sender, p.model_config.num_hidden_layers, layerwise)
    try:
        for i, ids in enumerate(prompts):
            got = _run(p, d, rx, ids, f"{transport}{layerwise}{i}", pull_from=exporter)
            assert got == reference[i], f"{len(ids)}-token prompt over {transport}"
            p.block_manager.reset_prefix_cache()
            d.block_manager.reset_prefix_cache()
    finally:
        rx.close()
        sender.close()
    assert d.num_free_blocks == d.block_manager.num_blocks and p.num_free_blocks == p.block_manager.num_blocks


def test_incremental_with_a_cached_prefix(engines, prompts, reference):
    p, d = engines
    sender = TcpKVSender(secret=SECRET)
    rx = KVReceiverServer(d.runner.kv_caches, secret=SECRET)
    p.bridge = PrefillBridge(sender, p.model_config.num_hidden_layers)
    ids = prompts[1]
    assert _run(p, d, rx, ids, "inc-a") == reference[1]
    first_bytes = sender.total_bytes
    assert _run(p, d, rx, ids, "inc-b") == reference[1]
    assert sender.total_bytes - first_bytes < first_bytes / 10  # only the last partial block moved
    rx.close()
    sender.close()
