"""When each request is sent: Poisson, gamma (bursty), all at once, or a trace's own clock.

Offsets are drawn up front from a seed, so a run's schedule is known before
it starts and is the same for every server it is pointed at. The first
request goes at 0 and request i after i inter-arrival gaps, as in
`vllm bench serve`.
"""

from __future__ import annotations

import math

import numpy as np

from pdserve.bench.datasets import Request


def gaps_s(n: int, request_rate: float, burstiness: float = 1.0, *, seed: int = 0) -> np.ndarray:
    """n inter-arrival gaps of a gamma process with mean 1/request_rate.

    burstiness 1 is Poisson (exponential gaps); below 1 the gaps vary more
    (bursts and lulls), above 1 less (closer to evenly spaced). The gamma's
    shape is the burstiness and its scale 1/(rate*burstiness), so the mean
    rate stays `request_rate` whatever the burstiness.
    """
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {request_rate}")
    if math.isinf(request_rate):
        return np.zeros(n)
    rng = np.random.default_rng([seed, 6])
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def offsets_s(n: int, request_rate: float, burstiness: float = 1.0, *, seed: int = 0) -> np.ndarray:
    """Send times from the benchmark start: 0, g0, g0+g1, ..."""
    g = gaps_s(n, request_rate, burstiness, seed=seed)
    return np.concatenate(([0.0], np.cumsum(g[:-1]))) if n else np.zeros(0)


def schedule(
    requests: list[Request],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    *,
    seed: int = 0,
    use_trace_times: bool = True,
) -> list[float]:
    """Send time of each request: its own `arrival_s` where it has one (a trace, a burst)
    and `use_trace_times` holds, else the next offset of the arrival process."""
    free = [i for i, r in enumerate(requests) if r.arrival_s is None or not use_trace_times]
    drawn = offsets_s(len(free), request_rate, burstiness, seed=seed)
    times = [r.arrival_s if r.arrival_s is not None else 0.0 for r in requests]
    for i, t in zip(free, drawn.tolist()):
        times[i] = t
    return times
