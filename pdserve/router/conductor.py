"""The conductor's decisions as pure functions: no I/O, no clocks.

The router calls them with what heartbeats and the prefix index report; the
simulator calls the very same ones with what its latency model predicts, so a
policy is written once. Every time is in seconds (`_s`), every length in tokens.

- Placement: a prompt of L tokens goes to the prefill worker i with the lowest
  score_i = (1 - H_i) * D_prefill(L) + alpha * Q_i, where H_i is the share of
  the prompt already in that worker's prefix cache, D_prefill(L) the time to
  prefill all of it and Q_i the time the worker's queue needs to drain. alpha
  grows with load (protect queues at peak, chase cache hits when calm).
- Predictive early rejection: predict TTFT and the TPOT on the chosen
  decode instance *before* any prefill work, and refuse (429) what would miss
  its SLO; refuse new long requests while the decode pool's KV is above a
  watermark (92% by default).
- Capacity: decode instances per prefill instance,
  N_D / N_P = (Lout / Lin) * (Theta_P / Theta_D), from the mean prompt and
  output lengths and the token throughputs of one prefill and one decode
  instance: both pools then finish the same requests per second.

D_prefill and the decode step's time come from the cost models of pdserve/costmodel.py,
which the workers calibrate and report in their heartbeats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.costmodel import DecodeCostModel, PrefillCostModel
from pdserve.planner.capacity import pd_ratio

# ---------------------------------------------------------------- placement


def prefill_score(hit_ratio: float, prefill_time_s: float, queue_drain_s: float, alpha: float) -> float:
    """(1 - H_i) * D_prefill(L) + alpha * Q_i, in seconds; lower is better: the prefill
    time left after the cache hit, plus the queue's wait weighted by alpha."""
    if not 0.0 <= hit_ratio <= 1.0:
        raise ValueError(f"hit_ratio must be in [0, 1], got {hit_ratio}")
    return (1.0 - hit_ratio) * prefill_time_s + alpha * queue_drain_s


def effective_hit_ratio(
    local_blocks: int, lower_blocks: int, block_size: int, prompt_tokens: int, lower_load_cost: float
) -> float:
    """H_i with lower KV tiers: a block in the worker's pool saves its whole prefill, one it can
    load from a lower tier (its host memory or disk, the shared store) saves all but the load
    (`lower_load_cost`: load time over prefill time of a block), so a store hit ranks between
    a local hit and a miss."""
    if prompt_tokens <= 0:
        return 0.0
    saved = local_blocks + lower_blocks * (1.0 - min(1.0, max(0.0, lower_load_cost)))
    return min(1.0, saved * block_size / prompt_tokens)


@dataclass(frozen=True)
class PrefillCandidate:
    worker_id: str
    hit_ratio: float = 0.0  # H_i: cached share of this request's prompt on this worker
    prefill_time_s: float = 0.0  # D_prefill(L) on this worker's own cost model
    queue_drain_s: float = 0.0  # Q_i: time until its queue is empty


def choose_prefill(cands: Sequence[PrefillCandidate], alpha: float) -> tuple[PrefillCandidate, float]:
    """The candidate with the lowest placement score, and that score; ties by worker id
    so the router and the simulator agree exactly."""
    if not cands:
        raise ValueError("no prefill candidates")
    scored = [(prefill_score(c.hit_ratio, c.prefill_time_s, c.queue_drain_s, alpha), c.worker_id, c) for c in cands]
    score, _, best = min(scored, key=lambda t: (t[0], t[1]))
    return best, score


def queue_drain_s(queued_prompt_tokens: Sequence[int], cost: PrefillCostModel) -> float:
    """Q_i: the prefill time of everything already waiting on a worker."""
    return sum(cost(t) for t in queued_prompt_tokens)


def next_busy_until_s(now_s: float, busy_until_s: float, prefill_s: float) -> float:
    """A worker's virtual clock: when the work the router has sent it will be done.
    Q_i = busy_until - now. Heartbeats are a second stale; this is not, so a
    burst does not all land on the worker that looked idle a second ago."""
    return max(now_s, busy_until_s) + prefill_s


def pool_utilisation(queue_drains_s: Sequence[float], horizon_s: float) -> float:
    """Load of a prefill pool in [0, 1]: mean queue drain as a share of `horizon_s`
    (the TTFT SLO, say), each capped at 1 so one stuck worker cannot read as peak."""
    if not queue_drains_s or horizon_s <= 0:
        return 0.0
    return sum(min(1.0, q / horizon_s) for q in queue_drains_s) / len(queue_drains_s)


def adaptive_alpha(utilisation: float, alpha_min: float = 0.5, alpha_max: float = 4.0) -> float:
    """Raise alpha at peak (keep queues short), lower it when calm
    (chase prefix hits). Linear in utilisation, clamped to [alpha_min, alpha_max]."""
    u = min(1.0, max(0.0, utilisation))
    return alpha_min + (alpha_max - alpha_min) * u


# ---------------------------------------------------------------- admission


def predict_ttft(queue_s: float, prefill_s: float, transfer_s: float) -> float:
    """TTFT = wait in the prefill queue + own prefill + the KV's exposed transfer."""
    return queue_s + prefill_s + transfer_s


def predict_transfer_s(
    tokens: float,
    kv_bytes_per_token: float,
    num_layers: int,
    bandwidth_bytes_per_s: float,
    layerwise: bool,
    latency_s: float = 0.0,
) -> float:
    """Exposed KV transfer time of `tokens` prompt tokens: the part TTFT waits for.

    Eager: every layer leaves after the prefill, so all the bytes are exposed.
    Layer-wise: layer k travels while layer k+1 computes; only the last layer's
    bytes are exposed (64 Ki tokens x 320 KiB = 20 GiB over 45 GiB/s: 444 ms
    eager, 5.6 ms layer-wise over 80 layers). `latency_s` is the fixed cost of the last hop (the acknowledgement)."""
    if tokens <= 0:
        return 0.0
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be positive")
    total_bytes = tokens * kv_bytes_per_token
    exposed_bytes = total_bytes / max(1, num_layers) if layerwise else total_bytes
    return latency_s + exposed_bytes / bandwidth_bytes_per_s


def predict_tpot(
    model: DecodeCostModel, num_running: int, context_tokens: int, prompt_tokens: int, max_tokens: int
) -> float:
    """TPOT the decode instance would give once this request joins its batch.

    Context is counted at the request's midpoint (prompt + half its output):
    the mean over its life, as the batch's others are at random points too."""
    batch = num_running + 1
    return model.step_s(batch, context_tokens + prompt_tokens + max_tokens / 2)


@dataclass(frozen=True)
class Admission:
    admitted: bool
    reason: str = "ok"  # ok | ttft_slo | tpot_slo | kv_backpressure
    retry_after_s: int = 0  # for the 429's Retry-After header (whole seconds)


ADMIT = Admission(True)


def _retry_after_s(excess_s: float) -> int:
    # HTTP's Retry-After is whole seconds; never 0, or clients spin.
    return max(1, math.ceil(excess_s))


def admit(
    predicted_ttft_s: float, predicted_tpot_s: float, slo_ttft_s: float | None, slo_tpot_s: float | None
) -> Admission:
    """Refuse what would break an SLO; an SLO of None is not checked.

    Retry-After for TTFT is the predicted excess: the queue must drain that
    much first. For TPOT it is 1 s: the decode batch shrinks as requests
    finish, at a pace the router cannot predict better than that."""
    if slo_ttft_s is not None and predicted_ttft_s > slo_ttft_s:
        return Admission(False, "ttft_slo", _retry_after_s(predicted_ttft_s - slo_ttft_s))
    if slo_tpot_s is not None and predicted_tpot_s > slo_tpot_s:
        return Admission(False, "tpot_slo", 1)
    return ADMIT


def prefill_locally(prompt_tokens: int, cached_on_decode_tokens: int, max_local_prefill_tokens: int) -> bool:
    """Conditional disaggregation (as Dynamo's router does it): a prompt whose part the decode
    worker does not already hold is short enough is prefilled on that decode worker. Its prefill
    then costs the decode batch one short step instead of a place in the prefill queue, a
    second worker's step and a KV transfer. 0 turns it off."""
    return max_local_prefill_tokens > 0 and prompt_tokens - cached_on_decode_tokens <= max_local_prefill_tokens


def is_long_request(prompt_tokens: int, max_tokens: int, long_threshold_tokens: int) -> bool:
    """Long = its whole KV footprint (prompt + output) reaches the threshold."""
    return prompt_tokens + max_tokens >= long_threshold_tokens


def pool_kv_usage(usages: Sequence[float], num_blocks: Sequence[int]) -> float:
    """KV usage of a decode pool: used blocks over all blocks (big workers weigh more)."""
    total = sum(num_blocks)
    return sum(u * n for u, n in zip(usages, num_blocks)) / total if total else 0.0


def backpressure(decode_kv_usage: float, *, is_long: bool, watermark: float = 0.92) -> Admission:
    """Above the watermark, refuse new long requests: they would force preemption
    on the decode side after their prefill was paid for. Short ones still pass."""
    if is_long and decode_kv_usage > watermark:
        return Admission(False, "kv_backpressure", 1)
    return ADMIT


# ---------------------------------------------------------------- capacity


def recommended_pd_ratio(mean_lin: float, mean_lout: float, theta_p: float, theta_d: float) -> float | None:
    """N_D / N_P = (Lout / Lin) * (Theta_P / Theta_D), or None before there is anything to divide by.
    The formula lives in the planner; the router and planner must not disagree."""
    if mean_lin <= 0 or theta_d <= 0:
        return None
    return pd_ratio(mean_lin, mean_lout, theta_p, theta_d)
