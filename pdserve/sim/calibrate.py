"""`pdserve sim --calibrate`: time our engine's steps on this machine and fit a profile.

The engine (pdserve/engine/llm_engine.py, the embedded SmolLM2 unless told
otherwise) runs a grid of batches: prompts alone (32 to 1,024 tokens),
decode batches (1 to 8 sequences at 64 and 512 tokens of context), prompts
joining a running decode batch, and a 2,048-token prompt in chunks beside
decodes. Every step is timed with a wall
clock around `LLMEngine.step`, so sampling and bookkeeping are in it, and its
`StepShape` is read from the sequences' computed-token counts before and
after. `ProfileLatency.fit` then finds t = a + b*prefill_tokens +
c*decode_seqs + d*decode_context + e*prefill_attention (+ f when the step has
prompt tokens: another code path), weighted to minimise
relative error (a 12 ms decode step matters as much as a 4 s prefill). About a
minute on an idle machine.
"""
from __future__ import annotations

import time

from pdserve.sim.latency import ProfileLatency, StepShape

# Batches of the size a CPU engine serves (up to 8 sequences, prompts up to 2,048 tokens): the
# engine's kernels change regime with the batch, so a fit is only good where it was measured.
# (2,048-token prompts are measured joining a batch and in chunks; alone they only cost time)
PREFILL_LENGTHS = (32, 128, 512, 1024)
DECODE_GRID = ((1, 64), (2, 64), (4, 64), (6, 64), (8, 64), (1, 512), (4, 512))
MIXED_GRID = ((2, 256), (4, 1024), (6, 2048), (6, 512))  # (decode batch, joining prompt tokens)
CHUNKED_GRID = ((6, 256),)  # (decode batch, chunk tokens): a 2,048-token prompt in chunks
DECODE_STEPS = 6


def _shape(before: dict, seqs) -> StepShape:
    shape = StepShape()
    for seq in seqs:
        done = before[seq.seq_id]
        n = seq.num_computed_tokens - done
        if n <= 0:
            continue
        shape.add(done, n, decode=n == 1 and done >= seq.num_prompt_tokens)
    return shape


class _Driver:
    def __init__(self, engine):
        self.engine = engine
        self.samples: list[tuple[StepShape, float]] = []
        self.seqs = []
        self._n = 0
        self._vocab = engine.model_config.vocab_size

    def add(self, prompt_tokens: int, max_tokens: int):
        from pdserve.engine.sampling_params import SamplingParams

        self._n += 1
        # distinct ids per request: no prefix-cache hits in a calibration
        ids = [(self._n * 7919 + i * 31) % (self._vocab - 200) + 100 for i in range(prompt_tokens)]
        seq = self.engine.add_request(f"cal-{self._n}", ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                             temperature=0.0))
        self.seqs.append(seq)
        return seq

    def step(self, record: bool = True) -> None:
        before = {s.seq_id: s.num_computed_tokens for s in self.seqs}
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        if record:
            shape = _shape(before, self.seqs)
            if shape.tokens:
                self.samples.append((shape, dt))
        self.seqs = [s for s in self.seqs if not s.is_finished]

    def drain(self, record: bool = True) -> None:
        while self.engine.has_unfinished_requests():
            self.step(record)


def calibrate(threads: int = 1, model: str | None = None, log=print) -> ProfileLatency:
    from pdserve.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_kwargs(model=model, threads=threads, max_num_batched_tokens=8192,
                                                max_num_seqs=64, enable_chunked_prefill=True))
    d = _Driver(engine)
    for _ in range(4):  # warm-up: the first calls load kernels and allocate (decode and prefill paths)
        d.add(256, 8)
    d.drain(record=False)
    for n in PREFILL_LENGTHS:
        d.add(n, 1)
        d.drain()
    for batch, ctx in DECODE_GRID:
        for _ in range(batch):
            d.add(ctx, DECODE_STEPS + 1)
        d.drain()
    for batch, prompt in MIXED_GRID:
        for _ in range(batch):
            d.add(64, 4)
        d.step(record=False)  # their prefill
        d.add(prompt, 1)
        d.drain()
    # chunked prefill: later chunks attend to the earlier ones (the budget is read at every step)
    sc = engine.scheduler.config
    budget = sc.max_num_batched_tokens
    for batch, chunk in CHUNKED_GRID:
        for _ in range(batch):
            d.add(64, 64)
        d.step(record=False)
        sc.max_num_batched_tokens = chunk + batch
        d.add(2048, 1)
        d.drain()
        sc.max_num_batched_tokens = budget
    mc = engine.model_config
    dtype_bytes = 2 if engine.config.device.dtype in ("bfloat16", "float16") else 4
    prof = ProfileLatency.fit(d.samples, model_layers=mc.num_hidden_layers,
                              kv_bytes_per_token_=float(mc.kv_bytes_per_token(dtype_bytes)), threads=threads,
                              source=f"pdserve engine, {mc.name}, {engine.config.device.dtype}, "
                                     f"{threads} thread(s), {time.strftime('%Y-%m-%d %H:%M')}")
    prof.num_blocks = engine.block_manager.num_blocks
    prof.block_size = engine.block_manager.block_size
    log(f"calibrated on {len(d.samples)} steps in {time.perf_counter() - t0:.1f} s: "
        + ", ".join(f"{k}={v:.3g}" for k, v in zip(("a", "b", "c", "d", "e", "f"), prof.coef)))
    return prof
