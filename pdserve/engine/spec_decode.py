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

Verification (`verify`) keeps what the model would have produced without drafts: each
position is sampled exactly as without drafts (greedy: the argmax; sampling: temperature,
top-k/top-p/min-p and one uniform number, which for a seeded request is a function of the
seed and the output position), and the drafts are kept while each equals its position's
token, then that token. For drafts that are certain guesses (their proposal puts all its
mass on one token), this is speculative sampling's rule itself: a draft d stands with
probability p(d), and when it does not, the token comes from p without d, renormalised. So
every token is distributed as without drafts, and a seeded request's tokens are the very
same (up to the last bits of the logits: a pass over several positions may run other
kernels than a one-token decode).

Requests whose logits depend on the tokens before them in ways a batch of positions
cannot see (repetition, presence and frequency penalties, bad_words, structured outputs)
decode as before, one token a step, in the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pdserve.config import SpeculativeConfig
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import Sequence

if TYPE_CHECKING:  # the simulator imports this module and never loads torch
    import torch


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
    `tokens` of length `min_n`..`max_n` (empty when no such suffix occurs earlier).

    One pass over the history finds where its last token occurs before the end; those places
    are then narrowed token by token backwards, so the cost is one scan plus the matches."""
    length = len(tokens)
    if length < 2:
        return tokens[:0]
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])  # a match ending there
    best = int(ends[-1]) if len(ends) and min_n <= 1 else -1
    n = 1
    while len(ends) and n < max_n:
        ends = ends[ends >= n]
        ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        n += 1
        if len(ends) and n >= min_n:
            best = int(ends[-1])
    if best < 0:
        return tokens[:0]
    return tokens[best + 1 : best + 1 + k]


MAX_BACKOFF_STEPS = 32  # the longest a sequence whose guesses keep failing goes without guessing
_NO_TOKENS = np.empty(0, dtype=np.int64)


class _History:
    """A sequence's token ids as a growing numpy array (appended to, never rebuilt), and how its
    guesses fared: none at its next `skip` chances after a guess whose first token was wrong
    (`backoff` of them, doubling while that keeps happening)."""

    __slots__ = ("buf", "n", "skip", "backoff")

    def __init__(self):
        self.buf = _NO_TOKENS  # made at the first lookup (the simulator's drafter never looks)
        self.n = 0
        self.skip = 0
        self.backoff = 1

    def sync(self, seq: Sequence) -> np.ndarray:
        total = seq.num_tokens
        if self.n > total:  # preempted with a reused id, or anything odd: start again
            self.n = 0
        if total > len(self.buf):
            grown = np.empty(max(total, 2 * len(self.buf), 256), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if total > self.n:
            self.buf[self.n : total] = seq.all_token_ids[self.n : total]
            self.n = total
        return self.buf[:total]


class NgramProposer:
    """Drafts by prompt lookup, per sequence (`propose`); `observe` how they fared; `forget` a
    finished sequence.

    A wrong guess costs its rows and gives nothing, and on a CPU a verifying step takes about
    twice a one-token step: a sequence whose text does not repeat its context would pay that on
    every step where a stray n-gram matches, slowing its own tokens and its batch's. So after a
    guess whose first token was already wrong, a sequence does not guess for a while (its next
    chance to, then 2, 4, ... up to MAX_BACKOFF_STEPS chances while that keeps happening; any
    kept token starts over). Which tokens come out is unchanged: only how many positions a step
    computes. (Shrinking the guess after a partial miss was tried too: it cost copying text more than it
    saved, 4.3 -> 4.0 tokens a guessing step.)"""

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
        if hist.skip:
            hist.skip -= 1
            return []
        return self._lookup(seq, hist, k)

    def _lookup(self, seq: Sequence, hist: _History, k: int) -> list[int]:
        c = self.config
        return find_ngram_continuation(hist.sync(seq), c.prompt_lookup_min, c.prompt_lookup_max, k).tolist()

    def observe(self, seq_id: str, num_drafts: int, num_accepted: int) -> None:
        """How a sequence's guesses of this step fared (the engine's verification)."""
        hist = self._histories.get(seq_id)
        if hist is None or not num_drafts:
            return
        if num_accepted:
            hist.backoff = 1
        else:
            hist.skip = hist.backoff
            hist.backoff = min(2 * hist.backoff, MAX_BACKOFF_STEPS)

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
    """Check each sequence's drafts against the logits of its len(drafts) + 1 positions (rows of
    `logits`, sequence after sequence, in the order given): every row is sampled as the sampler
    samples any (the same processing, the same seeded number for the same output position),
    and a sequence keeps its drafts while each equals its row's token, then that row's token."""
    params: list[SamplingParams] = []
    ids: list[str] = []
    history: list[tuple[list[int], list[int]]] = []
    positions: list[int] = []
    for seq, d in zip(seqs, drafts):
        n = len(seq.output_token_ids)
        params.extend([seq.params] * (len(d) + 1))
        ids.extend([seq.seq_id] * (len(d) + 1))
        history.extend([(seq.prompt_token_ids, seq.output_token_ids)] * (len(d) + 1))
        positions.extend(range(n, n + len(d) + 1))
    result = sampler(logits, params, ids, history, positions)
    out: list[Verified] = []
    first = 0
    for d in drafts:
        target = result.token_ids[first : first + len(d) + 1]
        a = 0
        while a < len(d) and d[a] == target[a]:
            a += 1
        out.append(Verified(d[:a] + [target[a]], result.logprobs[first : first + a + 1], a))
        first += len(d) + 1
    return out
