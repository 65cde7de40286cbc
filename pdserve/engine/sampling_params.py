"""Per-request sampling parameters, with vLLM's names and defaults."""
from __future__ import annotations

from dataclasses import dataclass, field


class InvalidRequest(ValueError):
    """A request the engine refuses: the message names the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 / 0 -> off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self._check()

    def _check(self):
        def bad(cond, param, msg):
            if cond:
                raise InvalidRequest(msg, param)

        bad(self.n < 1, "n", "n must be at least 1")
        bad(self.temperature < 0, "temperature", "temperature must be >= 0")
        bad(not 0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]")
        bad(self.top_k < -1, "top_k", "top_k must be -1 (off) or >= 1")
        bad(not 0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]")
        bad(self.repetition_penalty <= 0, "repetition_penalty", "repetition_penalty must be > 0")
        bad(not -2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]")
        bad(not -2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        bad(self.max_tokens is not None and self.max_tokens < 1, "max_tokens", "max_tokens must be at least 1")
        bad(self.min_tokens < 0, "min_tokens", "min_tokens must be >= 0")
        bad(self.logprobs is not None and not 0 <= self.logprobs <= 20, "logprobs",
            "logprobs must be between 0 and 20")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)
