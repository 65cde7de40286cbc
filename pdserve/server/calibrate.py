"""Start-up and live calibration of a worker's cost models (pdserve/costmodel.py; the router's
placement, admission and capacity decisions use them).

Prefill roles: D_prefill(L), the time to prefill L tokens, for the router's
placement score and TTFT prediction; reported in heartbeat stats as
`prefill_cost_s` [a, b, c] of a + b*L + c*L^2 and `prefill_tokens_per_s`
(Theta_P of the capacity ratio).

Decode roles: one decode step's time vs batch size and context, for the
router's TPOT prediction; reported as `decode_cost_s` [base, per_seq,
per_kv_token] and `decode_tokens_per_s` (Theta_D). The start-up fit gives the
shape; live steps (recorded by `DecodeStepRecorder`, an engine step observer)
rescale it to what the machine delivers under traffic.

Everything runs on the engine thread while no request is in flight.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from pdserve.costmodel import DecodeCostModel, PrefillCostModel, fit_prefill_cost
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import choice_request_id
from pdserve.engine.step_trace import StepRecord

LENGTHS_TOKENS = (16, 64, 256)  # short enough to cost well under a second on a CPU box
REPEATS = 2  # keep the fastest: the first run of a shape pays one-off warm-up
# (batch, context tokens per sequence) of the decode calibration: the corners of a
# small box, so base, per-sequence and per-context-token costs separate
DECODE_POINTS = ((1, 16), (8, 16), (1, 256), (8, 256), (4, 128))
DECODE_STEPS = 4  # timed steps per point; the median is kept
REFERENCE_TOKENS = 512  # Theta_P and Theta_D are quoted at this prompt / context length
REFERENCE_BATCH = 32  # ... and Theta_D at this batch (a loaded decode worker)
LIVE_SAMPLES = 128  # recent live decode steps kept for rescaling


class _Quiet:
    """Run calibration requests without leaving a trace: empty prefix cache (the
    router's index assumes a fresh worker holds nothing), no KV events, hit
    counters as they were (calibration is not traffic), nothing written to or
    looked up in the KV tiers, and steps marked as calibration (the step trace
    leaves them out)."""

    def __init__(self, engine):
        self.engine = engine
        self.bm = engine.block_manager

    def __enter__(self):
        self.saved = dataclasses.replace(self.bm.stats)
        self.computed = self.engine.num_prompt_tokens_computed
        self.tiers = self.bm.track_tiers, self.engine.scheduler.external
        self.bm.track_tiers, self.engine.scheduler.external = False, None
        self.calibrating, self.engine.calibrating = self.engine.calibrating, True
        return self

    def __exit__(self, *exc):
        self.bm.reset_prefix_cache()
        self.bm.drain_events()
        self.bm.drain_tier_moves()
        self.bm.stats = self.saved
        self.engine.num_prompt_tokens_computed = self.computed
        self.bm.track_tiers, self.engine.scheduler.external = self.tiers
        self.engine.calibrating = self.calibrating


class _StepClock:
    """Adds up the seconds of the engine's steps while it is entered (a step observer)."""

    def __init__(self, engine):
        self.engine = engine
        self.seconds = 0.0

    def record(self, step: StepRecord) -> None:
        self.seconds += step.seconds

    def __enter__(self):
        self.engine.add_step_observer(self.record)
        return self

    def __exit__(self, *exc):
        self.engine.remove_step_observer(self.record)


def _prompt(vocab: int, length: int, salt: int) -> list[int]:
    # distinct tokens per salt, or a later run would be a prefix-cache hit
    return [(7919 * (i + 1) + 104729 * salt) % vocab for i in range(length)]


def measure_prefill(engine, lengths_tokens=LENGTHS_TOKENS, repeats: int = REPEATS) -> list[tuple[int, float]]:
    """(tokens, seconds) of prefill + one sampled token (the steps' time); run on the engine
    thread while idle."""
    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len - 2
    samples = []
    with _Quiet(engine), _StepClock(engine) as clock:
        for n, length in enumerate(lengths_tokens):
            length = min(length, limit)
            best_s = float("inf")
            for r in range(repeats):
                clock.seconds = 0.0
                engine.add_request(
                    f"pdserve-calibrate-{n}-{r}",
                    _prompt(vocab, length, n * repeats + r),
                    SamplingParams(max_tokens=1, temperature=0),
                )
                while engine.has_unfinished_requests():
                    engine.step()
                best_s = min(best_s, clock.seconds)
            samples.append((length, best_s))
    return samples


def calibration_stats(samples: list[tuple[int, float]], reference_tokens: int = REFERENCE_TOKENS) -> dict:
    """Heartbeat stats from the samples: the fitted model and Theta_P at `reference_tokens`."""
    return _prefill_report(fit_prefill_cost(samples), reference_tokens)


def _prefill_report(m: PrefillCostModel, reference_tokens: int) -> dict:
    return {m.STATS_KEY: m.terms(), "prefill_tokens_per_s": m.tokens_per_s(reference_tokens)}


class DecodeStepRecorder:
    """Keeps the engine's recent step times. Pure decode steps (every scheduled sequence
    gets one token) go to `samples` as (batch, context tokens in the batch, seconds);
    steps that prefill go to `prefill_samples` as ([(tokens computed before, new
    tokens) per sequence], seconds). Both are rings of recent samples.

    An engine step observer from construction until `close()`."""

    def __init__(self, engine, maxlen: int = LIVE_SAMPLES):
        self.samples: deque[tuple[int, int, float]] = deque(maxlen=maxlen)
        self.prefill_samples: deque[tuple[list[tuple[int, int]], float]] = deque(maxlen=maxlen)
        self.engine = engine
        engine.add_step_observer(self.record)

    def record(self, step: StepRecord) -> None:
        if all(n == 1 for _, n, _ in step.rows):
            self.samples.append((len(step.rows), sum(done + n for done, n, _ in step.rows), step.seconds))
        else:
            self.prefill_samples.append(([(done, n) for done, n, _ in step.rows], step.seconds))

    def close(self) -> None:
        self.engine.remove_step_observer(self.record)

    def recent(self) -> list[tuple[int, int, float]]:
        return list(self.samples)


def measure_decode(
    engine, recorder: DecodeStepRecorder, points=DECODE_POINTS, steps: int = DECODE_STEPS
) -> list[tuple[int, int, float]]:
    """(batch, context tokens, step seconds) at each point, median of `steps` steps.

    A batch shares one prompt, so it is prefilled once and the rest hit the
    prefix cache; attention still reads every sequence's own context."""
    vocab = engine.model_config.vocab_size
    bm = engine.block_manager
    max_seqs = engine.config.scheduler.max_num_seqs
    out = []
    with _Quiet(engine):
        for n, (batch, ctx) in enumerate(points):
            batch = min(batch, max_seqs)
            # a small pool (or context) shrinks the point rather than skipping it
            fit_tokens = (bm.num_blocks // batch - 1) * bm.block_size - steps - 2
            ctx = min(ctx, engine.max_model_len - steps - 2, fit_tokens)
            if ctx < 1:
                continue
            prompt = _prompt(vocab, ctx, 1000 + n)
            params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
            engine.add_request(choice_request_id(f"pdserve-calibrate-d{n}"), prompt, params)
            engine.step()  # prefill the shared prompt once
            for i in range(1, batch):
                engine.add_request(choice_request_id(f"pdserve-calibrate-d{n}", i), prompt, params)
            recorder.samples.clear()
            while engine.has_unfinished_requests():
                engine.step()
            full = sorted(s for b, _, s in recorder.samples if b == batch)
            ctxs = [c for b, c, _ in recorder.samples if b == batch]
            if full:
                out.append((batch, sum(ctxs) // len(ctxs), full[len(full) // 2]))
            bm.reset_prefix_cache()  # the next point must not hit this one's prompt
        recorder.samples.clear()
    return out


def prefill_stats(
    calibration: dict, live: list[tuple[list[tuple[int, int]], float]], reference_tokens: int = REFERENCE_TOKENS
) -> dict:
    """The start-up D_prefill(L) rescaled by live prefill steps (as the decode model is):
    a busy machine prefills slower than the idle one calibration saw, and a TTFT
    prediction from the idle fit would admit what then misses its SLO."""
    model = PrefillCostModel.from_stats(calibration)
    if model is None:
        return {}
    scale = model.live_scale(live)
    return {
        **_prefill_report(model.scaled(scale), reference_tokens),
        "prefill_live_scale": scale,
        "prefill_live_samples": len(live),
    }


def decode_stats(
    model: DecodeCostModel,
    live: list[tuple[int, int, float]],
    max_num_seqs: int,
    reference_tokens: int = REFERENCE_TOKENS,
) -> dict:
    """Heartbeat stats: the start-up model rescaled by live steps, and Theta_D at
    a loaded operating point (REFERENCE_BATCH sequences, or the worker's max,
    each `reference_tokens` deep)."""
    scale = model.live_scale(live)
    m = model.scaled(scale)
    batch = min(REFERENCE_BATCH, max_num_seqs)
    return {
        m.STATS_KEY: m.terms(),
        "decode_tokens_per_s": m.tokens_per_s(batch, reference_tokens) or None,
        "decode_live_scale": scale,
        "decode_live_samples": len(live),
    }
