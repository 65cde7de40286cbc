"""KV from outside goes through the scheduler: a P->D reservation is admitted by the
scheduler's own rules, so a burst of transfers cannot starve the requests already queued."""

from __future__ import annotations

import time

import pytest

from pdserve import LLM, SamplingParams
from pdserve.engine.sequence import PENDING, Status
from pdserve.transfer.receiver import KVReceiverServer

SECRET = b"test-secret-0123456789"


@pytest.fixture
def decode_engine(tiny_model_dir):
    engine = LLM(
        tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=40, max_num_batched_tokens=64, max_num_seqs=8
    ).engine
    receiver = KVReceiverServer(engine.runner.kv_caches, secret=SECRET)
    yield engine, receiver
    receiver.close()


def test_a_burst_of_transfers_does_not_starve_a_queued_request(decode_engine):
    engine, receiver = decode_engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    # A request that runs here (a recompute after a lost transfer, a whole request the router
    # placed on this worker) is queued and needs 11 blocks ...
    engine.add_request("local", list(range(3, 43)), params)
    # ... when a burst of reservations for transfers arrives, 3 blocks each.
    admitted = [
        engine.reserve_for_transfer(f"t{i}", list(range(50 + i, 62 + i)), params, receiver, deadline_s=30)
        for i in range(12)
    ]
    n = sum(d is not None for d in admitted)
    assert 0 < n < 12
    # The queued request still gets its blocks at the very next step.
    out = engine.scheduler.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == ["local"]
    # Headroom is kept for the running sequences to grow into.
    assert engine.num_free_blocks >= engine.scheduler._headroom_blocks()


def test_reserved_requests_wait_for_remote_kv_and_free_on_abort(decode_engine):
    engine, receiver = decode_engine
    dest = engine.reserve_for_transfer("t", list(range(10, 30)), SamplingParams(max_tokens=4), receiver, deadline_s=30)
    assert dest is not None
    seq = engine.seqs["t"]
    assert seq.status is Status.WAITING_FOR_REMOTE_KV and engine.scheduler.remote["t"] is seq
    assert not engine.has_unfinished_requests()  # nothing to step until the KV is in
    engine.abort_request("t")
    assert not engine.scheduler.remote and engine.num_free_blocks == 40


@pytest.mark.parametrize("how", ["abort", "expire"])
def test_the_receiver_stops_writing_before_the_blocks_are_freed(decode_engine, monkeypatch, how):
    """A frame still on its way when a reservation ends must not land in blocks that another
    request may get next: the engine cancels the transfer while the blocks are still this
    reservation's, and only then frees them."""
    engine, receiver = decode_engine
    held_at_cancel = []
    cancel = receiver.cancel

    def watched(tid):
        held_at_cancel.append(engine.num_free_blocks < 40)
        cancel(tid)

    monkeypatch.setattr(receiver, "cancel", watched)
    engine.reserve_for_transfer("t", list(range(10, 30)), SamplingParams(max_tokens=4), receiver, deadline_s=30)
    if how == "abort":
        engine.abort_request("t")
    else:
        assert engine.expire_reservations(now=time.monotonic() + 60) == ["t"]
    assert held_at_cancel == [True] and engine.num_free_blocks == 40
    assert not engine._receivers


def test_admission_refuses_when_the_pool_is_short(decode_engine):
    engine, receiver = decode_engine
    params = SamplingParams(max_tokens=2)
    got = [
        engine.reserve_for_transfer(f"t{i}", list(range(10 + i, 30 + i)), params, receiver, deadline_s=30)
        for i in range(10)
    ]
    assert got[0] is not None and got[-1] is None
    # every refused reservation left nothing behind
    assert set(engine.scheduler.remote) == {f"t{i}" for i, d in enumerate(got) if d is not None}
    assert set(engine.block_manager.seqs) == set(engine.scheduler.remote)


def test_a_reservation_without_room_waits_in_line_and_gets_it(decode_engine):
    """No room now: the reservation waits (first come, first served) instead of failing, and
    is admitted as soon as a finished request frees blocks; a wait that runs out says so."""
    engine, receiver = decode_engine
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("running", list(range(3, 123)), params)  # 31 of the 40 blocks
    engine.step()
    engine.step()  # its prompt in two chunks of 64
    got = []
    r = engine.reserve_for_transfer(
        "t", list(range(150, 190)), params, receiver, deadline_s=30, wait_s=30, on_done=got.append
    )
    assert r is PENDING and not got
    late = []
    assert (
        engine.reserve_for_transfer(
            "u", list(range(100, 140)), params, receiver, deadline_s=30, wait_s=0.01, on_done=late.append
        )
        is PENDING
    )

    time.sleep(0.02)
    engine.retry_reservations()
    assert late == [None] and list(engine._pending_reserve) == ["t"]  # u's wait ran out, t waits on
    while engine.has_unfinished_requests():
        engine.step()
    assert got and got[0] is not None and got[0].num_tokens == 40  # admitted once "running" finished
    assert not engine.has_pending_reservations
    engine.cancel_reservation("t")
    assert engine.num_free_blocks == 40


def test_prompt_logprobs_come_when_the_prefill_worker_fails_and_a_prefix_is_cached_here(decode_engine):
    """A request that wants its prompt's logprobs keeps no cached prefix when it reserves: if
    its KV never comes, it computes the whole prompt here and the logprobs are complete (with a
    cached prefix kept, they were never emitted and the router answered 502)."""
    eng, receiver = decode_engine
    eng.logprob_objects = False
    prompt = list(range(20, 41))
    eng.add_request("warm", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0, prompt_logprobs=1)
    dest = eng.reserve_for_transfer("t", prompt, params, receiver, deadline_s=30)
    assert dest.start_token == 0  # nothing kept: the whole prompt is sent, or computed here
    eng.activate_transferred("t", None, kv_complete=False)  # the prefill worker failed
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == "t"]
    assert outs[-1].finished and len(outs[-1].prompt_logprobs) == len(prompt)
