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


class _CountingList(list):
    """A list that counts the elements read from it (iteration and slices)."""

    reads = 0

    def __iter__(self):
        _CountingList.reads += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        got = super().__getitem__(i)
        _CountingList.reads += len(got) if isinstance(i, slice) else 1
        return got


def _penalised(logits, p, prompt, output):
    """The penalties computed from the whole history at once."""
    logits = logits.clone()
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        row = logits[seen]
        logits[seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
    if output:
        counts = torch.bincount(torch.tensor(output), minlength=logits.shape[0]).float()
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return logits


def test_penalties_follow_the_whole_history_while_reading_only_new_tokens():
    g = torch.Generator().manual_seed(2)
    vocab = 50
    p = SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    prompt, output = [3, 7, 7, 11], _CountingList()
    sampler = Sampler(torch.device("cpu"))
    for step in range(40):
        logits = torch.randn(1, vocab, generator=g)
        want = _penalised(logits[0], p, prompt, list.copy(output)).argmax().item()
        _CountingList.reads = 0
        got = sampler(logits, [p], ["a"], [(prompt, output)]).token_ids[0]
        assert got == want, step
        assert _CountingList.reads <= 1  # the token the last step added, not the whole output
        output.append(got)
    sampler.forget("a")
    assert not sampler._seen


def test_a_seeded_number_depends_on_the_seed_and_the_position_alone():
    from pdserve.engine.sampler import seeded_uniform

    u = [seeded_uniform(7, i) for i in range(20000)]
    assert u[:50] == [seeded_uniform(7, i) for i in range(50)]  # no hidden stream state
    assert len(set(u)) == len(u) and all(0.0 <= x < 1.0 for x in u)
    assert abs(sum(u) / len(u) - 0.5) < 0.01 and abs(sum(x < 0.1 for x in u) / len(u) - 0.1) < 0.01
    assert [seeded_uniform(8, i) for i in range(50)] != u[:50]
    assert seeded_uniform(-1, 0) == seeded_uniform(2**64 - 1, 0)  # the same 64 bits
    # a sampled row takes its number from its position: the same token alone or after others
    s = Sampler(torch.device("cpu"))
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    p = SamplingParams(temperature=1.0, seed=7)
    one = [s(logits, [p], ["a"], [([1], [0] * i)]).token_ids[0] for i in range(30)]
    again = s(logits.expand(30, 50), [p] * 30, ["b"] * 30, [([1], [])] * 30, list(range(30))).token_ids
    assert one == again and len(set(one)) > 5
