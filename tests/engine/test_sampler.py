"""The sampler's draws against the distribution they claim, and its seeds."""

import math

import torch

from pdserve import SamplingParams
from pdserve.engine.sampler import Sampler


def _draw(logits_row, params, n):
    sampler = Sampler(torch.device("cpu"))
    logits = logits_row.repeat(n, 1)
    out = sampler(logits, [params] * n, [f"r{i}" for i in range(n)], [([], [])] * n)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits.shape[1])


def test_frequencies_follow_softmax_over_temperature():
    torch.manual_seed(0)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -30.0])
    n = 40_000
    counts = _draw(logits, SamplingParams(temperature=0.7, max_tokens=1), n)
    expected = torch.softmax(logits / 0.7, dim=0) * n
    chi2 = float(((counts[:5] - expected[:5]) ** 2 / expected[:5]).sum())
    assert chi2 < 20.5, (counts, expected)  # 4 degrees of freedom: p = 0.0004
    assert counts[5] <= 2  # exp(-30/0.7) of the mass


def test_top_p_and_top_k_never_draw_what_they_cut():
    torch.manual_seed(1)
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    counts = _draw(logits, SamplingParams(top_p=0.8, max_tokens=1), 5_000)
    p = torch.softmax(logits, dim=0)
    kept = int((p.cumsum(0) - p < 0.8).sum())
    assert counts[kept:].sum() == 0 and counts[:kept].min() > 0
    counts = _draw(logits, SamplingParams(top_k=2, max_tokens=1), 5_000)
    assert counts[2:].sum() == 0 and math.isclose(counts[0] / counts[1], math.e, rel_tol=0.15)


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(seed=7, max_tokens=1)
    alone = Sampler(torch.device("cpu"))(logits[:1], [seeded], ["a"], [([], [])]).token_ids
    mixed = Sampler(torch.device("cpu"))(
        logits,
        [seeded, SamplingParams(max_tokens=1), SamplingParams(seed=3, max_tokens=1)],
        ["a", "b", "c"],
        [([], [])] * 3,
    ).token_ids
    assert mixed[0] == alone[0]
