"""Pool sizing: the P:D ratio, GPU counts with redundancy, latency under SLOs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from pdserve.planner.units import ceil_count


def pd_ratio(lin: float, lout: float, theta_p: float, theta_d: float) -> float:
    """N_D / N_P = (Lout / Lin) x (Theta_P / Theta_D).

    From the balance N_P x Theta_P / Lin = N_D x Theta_D / Lout: requests
    leave the prefill pool as fast as the decode pool finishes them.
    Theta_P and Theta_D are tokens/s of one prefill and one decode GPU.
    """
    return (lout / lin) * (theta_p / theta_d)


def request_latency_s(ttft_s: float, output_tokens: int, tpot_s: float) -> float:
    """Latency ≈ TTFT + (T_out - 1) x TPOT, queueing aside."""
    return ttft_s + (output_tokens - 1) * tpot_s


@dataclass(frozen=True)
class GpuCount:
    raw: float  # load / capacity, before rounding
    base: int  # ceil(raw)
    redundancy: float  # e.g. 0.3 for 30%
    total: int  # ceil(base x (1 + redundancy))

    def to_dict(self) -> dict:
        return asdict(self)


def gpu_count(load: float, capacity_per_gpu: float, redundancy: float) -> GpuCount:
    """GPUs = ceil(peak QPS x mean occupancy / concurrency per GPU) x (1 + r)
    (10 QPS x 5 s / 20 per GPU = 2.5 -> 3, plus 30% -> 4).

    ``load`` is QPS x occupancy (requests in flight) and ``capacity_per_gpu``
    the concurrency one GPU carries; a token rate over a tokens/s rate works
    the same way. The result is rounded up again after the redundancy, since
    a fraction of a GPU cannot be bought (3 x 1.3 = 3.9 -> 4).
    """
    if capacity_per_gpu <= 0:
        raise ValueError("capacity per GPU must be > 0")
    if redundancy < 0:
        raise ValueError("redundancy must be >= 0")
    raw = load / capacity_per_gpu
    base = ceil_count(raw)
    return GpuCount(raw, base, redundancy, ceil_count(base * (1.0 + redundancy)))


def max_batch_within(step_time_s: Callable[[int], float], slo_s: float, max_batch: int) -> int:
    """Largest batch in [1, max_batch] whose step time meets ``slo_s``, or 0.

    Step time grows with batch (more KV to read), so a binary search over the
    same pure cost function the planner prints is enough.
    """
    if max_batch < 1 or step_time_s(1) > slo_s:
        return 0
    lo, hi = 1, max_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if step_time_s(mid) <= slo_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def expected_accepted_tokens(acceptance: float, draft_tokens: int) -> float:
    """Tokens one speculative step yields: (1 - a^(g+1)) / (1 - a) for g drafts
    each accepted with probability a (the verify step adds one token of its own)."""
    if not 0.0 <= acceptance < 1.0:
        raise ValueError(f"acceptance must be in [0, 1), got {acceptance}")
    return (1.0 - acceptance ** (draft_tokens + 1)) / (1.0 - acceptance)


def spec_speedup(acceptance: float, draft_tokens: int, draft_cost: float) -> float:
    """Speed-up = accepted tokens / (draft cost + verify cost), in units of one
    target decode step: g drafts at ``draft_cost`` each plus one verify step."""
    return expected_accepted_tokens(acceptance, draft_tokens) / (draft_tokens * draft_cost + 1.0)
