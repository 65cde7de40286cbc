"""Request bodies of the OpenAI API, validated strictly, and their sampling parameters.

Types are checked here (strict pydantic: no "5" for 5, no true for 1); value
ranges are checked by `SamplingParams` so the engine and the API agree on
them. Anything that could fail later inside a batched engine step (a seed out
of range, too many logprobs) must be refused here, because a failure there
would hit every request in the batch.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.engine.sampling_params import MAX_LOGPROBS, SEED_MAX, SEED_MIN, InvalidRequest, SamplingParams
from pdserve.server.errors import APIError, bad_request, from_validation_errors

MAX_N = 128
_PRIORITY_MIN, _PRIORITY_MAX = -(1 << 63), (1 << 63) - 1  # an int64, wherever it travels


class _Strict(BaseModel):
    # Unknown fields are ignored, as OpenAI's own server does, so newer clients keep working.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields both endpoints share, with vLLM's extensions (top_k, min_p, ...)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = Field(0, ge=_PRIORITY_MIN, le=_PRIORITY_MAX)

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            # choice j is seeded with seed + j, which must still be a valid seed
            raise bad_request(f"seed + n - 1 must be at most {SEED_MAX}", "seed")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; n is handled by the caller (one engine request per choice)."""
        given = {
            k: getattr(self, k)
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
            )
            if getattr(self, k) is not None
        }
        try:
            return SamplingParams(
                n=1,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=self.stop or [],
                stop_token_ids=self.stop_token_ids or [],
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logprobs=logprobs,
                **given,
            )
        except InvalidRequest as e:
            raise bad_request(str(e), e.param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = str | list[int] | list[str | list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = 16  # the legacy completions API's default
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = None

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n when given (no server-side ranking)", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise bad_request("prompt must not be empty", "prompt")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if self.response_format is not None and self.response_format.type != "text":
            raise bad_request("only response_format type 'text' is supported", "response_format")
        if self.tools:
            raise bad_request("tools are not supported by this server", "tools")
        if self.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported by this server", "tool_choice")

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        return out


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids outside the vocabulary: refused here, before a tokenizer or the engine sees them."""
    if ids and not (0 <= min(ids) and max(ids) < vocab_size):
        raise bad_request(f"{param}: token ids must be in [0, {vocab_size})", param)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


# An escaped high surrogate not followed by a low one, or a low one not after a
# high one: the only way a lone surrogate gets into a strictly decoded body (a
# pair, as json.dumps writes emoji, is one character). Cheap to look for; the
# walk that finds which field holds it is not.
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F]"
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate_at(data) -> str | None:
    """Dotted path ("messages.0.content") of a string that is not valid Unicode, or of the
    object with such a key (never the key itself: it could not be sent back); else None."""
    stack = [("", data)]
    while stack:  # not recursive: the body may be nested as deep as the parser allows
        path, v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return path
        elif isinstance(v, (dict, list)):
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str) and _SURROGATE.search(k):
                    return path
                stack.append((f"{path}.{k}" if path else str(k), x))
    return None


def _load_json(raw: bytes):
    """Bytes of a request body -> JSON data, or an APIError 400 naming the fault."""
    try:
        # Strict UTF-8 (RFC 8259): json.loads on bytes would let encoded surrogates through.
        text = raw.decode("utf-8-sig")
        # NaN and Infinity are not JSON; Python's parser would accept them and they
        # would reach the sampler as non-finite temperatures.
        data = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise bad_request("the request body is nested too deeply", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    # A lone surrogate ("\ud800") is valid JSON but not Unicode: the tokenizer and
    # every UTF-8 encoder downstream would fail on it.
    if _LONE_SURROGATE_ESCAPE.search(text) and (at := _lone_surrogate_at(data)) is not None:
        where = f"{at}: " if at else ""
        raise bad_request(
            f"{where}a string holds a lone UTF-16 surrogate, which is not valid Unicode", param=at or None
        )
    return data


def parse_body(raw: bytes, model_cls: type[_Strict]):
    """Bytes of a request body -> a validated model, or an APIError 400 naming the fault."""
    data = _load_json(raw)
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    try:
        req = model_cls.model_validate(data)
    except ValidationError as e:
        raise from_validation_errors(e.errors(include_url=False)) from None
    if hasattr(req, "check"):
        req.check()
    return req


def check_model(requested: str | None, served: list[str]) -> None:
    if requested is not None and requested not in served:
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )
