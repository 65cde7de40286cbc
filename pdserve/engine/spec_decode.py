"""Speculative decoding with prompt lookup ("ngram"): draft, then verify in one pass.

A decoding sequence normally computes one token a step. Here it brings up to k guessed
tokens (drafts) into the step as well, so the step computes k + 1 positions of it at once,
as a short prefill chunk over its cached context would; the logits at those positions say
which guesses the model agrees with. The tokens kept are the agreed drafts plus one the
model chooses at the first disagreement (or after the last draft), so a step yields 1 to
k + 1 tokens for about the cost of one while decoding is bound by reading the weights.

Drafts come from the sequence itself (`NgramProposer`): its last n tokens are looked for
earlier in its prompt and output, and the tokens that followed there are proposed (the
longest n within the configured range wins, then the most recent place). Outputs that
copy their input (editing, extraction, quoting, code) are guessed well; others are not,
and then a step computes the drafts for nothing.

Verification (`verify`) keeps what the model would have produced without drafts: greedy
takes a draft only where it is the argmax; sampling takes draft d at a position with
probability p(d), the model's probability after temperature and top-k/top-p/min-p, and at
the first refusal samples from p with d removed. As drafts are certain guesses (their
proposal puts all its mass on d), this is the standard speculative-sampling rule, and
each token is distributed exactly as p (the proof: P(token = x) = p(d) [x = d] + (1 -
p(d)) p(x) / (1 - p(d)) [x != d] = p(x)).

Requests whose logits depend on the tokens before them in ways a batch of positions
cannot see (repetition, presence and frequency penalties, bad_words, structured outputs)
decode as before, one token a step, in the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.config import SpeculativeConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence


def spec_eligible(params: SamplingParams) -> bool:
    """Whether a request's tokens may be drafted: its logits processing reads nothing of the
    tokens before each position (logit_bias and allowed_token_ids are the same at every one)."""
    return (
        params.repetition_penalty == 1.0
        and not params.presence_penalty
        and not params.frequency_penalty
        and not params.bad_words
        and params.structured_outputs is None
    )


def find_ngram_continuation(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length `min_n`..`max_n` (empty when no such suffix occurs earlier)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        # starts i with i + n <= length - 1: the match is followed by at least one token
        cand = np.flatnonzero(tokens[: length - n] == suffix[0])
        for j in range(1, n):
            if not len(cand):
                break
            cand = cand[tokens[cand + j] == suffix[j]]
        if len(cand):
            start = int(cand[-1]) + n
            return tokens[start : start + k]
    return tokens[:0]


class _History:
    """A sequence's token ids as a growing numpy array (appended to, never rebuilt)."""

    __slots__ = ("buf", "n")

    def __init__(self):
        self.buf = np.empty(256, dtype=np.int64)
        self.n = 0

    def sync(self, seq: Sequence) -> np.ndarray:
        total = seq.num_tokens
        if self.n > total:  # preempted with a reused id, or anything odd: start again
            self.n = 0
        if total > len(self.buf):
            grown = np.empty(max(total, 2 * len(self.buf)), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n : total] = seq.all_token_ids[self.n : total]
            self.n = total
        return self.buf[:total]


class NgramProposer:
    """Drafts by prompt lookup, per sequence (`propose`); `forget` a finished one."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        self._histories: dict[str, _History] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        if k <= 0 or not spec_eligible(seq.params):
            return []
        hist = self._histories.get(seq.seq_id)
        if hist is None:
            hist = self._histories[seq.seq_id] = _History()
        tokens = hist.sync(seq)
        c = self.config
        return find_ngram_continuation(tokens, c.prompt_lookup_min, c.prompt_lookup_max, k).tolist()

    def forget(self, seq_id: str) -> None:
        self._histories.pop(seq_id, None)


@dataclass
class SpecStats:
    """Counters with vLLM's meanings: drafts (steps where a sequence brought drafts), draft
    tokens, accepted tokens, and accepted tokens by position in the draft."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft:
            self.accepted_per_pos.extend([0] * (num_draft - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def as_dict(self) -> dict:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }


@dataclass
class Verified:
    """One sequence's outcome: the tokens it keeps (accepted drafts, then the model's own),
    each token's logprobs entry (or None), and how many drafts were accepted."""

    tokens: list[int]
    logprobs: list
    num_accepted: int


def verify(sampler, logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]]) -> list[Verified]:
    """Check each sequence's drafts against the logits of its len(drafts) + 1 positions
    (rows of `logits`, sequence after sequence, in the order given)."""
    counts = [len(d) + 1 for d in drafts]
    params: list[SamplingParams] = []
    row_seq: list[int] = []
    for i, c in enumerate(counts):
        params.extend([seqs[i].params] * c)
        row_seq.extend([i] * c)
    row_ids = [seqs[i].seq_id for i in row_seq]
    want_logprobs = any(s.params.logprobs is not None for s in seqs)
    raw = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    if any(not p.greedy or p.logit_bias or p.allowed_token_ids is not None for p in params):
        logits = logits.clone()
        history = [(seqs[i].prompt_token_ids, seqs[i].output_token_ids) for i in row_seq]
        for r, p in enumerate(params):  # position-independent processors only (spec_eligible)
            sampler._apply_row(logits, r, p, row_ids, history)
    greedy_tokens = logits.argmax(dim=-1).tolist()
    sampling = [i for i, s in enumerate(seqs) if not s.params.greedy]
    probs = None
    if sampling:
        rows = torch.tensor([r for r, i in enumerate(row_seq) if not seqs[i].params.greedy], device=logits.device)
        sub = [params[r] for r in rows.tolist()]
        temps = torch.tensor([p.temperature for p in sub], device=logits.device).unsqueeze(1)
        from pdserve.engine.sampler import _top_k_top_p_min_p

        probs = torch.zeros_like(logits)
        probs[rows] = torch.softmax(_top_k_top_p_min_p(logits[rows] / temps, sub), dim=-1)
    out: list[Verified] = []
    first = 0
    for i, seq in enumerate(seqs):
        d, c = drafts[i], counts[i]
        if seq.params.greedy:
            target = greedy_tokens[first : first + c]
            a = 0
            while a < len(d) and d[a] == target[a]:
                a += 1
            tokens = d[:a] + [target[a]]
        else:
            tokens = _rejection_sample(sampler, probs[first : first + c], d, seq)
            a = len(tokens) - 1
        lps = [None] * len(tokens)
        if seq.params.logprobs is not None:
            lps = sampler._logprobs(raw[first : first + len(tokens)], tokens, [seq.params] * len(tokens))
        out.append(Verified(tokens, lps, a))
        first += c
    return out


def _rejection_sample(sampler, probs: torch.Tensor, drafts: list[int], seq: Sequence) -> list[int]:
    """Speculative sampling against certain drafts: rows of `probs` are the model's
    distributions at the draft positions and after the last."""
    p = seq.params
    gen = sampler._generator(seq.seq_id, p.seed) if p.seed is not None else None
    u = torch.rand(len(drafts) + 1, dtype=torch.float64, generator=gen, device=probs.device).tolist()
    if drafts:
        own = probs[torch.arange(len(drafts), device=probs.device), torch.tensor(drafts, device=probs.device)]
        own = own.tolist()
    tokens: list[int] = []
    for j, d in enumerate(drafts):
        if u[j] < own[j]:
            tokens.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        tokens.append(_inverse_cdf(residual, u[-1]))
        return tokens
    tokens.append(_inverse_cdf(probs[len(drafts)], u[-1]))
    return tokens


def _inverse_cdf(dist: torch.Tensor, u: float) -> int:
    """A token drawn from the (unnormalised) distribution `dist` with the uniform number `u`."""
    cdf = dist.double().cumsum(0)
    total = float(cdf[-1])
    if total <= 0.0:  # nothing left (rounding): the most likely token
        return int(dist.argmax())
    i = int(torch.searchsorted(cdf, torch.tensor([u * total], dtype=torch.float64, device=dist.device), right=True))
    i = min(i, dist.shape[0] - 1)
    if dist[i] == 0:  # rounding landed past the last token with mass
        return int(dist.argmax())
    return i
