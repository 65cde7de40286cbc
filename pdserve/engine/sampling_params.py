"""Per-request sampling parameters, with vLLM's names and defaults."""

from __future__ import annotations

import json as _json
from dataclasses import dataclass, field

# Bounds on what a caller may ask for. Each stop string is searched for after
# every token and held back from streams while it could still complete, and each
# stop id is checked per token: their counts and lengths are per-token work.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows; each bias in [-100, 100]
MAX_ALLOWED_TOKEN_IDS = 1 << 17  # more than any vocabulary: the list is a mask's worth
MAX_CACHE_SALT_CHARS = 1024  # hashed once per request; a tenant id or a secret fits
MAX_LORA_KEY_CHARS = 256  # an adapter's name (at most 128) @ its fingerprint
# bad_words: each is tokenized once a request and its token sequence compared with the
# output's tail at every step
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# The sampler puts top_k in an int64 tensor (a value outside would fail the whole batch's
# step); a seed is read as 64 bits (sampler.seeded_uniform): outside [-2^63, 2^64) two
# seeds would draw the same numbers.
MAX_TOP_K = (1 << 31) - 1
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


def thinking_closed(prompt: list[int], start: int, end: int) -> bool:
    """Whether a prompt closed a reasoning model's thinking: an end token after its last start
    token (a template that switched thinking off); a prompt that opens it again after an earlier
    turn's thinking is open."""
    for t in reversed(prompt):
        if t == end:
            return True
        if t == start:
            return False
    return False


class InvalidRequest(ValueError):
    """A request the engine refuses: the message names the parameter at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _bad(cond: bool, param: str, message: str) -> None:
    if cond:
        raise InvalidRequest(message, param)


# Structured outputs: sizes of what a caller may constrain the output with (the grammar is
# compiled per request; its parser's own limits are in structured_outputs.py)
MAX_GRAMMAR_CHARS = 64 * 1024  # a regex or a JSON schema as JSON text
MAX_CFG_CHARS = 16 * 1024  # a Lark or GBNF grammar (GBNF is converted in Python, in quadratic time)
MAX_CHOICES = 1024
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, any JSON object, a regular expression, one of a
    few strings, or a grammar (Lark, or llama.cpp's GBNF), as vLLM's parameters of the same
    name: exactly one of them. The output is then generated token by token under a mask of
    the tokens that keep it valid (pdserve/engine/structured_outputs.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # JSON without any whitespace between tokens (vLLM's option); by default up to 32
    # whitespace characters may separate two tokens, enough to pretty-print
    disable_any_whitespace: bool = False

    def __post_init__(self):
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        _bad(len(given) != 1, "structured_outputs", f"give exactly one of {', '.join(STRUCTURED_KINDS)} (got {given})")
        if self.json is not None:
            _bad(not isinstance(self.json, (str, dict)), "structured_outputs", "json is a JSON schema")
            try:
                size = len(self.json) if isinstance(self.json, str) else len(_json.dumps(self.json))
            except (RecursionError, TypeError, ValueError):
                raise InvalidRequest(
                    "json is not a JSON schema (or is nested too deeply)", "structured_outputs"
                ) from None
            _bad(size > MAX_GRAMMAR_CHARS, "structured_outputs", f"the JSON schema is over {MAX_GRAMMAR_CHARS} chars")
        for name, most in (("regex", MAX_GRAMMAR_CHARS), ("grammar", MAX_CFG_CHARS)):
            v = getattr(self, name)
            if v is not None:
                _bad(not isinstance(v, str) or not v, "structured_outputs", f"{name} is a non-empty string")
                _bad(len(v) > most, "structured_outputs", f"{name} is over {most} chars")
        if self.choice is not None:
            ok = isinstance(self.choice, list) and all(isinstance(c, str) and c for c in self.choice)
            _bad(not ok or not self.choice, "structured_outputs", "choice is a list of non-empty strings")
            _bad(len(self.choice) > MAX_CHOICES, "structured_outputs", f"at most {MAX_CHOICES} choices")
            _bad(
                sum(map(len, self.choice)) > MAX_GRAMMAR_CHARS,
                "structured_outputs",
                f"the choices hold over {MAX_GRAMMAR_CHARS} chars",
            )

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))


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
    # per prompt token (from the second on), its logprob and the top ones: the prompt is then
    # computed whole, never taken from the prefix cache, a lower KV tier or another worker
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # {token id: bias} added to the logits before sampling (OpenAI's logit_bias; logprobs
    # stay the model's own, as vLLM reports them)
    logit_bias: dict[int, float] | None = None
    # the output held to a JSON schema, a regex, a choice or a grammar (vLLM's name)
    structured_outputs: StructuredOutputsParams | None = None
    # [start, end]: a reasoning model's <think> and </think> token ids (the server sets them
    # under --reasoning-parser). A structured output then holds only from the first token after
    # the end token, so that the model thinks first, as vLLM does; where the prompt already
    # closed the thinking (an end token after its last start token: thinking switched off by the
    # template), from the first token
    reasoning_token_ids: list[int] | None = None
    # only these tokens may be sampled (vLLM's name): every other logit is -inf
    allowed_token_ids: list[int] | None = None
    # Prefix-cache isolation (vLLM's request field `cache_salt`): the request reuses only KV
    # cached for requests with the same salt (pdserve/kv/hashing.py). Carried here so that it
    # travels with the request to every worker and tier; `LLM.generate` also takes it in a
    # prompt dict, as vLLM does.
    cache_salt: str | None = None
    # words the output must not contain (vLLM's): each word's last token is forbidden where
    # the output ends with the tokens before it (with and without a leading space)
    bad_words: list[str] | None = None
    # the LoRA adapter it runs with (pdserve/engine/lora.py): the adapter's key, "name@fingerprint",
    # set by the server from the request's model, or by LLM.generate from its lora_request. Here,
    # so that it travels with the request to every worker, and starts its block-hash chain
    lora_adapter: str | None = None

    def __post_init__(self):
        if isinstance(self.structured_outputs, dict):  # from JSON (another worker, the API)
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise InvalidRequest(f"structured_outputs: {e}", "structured_outputs") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.reasoning_token_ids, tuple):
            self.reasoning_token_ids = list(self.reasoning_token_ids)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            self.bad_words = list(words) or None
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            try:  # keys arrive as strings from JSON
                self.logit_bias = {int(k): float(v) for k, v in dict(self.logit_bias).items()} or None
            except (TypeError, ValueError):
                raise InvalidRequest("logit_bias maps token ids to numbers", "logit_bias") from None
        self._check()

    def _check(self):
        _bad(self.n < 1, "n", "n must be at least 1")
        _bad(self.temperature < 0, "temperature", "temperature must be >= 0")
        _bad(not 0 < self.top_p <= 1, "top_p", "top_p must be in (0, 1]")
        _bad(not -1 <= self.top_k <= MAX_TOP_K, "top_k", f"top_k must be -1 (off) or in [1, {MAX_TOP_K}]")
        _bad(not 0 <= self.min_p <= 1, "min_p", "min_p must be in [0, 1]")
        _bad(self.repetition_penalty <= 0, "repetition_penalty", "repetition_penalty must be > 0")
        _bad(not -2 <= self.presence_penalty <= 2, "presence_penalty", "presence_penalty must be in [-2, 2]")
        _bad(not -2 <= self.frequency_penalty <= 2, "frequency_penalty", "frequency_penalty must be in [-2, 2]")
        _bad(self.max_tokens is not None and self.max_tokens < 1, "max_tokens", "max_tokens must be at least 1")
        _bad(self.min_tokens < 0, "min_tokens", "min_tokens must be >= 0")
        _bad(
            self.max_tokens is not None and self.min_tokens > self.max_tokens,
            "min_tokens",
            f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
        )
        _bad(
            self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX,
            "seed",
            f"seed must be in [{SEED_MIN}, {SEED_MAX}]",
        )
        _bad(
            self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"logprobs must be between 0 and {MAX_LOGPROBS}",
        )
        _bad(
            self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
            "prompt_logprobs",
            f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}",
        )
        self._check_stops()
        if self.cache_salt is not None:
            _bad(
                not isinstance(self.cache_salt, str) or not self.cache_salt,
                "cache_salt",
                "cache_salt must be a non-empty string if given",
            )
            _bad(
                len(self.cache_salt) > MAX_CACHE_SALT_CHARS,
                "cache_salt",
                f"cache_salt is over {MAX_CACHE_SALT_CHARS} characters",
            )
        if self.lora_adapter is not None:
            _bad(
                not isinstance(self.lora_adapter, str) or not 0 < len(self.lora_adapter) <= MAX_LORA_KEY_CHARS,
                "lora_adapter",
                f"lora_adapter is an adapter's key of 1 to {MAX_LORA_KEY_CHARS} characters",
            )
        if self.bad_words is not None:
            words = self.bad_words
            _bad(len(words) > MAX_BAD_WORDS, "bad_words", f"{len(words)} bad words; at most {MAX_BAD_WORDS}")
            _bad(
                not all(isinstance(w, str) and w.strip() for w in words),
                "bad_words",
                "bad_words are non-blank strings",
            )
            _bad(
                max(map(len, words)) > MAX_BAD_WORD_CHARS,
                "bad_words",
                f"a bad word of over {MAX_BAD_WORD_CHARS} characters",
            )
        if self.reasoning_token_ids is not None:
            r = self.reasoning_token_ids
            _bad(
                not isinstance(r, (list, tuple))
                or len(r) != 2
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r),
                "reasoning_token_ids",
                "reasoning_token_ids is [start, end], two token ids",
            )
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            _bad(not ids, "allowed_token_ids", "allowed_token_ids must not be empty")
            _bad(
                len(ids) > MAX_ALLOWED_TOKEN_IDS,
                "allowed_token_ids",
                f"{len(ids)} allowed token ids; at most {MAX_ALLOWED_TOKEN_IDS}",
            )
            _bad(min(ids) < 0, "allowed_token_ids", "allowed token ids must be >= 0")
        if self.logit_bias:
            _bad(
                len(self.logit_bias) > MAX_LOGIT_BIAS,
                "logit_bias",
                f"{len(self.logit_bias)} logit_bias entries; at most {MAX_LOGIT_BIAS} are allowed",
            )
            _bad(min(self.logit_bias) < 0, "logit_bias", "logit_bias token ids must be >= 0")
            _bad(
                not all(-100 <= v <= 100 for v in self.logit_bias.values()),
                "logit_bias",
                "logit_bias values must be in [-100, 100]",
            )

    def _check_stops(self):
        _bad(
            len(self.stop) > MAX_STOP_STRINGS,
            "stop",
            f"{len(self.stop)} stop strings; at most {MAX_STOP_STRINGS} are allowed",
        )
        longest = max(map(len, self.stop), default=0)
        _bad(
            longest > MAX_STOP_STRING_CHARS,
            "stop",
            f"a stop string of {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed",
        )
        _bad(
            len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS,
            "stop_token_ids",
            f"{len(self.stop_token_ids)} stop token ids; at most {MAX_STOP_TOKEN_IDS} are allowed",
        )
        _bad(any(t < 0 for t in self.stop_token_ids), "stop_token_ids", "stop token ids must be >= 0")

    def max_output_tokens(self, prompt_len: int, max_model_len: int) -> int:
        """The most tokens the request can produce: `max_tokens`, or what the context leaves
        after the prompt where that is less (a request asking for more ends there, "length")."""
        room = max_model_len - prompt_len
        return room if self.max_tokens is None else min(self.max_tokens, room)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    @property
    def needs_penalties(self) -> bool:
        """Anything that changes the logits before sampling: the penalties, logit_bias and a
        structured output's mask."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.structured_outputs is not None
            or self.allowed_token_ids is not None
            or self.bad_words is not None
        )
