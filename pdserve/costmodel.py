"""What a worker's steps cost: the fitted models the router places and admits with, the
worker calibrates and reports, and the simulator fits to its latency model.

- D_prefill(L) = a + b*L + c*L^2 seconds for an L-token prompt (`PrefillCostModel`):
  attention over the prompt is the quadratic term, the weights' FLOPs the linear one,
  the fixed per-step cost (launches, sampling) `a`.
- One decode step = base + per_seq * batch + per_kv_token * context tokens in the batch
  (`DecodeCostModel`): decode is memory-bound, so a step pays for the weights once and
  for every cached token it reads.

Both are fitted by least squares with every term kept non-negative (`nonnegative_lstsq`,
also the simulator's step-time fit, pdserve/sim/latency.py), rescaled by what live steps
measure (`median_ratio`), and travel in heartbeat stats as their list of terms
(`prefill_cost_s`, `decode_cost_s`). Every time is in seconds, every length in tokens.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass
from typing import ClassVar

import numpy as np


def nonnegative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares x @ coef ~ y with every coefficient >= 0: a term fitted negative (noise
    over a short range, or two features rising together) is dropped, the most negative
    first, and the rest refitted, rather than clipped, which would leave the others fitted
    around a term that is no longer there. Columns of zeros get 0."""
    active = [i for i in range(x.shape[1]) if np.any(x[:, i])]
    while True:
        coef = np.zeros(x.shape[1])
        sol = np.linalg.lstsq(x[:, active], y, rcond=None)[0]
        coef[active] = sol
        neg = [i for i, c in zip(active, sol) if c < 0]
        if not neg:
            return coef
        active.remove(min(neg, key=lambda i: coef[i]))


def median_ratio(pairs: Iterable[tuple[float, float]], lo: float = 0.25, hi: float = 8.0) -> float:
    """How much slower (> 1) or faster live steps run than a model says: the median of
    observed / predicted over (observed, predicted) pairs, bounded to [lo, hi]; 1.0 with none.

    Calibration runs on an idle worker; under traffic (other processes on the cores, the
    event loop, transfers landing) steps are slower. The median ignores the odd step that
    waited on a preempted core; the bounds keep a burst of odd samples from making the
    model absurd."""
    ratios = sorted(s / p for s, p in pairs if p > 0)
    if not ratios:
        return 1.0
    return min(hi, max(lo, ratios[len(ratios) // 2]))


class _Terms:
    """A model that is a few non-negative terms: in heartbeat stats, the list of them under
    STATS_KEY; on a busier or quieter machine, every term times one factor."""

    STATS_KEY: ClassVar[str]

    def terms(self) -> list[float]:
        return [float(t) for t in astuple(self)]  # plain floats (numpy's would log as np.float64(...))

    @classmethod
    def from_stats(cls, stats: dict | None):
        """The model a worker reported, or None if it has not."""
        terms = (stats or {}).get(cls.STATS_KEY)
        return cls(*map(float, terms)) if terms else None

    def scaled(self, factor: float):
        return type(self)(*(t * factor for t in self.terms()))


@dataclass(frozen=True)
class PrefillCostModel(_Terms):
    """D_prefill(L) = a + b*L + c*L^2 seconds for an L-token prompt on one worker."""

    a_s: float = 0.0
    b_s_per_token: float = 0.0
    c_s_per_token2: float = 0.0

    STATS_KEY: ClassVar[str] = "prefill_cost_s"

    def __call__(self, tokens: float) -> float:
        return max(0.0, self.a_s + self.b_s_per_token * tokens + self.c_s_per_token2 * tokens * tokens)

    def tokens_per_s(self, tokens: int) -> float | None:
        """Theta_P: prompt tokens per second at prompts of `tokens` tokens."""
        seconds = self(tokens)
        return float(tokens / seconds) if seconds > 0 else None

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One step prefilling `chunks` of (tokens already computed, new tokens): the fixed
        cost once, and for each chunk what D_prefill adds from its start to its end."""
        a, b, c = self.a_s, self.b_s_per_token, self.c_s_per_token2
        return a + sum(b * n + c * ((k + n) ** 2 - k**2) for k, n in chunks)

    def live_scale(self, observed: Sequence[tuple[Sequence[tuple[int, int]], float]]) -> float:
        """`median_ratio` over live prefill steps ([(computed, new), ...], seconds)."""
        return median_ratio((s, self.step_s(chunks)) for chunks, s in observed)


def fit_prefill_cost(samples: Sequence[tuple[int, float]]) -> PrefillCostModel:
    """Least-squares fit of (prompt tokens, measured prefill seconds) samples.

    Fewer distinct lengths than coefficients, or a negative fitted term (noise
    on a short range), drops to a simpler model: a cost model that predicts a
    shorter prefill for a longer prompt would invert placement decisions."""
    if not samples:
        raise ValueError("need at least one (tokens, seconds) sample")
    x = np.array([float(t) for t, _ in samples])
    y = np.array([float(s) for _, s in samples])
    distinct = len(set(x.tolist()))
    for degree in (2, 1, 0):
        if distinct <= degree:
            continue
        coef = np.linalg.lstsq(np.vander(x, degree + 1, increasing=True), y, rcond=None)[0]
        if degree == 0 or (coef[1:] >= 0).all():
            coef = list(coef) + [0.0] * (2 - degree)
            return PrefillCostModel(max(0.0, coef[0]), coef[1], coef[2])
    raise AssertionError("unreachable: degree 0 always fits")


@dataclass(frozen=True)
class DecodeCostModel(_Terms):
    """One decode step = base + per_seq * batch + per_kv_token * tokens of context in the batch."""

    base_s: float = 0.0
    per_seq_s: float = 0.0
    per_kv_token_s: float = 0.0

    STATS_KEY: ClassVar[str] = "decode_cost_s"

    def step_s(self, batch: int, context_tokens: float) -> float:
        return self.base_s + self.per_seq_s * batch + self.per_kv_token_s * context_tokens

    def tokens_per_s(self, batch: int, context_tokens_per_seq: float) -> float:
        """Theta_D at one operating point: `batch` tokens per step."""
        step = self.step_s(batch, batch * context_tokens_per_seq)
        return batch / step if step > 0 else 0.0

    def live_scale(self, observed: Sequence[tuple[int, int, float]]) -> float:
        """`median_ratio` over live decode steps (batch, context tokens, seconds)."""
        return median_ratio((s, self.step_s(b, c)) for b, c, s in observed)


def fit_decode_cost(samples: Sequence[tuple[int, int, float]]) -> DecodeCostModel:
    """Least squares over (batch size, context tokens in the batch, step seconds), every
    term non-negative (batch and context often rise together)."""
    if len(samples) < 3:
        raise ValueError("need at least three (batch, context_tokens, step_s) samples")
    a = np.array([[1.0, b, c] for b, c, _ in samples])
    y = np.array([s for _, _, s in samples])
    return DecodeCostModel(*(float(v) for v in nonnegative_lstsq(a, y)))
