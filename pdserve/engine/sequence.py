"""A request's state inside the engine, and what the engine hands back."""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.engine.sampling_params import SamplingParams
from pdserve.kv.hashing import params_root

# what LLMEngine.reserve_for_transfer returns for a reservation with no room yet, waiting in line
PENDING = "pending"


def choice_request_id(request_id: str, index: int = 0) -> str:
    """The engine request id of choice `index` of API request `request_id`.

    One API request is n choices x k prompts engine requests; each gets the
    request's id plus `-{index}`. A worker's control routes carry one choice, so
    their engine request is index 0 (the router's own id already names the choice)."""
    return f"{request_id}-{index}"


class Status(enum.Enum):
    WAITING = "waiting"
    # Blocks allocated, KV on its way from outside (a prefill worker, a lower cache tier);
    # not schedulable until the KV is in.
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


class TokenIds:
    """A sequence's prompt and output ids read as one list, without joining them: a step
    reads the few tokens it computes, so its cost does not grow with the history."""

    __slots__ = ("prompt", "output")

    def __init__(self, prompt: list[int], output: list[int]):
        self.prompt, self.output = prompt, output

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output)

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(self.prompt, self.output)

    def __getitem__(self, i):
        p = len(self.prompt)
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                return list(self)[i]
            if stop <= p:
                return self.prompt[start:stop]
            if start >= p:
                return self.output[start - p : stop - p]
            return self.prompt[start:] + self.output[: stop - p]
        if i < 0:
            i += len(self)
        return self.prompt[i] if i < p else self.output[i - p]


class OutputText:
    """A completion's text, built piece by piece: appending a step's piece, reading the tail
    a stop string may span and cutting it there touch only that end, never the whole text
    (a `str +=` would copy all of it at every token). `str()` joins it."""

    __slots__ = ("_parts", "_len")

    def __init__(self, text: str = ""):
        self._parts: list[str] = [text] if text else []
        self._len = len(text)

    def __len__(self) -> int:
        return self._len

    def __str__(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def append(self, piece: str) -> None:
        if piece:
            self._parts.append(piece)
            self._len += len(piece)

    def tail(self, start: int) -> str:
        """The text from position `start` to the end ("" when `start` is past it)."""
        if start >= self._len:
            return ""
        pieces, covered = [], self._len
        for part in reversed(self._parts):
            pieces.append(part)
            covered -= len(part)
            if covered <= start:
                break
        return "".join(reversed(pieces))[max(0, start) - covered :]

    def truncate(self, length: int) -> None:
        """Keep the first `length` characters."""
        while self._parts and self._len - len(self._parts[-1]) >= length:
            self._len -= len(self._parts.pop())
        if self._len > length:
            self._parts[-1] = self._parts[-1][: len(self._parts[-1]) - (self._len - length)]
            self._len = length


@dataclass
class Sequence:
    seq_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first under the priority policy
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Set when the KV of these prompt tokens arrives from elsewhere (a prefill
    # worker, a lower cache tier) instead of being computed here.
    num_external_tokens: int = 0
    num_preemptions: int = 0
    # text bookkeeping (owned by the output processor)
    text: OutputText = field(default_factory=OutputText)
    emitted_text_len: int = 0  # how much of the text has been reported as deltas
    logprobs: list[dict[int, float]] = field(default_factory=list)
    logprob_ranks: list[int | None] = field(default_factory=list)  # each chosen token's, in the vocabulary
    # with params.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    prompt_logprob_ranks: list[int | None] = field(default_factory=lambda: [None])
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # prompt tokens whose KV was not computed for it when it was first scheduled: prefix-cache
    # hits and lower-tier loads (vLLM's num_cached_tokens); None until then
    num_cached_tokens: int | None = None
    # where its block hashes start: its cache salt and LoRA adapter, hashed (kv/hashing.py)
    hash_root: int = field(init=False)

    def __post_init__(self):
        self.hash_root = params_root(self.params)

    @property
    def all_token_ids(self) -> TokenIds:
        """Prompt then output ids, as one read-only list (a view: nothing is copied)."""
        return TokenIds(self.prompt_token_ids, self.output_token_ids)

    @property
    def output_text(self) -> str:
        return str(self.text)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt must be computed
        here, token by token, rather than found in a cache or received."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)


@dataclass
class Logprob:
    """A token's log-probability as vLLM's offline API gives it: the value, the token's rank in
    the whole vocabulary (1 = the most likely), and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def as_logprobs(entries: list, ranks: list, decode) -> list:
    """Per position {token id: logprob} (the chosen token first, then the top ones in order) as
    {token id: Logprob}; `ranks[i]` is the chosen token's rank (None where unknown). The top
    ones are numbered 1..k in their order, as vLLM numbers them: every token above a top-k
    token is in the top k, or is the chosen one, so a top token's rank is one more than the
    listed tokens above it, and tied ones keep their order."""
    out = []
    for i, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        items = list(entry.items())
        row = {}
        for j, (tok, lp) in enumerate(items):
            if j == 0:  # the chosen token
                rank = ranks[i] if i < len(ranks) else None
            else:
                rank = 1 + sum(v > lp or (v == lp and k < j) for k, (_, v) in enumerate(items))
            row[tok] = Logprob(lp, rank, decode(tok))
        out.append(row)
    return out


@dataclass
class CompletionOutput:
    """One completion of a request.

    In the output of a finished request it is the whole completion. In the
    outputs `LLMEngine.step` reports while the request runs, it holds only what
    is new since the previous report, as vLLM's DELTA output kind: `token_ids`
    (the request output's `new_token_ids`), `text` (its `new_text`: held back
    while a stop string may be completing) and `logprobs` (those of the new
    tokens); `cumulative_logprob` is the running total. Callers that want the
    whole completion so far add the deltas up."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """What `LLMEngine.step` reports for a request that got a token this step (see
    CompletionOutput: the whole completion once it has finished, the new part before)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    new_token_ids: list[int] = field(default_factory=list)  # delta since the last report
    new_text: str = ""
    metrics: dict = field(default_factory=dict)
    # with SamplingParams.prompt_logprobs, in the request's first output (and its final one):
    # per prompt token {token id: logprob} (that token's, then the top ones), the first None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens found cached (prefix cache, lower KV tiers) rather than computed, as vLLM
    num_cached_tokens: int | None = None
    # with prompt_logprobs as {token id: logprob} (the servers' form): each prompt token's rank
    # in the whole vocabulary, the first None (the offline form has them in its Logprobs)
    prompt_logprob_ranks: list[int | None] | None = None
