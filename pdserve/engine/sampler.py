"""Turn a batch of logits into next tokens: penalties, temperature, top-k/top-p/min-p,
seeded sampling, logprobs. An all-greedy batch without extras is one argmax."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.sampling_params import SamplingParams, thinking_closed


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (logprob of the sampled token, {token_id: logprob} of the top-k, the sampled
    # token's rank in the vocabulary) or None
    logprobs: list[tuple[float, dict[int, float], int] | None]


class _Seen:
    """What the penalties of one sequence read, kept up to date token by token: how often
    each token was output, and which the prompt holds. A step adds its new tokens only,
    instead of rebuilding both from the whole history."""

    __slots__ = ("counts", "in_prompt", "num_counted")

    def __init__(self, prompt: list[int], vocab: int, device: torch.device):
        self.counts = torch.zeros(vocab, device=device)
        self.in_prompt = torch.zeros(vocab, dtype=torch.bool, device=device)
        self.in_prompt[torch.tensor(prompt, dtype=torch.long, device=device)] = True
        self.num_counted = 0

    def update(self, output: list[int]) -> None:
        new = output[self.num_counted :]
        if new:
            ids = torch.tensor(new, dtype=torch.long, device=self.counts.device)
            self.counts.index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
            self.num_counted = len(output)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """The token sequences of `bad_words`, as vLLM finds them: each word as written (leading
    spaces dropped), and with one leading space where that is as many tokens and starts with
    another token (a word in mid-text)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        for ids in (bare, spaced):
            if ids and ids not in out and (ids is bare or (len(ids) == len(bare) and ids[0] != bare[0])):
                out.append(ids)
    return out


_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a 64-bit value whose every bit depends on every bit of `x`."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def seeded_uniform(seed: int, position: int) -> float:
    """The uniform number in [0, 1) that draws output token `position` of a request with `seed`.

    A function of the two alone, not the next number of a per-request stream: a token is the
    same whichever worker samples it (the prefill worker samples the first, a decode worker
    the rest), however many tokens a step makes of it (speculative decoding), and whatever
    else ran in its batches."""
    return (_mix64(_mix64(seed & _MASK64) ^ position) >> 11) * (1.0 / (1 << 53))


class Sampler:
    def __init__(self, device: torch.device, structured=None, bad_words_ids=None):
        self.device = device
        self._seen: dict[str, _Seen] = {}
        self._allowed: dict[str, torch.Tensor] = {}  # per sequence: its allowed_token_ids as a mask
        # bad_words (a tuple) -> their token sequences: the engine's, which checked them when the
        # request came (every id in the vocabulary) and keeps them cached
        self.bad_words_ids = bad_words_ids
        self._bad_words: dict[str, list[list[int]]] = {}  # per sequence: its bad words' token ids
        self._reasoning: dict[str, list] = {}  # per sequence: where its grammar starts (_grammar_start)
        # structured_outputs.StructuredOutputs: the masks of constrained sequences
        self.structured = structured

    def forget(self, seq_id: str) -> None:
        self._seen.pop(seq_id, None)
        self._allowed.pop(seq_id, None)
        self._bad_words.pop(seq_id, None)
        self._reasoning.pop(seq_id, None)
        if self.structured is not None:
            self.structured.forget(seq_id)

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seq_ids: list[str],
        token_history: list[tuple[list[int], list[int]]],
        positions: list[int] | None = None,
    ) -> SampleResult:
        """logits [N, V] fp32; token_history[i] = (prompt ids, output ids) of row i; positions[i]:
        the output position row i samples (default: len of its output ids; a seed draws from it)."""
        want_logprobs = any(p.logprobs is not None for p in params)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if all(p.greedy and not p.needs_penalties for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            logits = self._apply_penalties(logits.clone(), params, seq_ids, token_history)
            if positions is None:
                positions = [len(h[1]) for h in token_history]
            tokens = self._sample(logits, params, positions)
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(raw_logprobs, token_list, params))

    def _apply_penalties(self, logits, params, seq_ids, history):
        for i, p in enumerate(params):
            self._apply_row(logits, i, p, seq_ids, history)
        held, starts = [], []
        for i, p in enumerate(params):
            if p.structured_outputs is not None:
                start = self._grammar_start(seq_ids[i], p, history[i])
                if start is not None:  # None: still thinking, not held yet
                    held.append(i)
                    starts.append(start)
        if held:  # last: nothing may bring a masked token back; one copy and one fill for all rows
            masks = torch.stack(
                [
                    self.structured.allowed(seq_ids[i], params[i].structured_outputs, history[i][1], start)
                    for i, start in zip(held, starts)
                ]
            ).to(logits.device)
            rows = torch.tensor(held, device=logits.device)
            logits[rows] = logits[rows].masked_fill(~masks, float("-inf"))
        return logits

    def _grammar_start(self, seq_id: str, p: SamplingParams, history) -> int | None:
        """Where in the output a structured output's grammar starts reading: 0, or with
        reasoning_token_ids after the end of the thinking; None while it thinks."""
        prompt, output = history
        if p.reasoning_token_ids is None:
            return 0
        start, end = p.reasoning_token_ids
        state = self._reasoning.get(seq_id)
        if state is None or state[2] > len(output):  # new, or the id was reused
            # [the grammar's first output token (None: still thinking), scanned up to, seen]
            state = self._reasoning[seq_id] = [0 if thinking_closed(prompt, start, end) else None, 0, 0]
        state[2] = len(output)
        if state[0] is None:
            try:
                state[0] = output.index(end, state[1]) + 1
            except ValueError:
                state[1] = len(output)
                return None
        return state[0]

    def _apply_row(self, logits, i, p, seq_ids, history) -> None:
        """allowed_token_ids, bad_words, logit_bias and the penalties, on row i."""
        if p.bad_words:
            self._ban_bad_words(logits, i, p, seq_ids[i], history[i][1])
        if p.allowed_token_ids is not None:
            allowed = self._allowed.get(seq_ids[i])
            if allowed is None:  # made once a sequence, not once a step
                allowed = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
                allowed[torch.tensor(p.allowed_token_ids, dtype=torch.long, device=logits.device)] = True
                self._allowed[seq_ids[i]] = allowed
            logits[i].masked_fill_(~allowed, float("-inf"))
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, bias)
        if p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty:
            return
        prompt, output = history[i]
        seen = self._seen.get(seq_ids[i])
        if seen is None or seen.num_counted > len(output):  # new, or the id was reused
            seen = self._seen[seq_ids[i]] = _Seen(prompt, logits.shape[1], logits.device)
        seen.update(output)
        if p.repetition_penalty != 1.0:
            mask = seen.in_prompt | (seen.counts > 0)
            row = logits[i, mask]
            logits[i, mask] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if output and (p.presence_penalty or p.frequency_penalty):
            counts = seen.counts
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _ban_bad_words(self, logits, i, p, seq_id: str, output: list[int]) -> None:
        words = self._bad_words.get(seq_id)
        if words is None:  # looked up once a sequence, not once a step
            words = self._bad_words[seq_id] = self.bad_words_ids(tuple(p.bad_words))
        banned = [w[-1] for w in words if len(w) == 1 or (len(output) >= len(w) - 1 and output[1 - len(w) :] == w[:-1])]
        if banned:
            logits[i, banned] = float("-inf")

    def _sample(self, logits, params, positions) -> torch.Tensor:
        greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        greedy_tokens = logits.argmax(dim=-1)
        temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=logits.device).unsqueeze(1)
        logits = logits / temps
        logits = _top_k_top_p_min_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        # Inverse CDF: one uniform number per row (`seeded_uniform` of its position when it
        # has a seed), located in the row's cumulative distribution. An exponential
        # race over the vocabulary drew 49,152 random numbers per row: 1.3 ms a row on
        # this CPU, more than a decode step's share of the matrix products at batch 8.
        u = torch.empty(len(params), 1, dtype=torch.float64, device=logits.device)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64, device=logits.device)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if seeded:
            u[seeded] = torch.tensor(
                [[seeded_uniform(params[i].seed, positions[i])] for i in seeded], dtype=torch.float64, device=u.device
            )
        cdf = probs.double().cumsum(dim=-1)  # fp64: a 49K-term fp32 sum drifts at the tail
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
        # rounding can only land past the last token with mass; never on one without
        zero = probs.gather(1, sampled.unsqueeze(1)).squeeze(1) == 0
        if zero.any():
            sampled = torch.where(zero, probs.argmax(dim=-1), sampled)
        return torch.where(greedy, greedy_tokens, sampled)

    @staticmethod
    def _logprobs(raw, tokens, params):
        if raw is None:
            return [None] * len(tokens)
        own = raw.gather(1, torch.tensor(tokens, device=raw.device)[:, None])
        # each sampled token's rank in the whole vocabulary, ties counted against it (as vLLM)
        ranks = (raw >= own).sum(dim=1).tolist()
        own = own[:, 0].tolist()
        out = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            top = {}
            if p.logprobs > 0:
                vals, ids = raw[i].topk(p.logprobs)
                top = dict(zip(ids.tolist(), vals.tolist()))
            out.append((own[i], top, ranks[i]))
        return out


def _top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    if all(p.top_k == -1 and p.top_p >= 1.0 and p.min_p == 0.0 for p in params):
        return logits
    vocab = logits.shape[1]
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    top_p = torch.tensor([p.top_p for p in params], device=logits.device)
    min_p = torch.tensor([p.min_p for p in params], device=logits.device)
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # keep a token if the mass strictly before it is < top_p (the first always stays)
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= top_p.unsqueeze(1)
    drop |= probs < (min_p.unsqueeze(1) * probs[:, :1])
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, sorted_logits)
