"""Steps are timed once, by the engine: its step observers (the step trace, the live and the
start-up calibration) all read the same record, and nothing replaces `LLMEngine.step`."""

import asyncio

from pdserve import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.step_trace import StepTraceWriter, read
from pdserve.server.async_engine import AsyncEngine
from pdserve.server.calibrate import DecodeStepRecorder, measure_prefill
from pdserve.server.engine_client import EngineInput
from pdserve.server.metrics import ServerMetrics
from pdserve.sim.calibrate import _Driver

GREEDY3 = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def test_every_observer_gets_the_same_step_records(tiny_llm, tmp_path):
    eng = tiny_llm.engine
    seen = []
    eng.add_step_observer(seen.append)
    recorder = DecodeStepRecorder(eng)
    trace = StepTraceWriter(str(tmp_path / "steps.jsonl"))
    eng.add_step_observer(trace.record)
    assert "step" not in vars(eng)  # the engine's own step, not a wrapper

    eng.add_request("a", list(range(1, 11)), GREEDY3)
    while eng.has_unfinished_requests():
        eng.step()
    assert [r.rows for r in seen] == [[[0, 10, 0]], [[10, 1, 1]], [[11, 1, 1]]]
    assert [r.idle for r in seen] == [True, False, False]  # it waited for work before the first
    assert all(r.t1 >= r.t0 and r.cpu_s >= 0 and not r.calibration for r in seen)
    assert recorder.recent() == [(1, 11, seen[1].seconds), (1, 12, seen[2].seconds)]
    assert list(recorder.prefill_samples) == [([(0, 10)], seen[0].seconds)]
    assert eng.step() == [] and len(seen) == 3  # a step that ran nothing is no record

    # calibration steps are marked, and the step trace (of served steps) leaves them out
    measure_prefill(eng, lengths_tokens=(8,), repeats=1)
    assert len(seen) == 4 and seen[-1].calibration and not eng.calibrating
    eng.add_request("b", list(range(20, 26)), GREEDY3)
    while eng.has_unfinished_requests():
        eng.step()
    trace.close()
    recs = read(str(tmp_path / "steps.jsonl"))
    assert [r["seqs"] for r in recs] == [r.rows for r in seen if not r.calibration]
    assert [r["idle"] for r in recs] == [True, False, False, True, False, False]
    assert [(r["t0"], r["t1"]) for r in recs] == [(round(r.t0, 6), round(r.t1, 6)) for r in seen if not r.calibration]

    recorder.close()
    eng.remove_step_observer(seen.append)
    eng.remove_step_observer(trace.record)
    eng.add_request("c", [3, 4, 5], GREEDY3)
    while eng.has_unfinished_requests():
        eng.step()
    assert len(seen) == 7 and len(recorder.recent()) == 4


def test_the_simulator_calibration_takes_its_samples_from_the_step_records(tiny_llm):
    eng = tiny_llm.engine
    seen = []
    eng.add_step_observer(seen.append)
    d = _Driver(eng)
    d.add(10, 3)
    d.step(record=False)  # its prompt
    d.add(6, 1)
    d.drain()
    assert [r.rows for r in seen] == [[[0, 10, 0]], [[10, 1, 1], [0, 6, 0]], [[11, 1, 1]]]
    assert [dt for _, dt in d.samples] == [seen[1].seconds, seen[2].seconds]
    joined, alone = d.samples[0][0], d.samples[1][0]
    assert (joined.decode_seqs, joined.decode_context, joined.prefill_tokens, joined.prefill_seqs) == (1, 10, 6, 1)
    assert (alone.decode_seqs, alone.decode_context, alone.prefill_tokens) == (1, 11, 0)


def test_a_served_engine_traces_its_served_steps_only(tiny_model_dir, tmp_path):
    """The server's engine thread has the step trace observe the engine: every step it runs for
    requests is in the trace, with `idle` where it waited for work; calibration steps are not."""
    path = str(tmp_path / "steps.jsonl")

    def make_engine():
        return LLMEngine(
            EngineConfig.from_kwargs(model=tiny_model_dir, dtype="float32", block_size=4, num_gpu_blocks=256)
        )

    async def main():
        engine = AsyncEngine(make_engine, ServerMetrics, step_trace=StepTraceWriter(path))
        engine.start()
        await engine.ready.wait()
        assert len(await engine.calibrate_prefill()) == 3
        for prompt in (list(range(1, 11)), list(range(30, 36))):
            group = engine.submit([EngineInput(prompt, GREEDY3)])
            await group.accepted()
            while await group.next_batch() is not None:
                pass
        await engine.shutdown()

    asyncio.run(main())
    recs = read(path)
    assert [r["seqs"] for r in recs] == [
        [[0, 10, 0]],
        [[10, 1, 1]],
        [[11, 1, 1]],
        [[0, 6, 0]],
        [[6, 1, 1]],
        [[7, 1, 1]],
    ]
    assert [r["idle"] for r in recs] == [True, False, False, True, False, False]
