"""The autoscaler's decision, as a pure function of what the router observes.

One step at a time, one worker at a time, then a cool-down, as operators of
Dynamo's planner or Ray Serve's autoscaler would expect:

- a pool under pressure grows: decode when its KV usage passes `kv_high` or
  requests queue on it; prefill when prompts queue on it;
- with no pressure, the P:D advice (N_D / N_P = (Lout / Lin) x (Theta_P /
  Theta_D), from observed lengths and measured throughputs) grows the pool it
  says is short, while there is load to judge by;
- a pool shrinks when the workers left would still sit below `kv_low` with
  nothing queued (for decode), or nothing queued and little running (prefill).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.flags import internal, setting


@dataclass(frozen=True)
class AutoscaleConfig:
    """Autoscaling (--autoscale).

    The bounds of each pool and how often it may change."""

    min_prefill: int = setting(1, help="autoscale: fewest prefill workers")
    max_prefill: int = setting(4, help="autoscale: most prefill workers")
    min_decode: int = setting(1, help="autoscale: fewest decode workers")
    max_decode: int = setting(4, help="autoscale: most decode workers")
    cooldown_s: float = setting(60.0, flag="--autoscale-cooldown-s", help="after any change, before the next")
    interval_s: float = setting(5.0, flag="--autoscale-interval-s", help="how often the router decides")
    kv_high: float = internal(0.80, why="decode KV usage that calls for another decode worker; tuned here")
    kv_low: float = internal(0.30, why="usage the remaining decode workers must stay under to shrink; tuned here")
    queue_high: float = internal(2.0, why="waiting requests per worker that call for another worker; tuned here")

    def __post_init__(self):
        if not (0 <= self.min_prefill <= self.max_prefill and 0 <= self.min_decode <= self.max_decode):
            raise ValueError("autoscale: need 0 <= min <= max for each pool")
        if self.max_prefill + self.max_decode < 1 or not 0 < self.kv_low < self.kv_high <= 1:
            raise ValueError("autoscale: need at least one worker and 0 < kv_low < kv_high <= 1")

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.min_prefill, self.max_prefill) if role == "prefill" else (self.min_decode, self.max_decode)


@dataclass(frozen=True)
class PoolLoad:
    workers: int
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0  # decode pool: used / total blocks


@dataclass(frozen=True)
class Decision:
    role: str
    delta: int  # +1 or -1
    reason: str


def decide(
    cfg: AutoscaleConfig, prefill: PoolLoad, decode: PoolLoad, pd_advice: float | None, since_last_change_s: float
) -> Decision | None:
    """The one change to make now, or None."""
    if since_last_change_s < cfg.cooldown_s:
        return None
    pools = {"prefill": prefill, "decode": decode}

    def can(role: str, delta: int) -> bool:
        lo, hi = cfg.bounds(role)
        return lo <= pools[role].workers + delta <= hi

    def per_worker(p: PoolLoad, n: int) -> float:
        return n / max(1, p.workers)

    if (decode.kv_usage >= cfg.kv_high or per_worker(decode, decode.waiting) >= cfg.queue_high) and can("decode", 1):
        return Decision("decode", 1, f"decode KV usage {decode.kv_usage:.0%}, {decode.waiting} waiting")
    if per_worker(prefill, prefill.waiting) >= cfg.queue_high and can("prefill", 1):
        return Decision("prefill", 1, f"{prefill.waiting} prompts waiting on {prefill.workers} prefill workers")
    busy = decode.running + prefill.running > 0
    if pd_advice is not None and busy and prefill.workers >= 1:
        want_d = math.ceil(prefill.workers * pd_advice)
        if decode.workers < want_d and decode.kv_usage > cfg.kv_low and can("decode", 1):
            return Decision("decode", 1, f"P:D advice {pd_advice:.2f} wants {want_d} decode workers")
    if (
        decode.workers > 1
        and can("decode", -1)
        and decode.waiting == 0
        and decode.kv_usage * decode.workers / (decode.workers - 1) < cfg.kv_low
    ):
        return Decision("decode", -1, f"decode KV usage {decode.kv_usage:.0%} fits on one worker fewer")
    if prefill.workers > 1 and can("prefill", -1) and prefill.waiting == 0 and prefill.running < prefill.workers - 1:
        return Decision("prefill", -1, "prefill pool idle enough for one worker fewer")
    return None
