"""Start-up calibration of a prefill worker's D_prefill(L) (seed 000 §5.1).

The router's placement score and its TTFT prediction both need how long this
worker takes to prefill L tokens. Measured here, on the worker's own engine,
before it takes traffic; reported in heartbeat stats as `prefill_cost_s`
[a, b, c] of a + b*L + c*L^2, and `prefill_tokens_per_s` (Theta_P of §5.3).
"""
from __future__ import annotations

import dataclasses
import time

from pdserve.router import conductor

LENGTHS_TOKENS = (16, 64, 256)  # short enough to cost well under a second on a CPU box
REPEATS = 2  # keep the fastest: the first run of a shape pays one-off warm-up


def measure_prefill(engine, lengths_tokens=LENGTHS_TOKENS, repeats: int = REPEATS) -> list[tuple[int, float]]:
    """(tokens, seconds) of prefill + one sampled token; run on the engine thread while idle.

    Leaves the prefix cache empty, as a fresh worker's is (the router's prefix
    index assumes each worker epoch starts from nothing), and its hit counters
    as they were: calibration is not traffic."""
    from pdserve.engine.sampling_params import SamplingParams

    vocab = engine.model_config.vocab_size
    limit = engine.max_model_len - 2
    bm = engine.block_manager
    saved_stats = dataclasses.replace(bm.stats)
    samples = []
    for n, length in enumerate(lengths_tokens):
        length = min(length, limit)
        best_s = float("inf")
        for r in range(repeats):
            # distinct tokens per run, or the second run would be a prefix-cache hit
            prompt = [(7919 * (i + 1) + 104729 * (n * repeats + r)) % vocab for i in range(length)]
            t0 = time.perf_counter()
            engine.add_request(f"pdserve-calibrate-{n}-{r}", prompt, SamplingParams(max_tokens=1, temperature=0))
            while engine.has_unfinished_requests():
                engine.step()
            best_s = min(best_s, time.perf_counter() - t0)
        samples.append((length, best_s))
    bm.reset_prefix_cache()
    bm.drain_events()
    bm.stats = saved_stats
    return samples


def calibration_stats(samples: list[tuple[int, float]], reference_tokens: int = 512) -> dict:
    """Heartbeat stats from the samples: the fitted model and Theta_P at `reference_tokens`."""
    cost = conductor.fit_prefill_cost(samples)
    seconds = cost(reference_tokens)
    return {"prefill_cost_s": [cost.a_s, cost.b_s_per_token, cost.c_s_per_token2],
            "prefill_tokens_per_s": reference_tokens / seconds if seconds > 0 else None}
