"""A decode worker's `RemoteDecode` through each of its ways, on the tiny model's real engine
(in its engine thread) and a real KV receiver: the KV never comes, breaks on the way, outlives
its lease, or its router leaves; the states it passes and what the router is told."""

import asyncio

import pytest

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.control_api import DecodeRequest, parse_event
from pdserve.engine.llm_engine import LLMEngine
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.errors import APIError
from pdserve.server.metrics import ServerMetrics
from pdserve.transfer.receiver import KVReceiverServer
from pdserve.transfer.sender import TcpKVSender
from pdserve.worker.decode import NEXT, DecodeState, RemoteDecode

S = DecodeState
PROMPT = list(range(5, 30))
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _run(tiny_model_dir, scenario):
    """Run `scenario(engine, receiver)` on an AsyncEngine of the tiny model; its result."""
    made = {}

    def make_engine():
        made["e"] = LLMEngine(
            EngineConfig.from_kwargs(model=tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64)
        )
        return made["e"]

    async def main():
        engine = AsyncEngine(make_engine, ServerMetrics)
        engine.start()
        await engine.ready.wait()
        receiver = KVReceiverServer(made["e"].runner.kv_caches, secret=b"s" * 16)
        try:
            return await scenario(engine, receiver), made["e"]
        finally:
            receiver.close()
            await engine.shutdown()

    return asyncio.run(main())


async def _reserve(engine, receiver, rid="r"):
    dest = await engine.reserve_for_transfer(f"{rid}-0", PROMPT, PARAMS, receiver, deadline_s=30)
    assert dest is not None


def _decode(engine, receiver, kv_expected=True, first_token=None, rid="r"):
    body = DecodeRequest(request_id=rid, first_token=first_token, kv_expected=kv_expected, timeout_s=30)
    return RemoteDecode(engine, receiver, body, max_wait_s=60)


async def _never():
    await asyncio.Event().wait()


async def _tokens(d: RemoteDecode) -> list[int]:
    evs = [parse_event(line) async for line in d.events()]
    assert evs[0].event == "kv" and evs[0].ok == d.kv_ok and evs[-1].finished
    return [t for e in evs[1:] for t in e.token_ids]


def _reference(tiny_model_dir) -> list[int]:
    from pdserve import LLM

    llm = LLM(tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64)
    return llm.generate([PROMPT], PARAMS)[0].outputs[0].token_ids


def test_without_the_kv_it_recomputes_the_prompt_and_decodes_the_same_tokens(tiny_model_dir):
    async def scenario(engine, receiver):
        await _reserve(engine, receiver)
        d = _decode(engine, receiver, kv_expected=False)
        await d.start(_never)
        assert d.state is S.DECODING
        tokens = await _tokens(d)
        return d.state, tokens

    (state, tokens), eng = _run(tiny_model_dir, scenario)
    assert state is S.DONE and tokens == _reference(tiny_model_dir)
    assert eng.num_free_blocks == eng.block_manager.num_blocks


def test_with_the_kv_landed_it_decodes_from_it(tiny_model_dir):
    prefill = LLMEngine(
        EngineConfig.from_kwargs(model=tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=64),
        kv_sender=TcpKVSender("none", secret=b"s" * 16),
    )

    async def scenario(engine, receiver):
        dest = await engine.reserve_for_transfer("r-0", PROMPT, PARAMS, receiver, deadline_s=30)
        prefill.add_request("r-0", PROMPT, SamplingParams(temperature=0, max_tokens=1), kv_destination=dest)
        outs = []
        while prefill.has_unfinished_requests():
            outs += prefill.step()
        await asyncio.to_thread(prefill.bridge.sender.wait_for_save, "r-0", 30)
        d = _decode(engine, receiver, first_token=outs[-1].new_token_ids[0])
        await d.start(_never)
        return outs[-1].new_token_ids + await _tokens(d), d.kv_ok

    try:
        (tokens, kv_ok), eng = _run(tiny_model_dir, scenario)
    finally:
        prefill.bridge.sender.close()
    assert kv_ok and tokens == _reference(tiny_model_dir)
    assert eng.num_free_blocks == eng.block_manager.num_blocks


def test_a_transfer_that_breaks_while_it_waits_is_recomputed(tiny_model_dir):
    async def scenario(engine, receiver):
        await _reserve(engine, receiver)
        d = _decode(engine, receiver)
        asyncio.get_running_loop().call_later(0.2, receiver.fail, "r-0", "the sender's link broke")
        seen = []
        start = asyncio.ensure_future(d.start(_never))
        while not start.done():
            seen.append(d.state)
            await asyncio.sleep(0.01)
        await start
        evs = [parse_event(line) async for line in d.events()]
        return seen, evs

    (seen, evs), eng = _run(tiny_model_dir, scenario)
    assert S.WAITING_FOR_KV in seen
    assert evs[0].event == "kv" and not evs[0].ok  # the router counts a recompute
    assert [t for e in evs[1:] for t in e.token_ids] == _reference(tiny_model_dir)
    assert eng.num_free_blocks == eng.block_manager.num_blocks


def test_a_lease_gone_before_the_decode_tells_the_router_to_recompute(tiny_model_dir):
    async def scenario(engine, receiver):
        await _reserve(engine, receiver)
        assert await engine.expire_reservations(everything=True) == ["r-0"]
        d = _decode(engine, receiver)
        with pytest.raises(APIError) as e:
            await d.start(_never)
        return d.state, e.value

    (state, err), eng = _run(tiny_model_dir, scenario)
    assert state is S.EXPIRED and (err.status, err.code) == (404, "reservation_expired")
    assert eng.num_free_blocks == eng.block_manager.num_blocks


def test_a_router_that_leaves_while_the_kv_is_on_its_way_frees_the_blocks(tiny_model_dir):
    async def gone():
        await asyncio.sleep(0.05)

    async def scenario(engine, receiver):
        await _reserve(engine, receiver)
        d = _decode(engine, receiver)
        with pytest.raises(APIError) as e:
            await d.start(gone)
        return d.state, e.value

    (state, err), eng = _run(tiny_model_dir, scenario)
    assert state is S.ABANDONED and err.status == 499
    assert eng.num_free_blocks == eng.block_manager.num_blocks


def test_every_state_is_reachable_and_the_ends_lead_nowhere():
    reached = {S.RESERVED} | {s for targets in NEXT.values() for s in targets}
    assert reached == set(DecodeState)
    assert all(not NEXT[s] for s in (S.DONE, S.EXPIRED, S.ABANDONED))
