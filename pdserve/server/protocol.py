"""Request bodies of the OpenAI API, validated strictly, and their sampling parameters.

Types are checked here (strict pydantic: no "5" for 5, no true for 1); value
ranges are checked by `SamplingParams` so the engine and the API agree on
them. Anything that could fail later inside a batched engine step (a top_k out
of range, too many logprobs) must be refused here, because a failure there
would hit every request in the batch.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from pdserve.engine.generation_config import with_defaults
from pdserve.engine.sampling_params import (
    MAX_BAD_WORD_CHARS,
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_CHARS,
    MAX_LOGPROBS,
    SEED_MAX,
    SEED_MIN,
    InvalidRequest,
    SamplingParams,
    StructuredOutputsParams,
)
from pdserve.server.errors import APIError, bad_request, from_validation_errors

MAX_N = 128
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024  # a request's own chat template (compiled, then cached)
_PRIORITY_MIN, _PRIORITY_MAX = -(1 << 63), (1 << 63) - 1  # an int64, wherever it travels


class _Strict(BaseModel):
    # Unknown fields are ignored, as OpenAI's own server does, so newer clients keep working.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    # fields whose explicit null means something other than their default
    _null_kept: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        # an explicit null means "the default", as OpenAI and vLLM read it (SDKs send them)
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k in cls._null_kept}


# vLLM's request options that change what is generated and that this server does not
# implement: refused, never silently ignored (a value equal to vLLM's default is let through).
_NOT_IMPLEMENTED = {
    "guided_whitespace_pattern": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "logprob_token_ids": None,
    "logits_processors": None,
    "kv_transfer_params": None,
    "vllm_xargs": None,
    "repetition_detection": None,
    "thinking_token_budget": None,
}


class JsonSchemaFormat(_Strict):
    name: str = Field("", max_length=256)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` object, typed: the constraints and the whitespace switch; the
    fallback switch changes nothing here (one library); its other options are refused when set."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False

    _UNIMPLEMENTED: ClassVar[tuple[str, ...]] = (
        "whitespace_pattern",
        "structural_tag",
        "disable_additional_properties",
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data):
        if isinstance(data, dict):
            for name in cls._UNIMPLEMENTED:
                if data.get(name) not in (None, False):
                    raise bad_request(
                        f"structured_outputs.{name} is not supported by this server", "structured_outputs"
                    )
            data = {k: v for k, v in data.items() if k not in cls._UNIMPLEMENTED}
        return data

    def params(self) -> dict:
        out = {
            k: getattr(self, k) for k in ("regex", "choice", "grammar", "json_object") if getattr(self, k) is not None
        }
        if self.json_ is not None:
            out["json"] = self.json_
        return {**out, "disable_any_whitespace": self.disable_any_whitespace}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    # vLLM's; it changes nothing with a fast tokenizer (tokenizer.json: every model pdserve
    # loads), in vLLM as here, so false is accepted
    spaces_between_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = Field(0, ge=_PRIORITY_MIN, le=_PRIORITY_MAX)

    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # which end truncate_prompt_tokens keeps: "left" cuts the start (the default, as vLLM),
    # "right" the end
    truncation_side: Literal["left", "right"] = "left"

    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # which library vLLM uses: one here, ignored
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled
    # vLLM's: this request reuses only KV cached for requests with the same salt (one per
    # tenant or user keeps their prompts from hitting, or timing, each other's cache)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    # vLLM's: the prompt's token ids and each choice's generated ones in the response (what
    # an RL trainer needs, without tokenizing the text again)
    return_token_ids: bool = False
    # vLLM's: logprobs name tokens "token_id:N" instead of by their (possibly partial) text
    return_tokens_as_token_ids: bool = False
    # vLLM's: words the output must not contain (the bounds are SamplingParams'; said here too,
    # so that the API's schema describes what is accepted)
    bad_words: list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS, pattern=r"\S")]] | None = Field(
        None, max_length=MAX_BAD_WORDS
    )
    # vLLM's: each prompt token's logprob (rank, text) and this many top alternatives; the
    # prompt is then computed whole, never taken from a cache (-1, the whole vocabulary: 400)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="before")
    @classmethod
    def _refuse_unimplemented(cls, data):
        if isinstance(data, dict):
            for name, default in _NOT_IMPLEMENTED.items():
                if name in data and data[name] != default and data[name] not in (None, [], {}):
                    raise bad_request(f"{name} is not supported by this server", name)
        return data

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.prompt_logprobs and self.stream:  # as vLLM: no field to stream them in (0 is let through)
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            # choice j is seeded with seed + j, which must still be a valid seed
            raise bad_request(f"seed + n - 1 must be at most {SEED_MAX}", "seed")

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """The engine's parameters; n is handled by the caller (one engine request per choice).
        `defaults`: what the fields the request leaves out take (the model's generation config)."""
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
        if defaults:
            given, max_tokens = with_defaults(given, defaults, max_tokens)
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
                prompt_logprobs=None if self.stream else self.prompt_logprobs,
                logit_bias=self.logit_bias,
                allowed_token_ids=self.allowed_token_ids,
                structured_outputs=self.structured(),
                cache_salt=self.cache_salt,
                bad_words=self.bad_words,
                **given,
            )
        except InvalidRequest as e:
            raise bad_request(str(e), e.param) from None

    def structured(self) -> StructuredOutputsParams | None:
        """The one constraint the request gives, wherever it gives it; two are a 400."""
        found: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            schema = rf.json_schema.schema_ if rf.json_schema is not None else None
            # OpenAI's schema is optional: without one, any JSON object
            found.append(("response_format", {"json": schema} if schema is not None else {"json_object": True}))
        if self.structured_outputs is not None:
            found.append(("structured_outputs", self.structured_outputs.params()))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):  # fmt: skip
            if getattr(self, name) is not None:
                found.append((name, {key: getattr(self, name)}))
        if not found:
            return None
        if len(found) > 1:
            raise bad_request(f"give one output constraint, not {found[0][0]} and {found[1][0]}", found[1][0])
        try:
            return StructuredOutputsParams(**found[0][1])
        except InvalidRequest as e:
            raise bad_request(f"{found[0][0]}: {e}", found[0][0]) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk too (vLLM's `continuous_usage_stats`, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    def truncate(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt's last `truncate_prompt_tokens` tokens (-1: as many as the context holds
        with one token to generate), as vLLM truncates; the prompt as it is without the field."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k > max_model_len:
            raise bad_request(
                f"truncate_prompt_tokens ({k}) is more than this model's context of {max_model_len} tokens",
                "truncate_prompt_tokens",
            )
        k = max_model_len - 1 if k == -1 else k
        if self.truncation_side == "right":
            return ids[:k]
        return ids[-k:] if k else []


Prompt = str | list[int] | list[str | list[int]]


class CompletionRequest(_SamplingFields):
    # the legacy completions API's default is 16; null asks for as many as the context leaves
    _null_kept: ClassVar[frozenset[str]] = frozenset({"max_tokens"})
    prompt: Prompt
    max_tokens: int | None = 16
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
    # any role the chat template knows (vLLM passes custom ones through); the template refuses the rest
    role: str = Field(min_length=1, max_length=64)
    content: str | list[TextPart] | None = None
    name: str | None = None
    # an assistant's earlier calls and a tool's answer to one: passed to the chat template
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None
    # an assistant's earlier thinking, as a reasoning parser returned it (either name): templates
    # that show it (Qwen3's, for the turns after the last question) read `reasoning_content`
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(p.text for p in self.content)  # as vLLM joins text parts


class _ChatTemplateFields(_Strict):
    """How messages become the prompt: the same for a chat completion and /tokenize."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    tools: list[dict] | None = None
    # vLLM's: documents for a retrieval-augmented template, each a mapping of strings (a
    # "title" and a "text", say); the template reads them as `documents`
    documents: list[dict[str, str]] | None = None
    # vLLM's: a Jinja template to render this request with instead of the model's; refused
    # unless the server trusts its callers with it (--trust-request-chat-template)
    chat_template: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_TEMPLATE_CHARS)

    def check_template(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:  # named here; the tokenizer refuses it too
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true", "continue_final_message"
            )

    def template_kw(self) -> dict:
        """How Tokenizer.apply_chat_template renders these messages, besides add_generation_prompt."""
        return {
            "continue_final_message": self.continue_final_message,
            "template_args": self.chat_template_kwargs,
            "tools": self.tools,
            "documents": self.documents,
            "chat_template": self.chat_template,
        }


class ToolFunction(_Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: ToolFunction


MAX_TOOLS = 128


class ToolCalls:
    """How a chat request's tools are called: one named function, or at least one of them
    ("required"). The arguments are generated under a JSON schema built from the functions'
    `parameters`, so no tool-call parser is needed, as vLLM does for these two choices."""

    def __init__(self, tools: list[Tool], named: str | None, parser: str | None = None, parallel: bool = True):
        # parser: tool_choice "auto": the output is free, and calls are read from it with the
        # model's own syntax (server/tool_parsers.py); parallel: OpenAI's parallel_tool_calls,
        # false: at most one call ("required": a list of one; "auto": the first call the model made)
        self.tools, self.named, self.parser, self.parallel = tools, named, parser, parallel

    # between two JSON tokens of the arguments at most one space, as `json.dumps` writes them:
    # arguments are a string for a program to parse, and a small model given room for more
    # fills it with blank lines (a named tool's own "x-guidance" whitespace options win)
    WHITESPACE = {"whitespace_pattern": "[ ]?"}

    def schema(self) -> dict:
        """The JSON schema of the output. A 400 for a tool schema it cannot be built from."""
        if self.named is not None:
            p = _parameters(next(t for t in self.tools if t.function.name == self.named))
            own = p.get("x-guidance", {})
            if not isinstance(own, dict):
                raise bad_request("a tool's parameters' x-guidance must be an object", "tools")
            if "whitespace_pattern" in own or "whitespace_flexible" in own:
                return p
            return {**p, "x-guidance": {**self.WHITESPACE, **own}}
        # each tool's parameters sit inside the list's schema: their `$defs` move to its root,
        # where their "#/$defs/..." references point (pydantic-made tools use them)
        defs: dict = {}
        one_call = []
        for t in self.tools:
            p = dict(_parameters(t))
            for key in ("$defs", "definitions"):
                own = p.pop(key, None)
                if own is None:
                    continue
                if not isinstance(own, dict):
                    raise bad_request(f"a tool's parameters' {key} must be an object", "tools")
                for name, d in own.items():
                    if defs.setdefault(key, {}).setdefault(name, d) != d:
                        raise bad_request(
                            f"two tools define {key}/{name} differently; with tool_choice 'required' their "
                            "definitions share one schema",
                            "tools",
                        )
            p.pop("x-guidance", None)  # only the root's options count
            one_call.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "parameters": p},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        most = {} if self.parallel else {"maxItems": 1}
        return {
            "type": "array",
            "minItems": 1,
            **most,
            "items": {"anyOf": one_call},
            "x-guidance": self.WHITESPACE,
            **defs,
        }


def _parameters(t: Tool) -> dict:
    """A tool's parameters' schema; none or {} is an object with no properties (as vLLM reads
    them: many clients send {} for a function without arguments)."""
    return t.function.parameters or {"type": "object", "properties": {}, "additionalProperties": False}


def _template_calls(calls: list) -> list:
    """An assistant's earlier calls as chat templates expect them: `arguments` a mapping, not
    OpenAI's JSON text (templates render it with `tojson` or iterate over it)."""
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            try:
                args = json.loads(fn["arguments"])
            except (ValueError, RecursionError):
                args = None
            if isinstance(args, dict):
                c = {**c, "function": {**fn, "arguments": args}}
        out.append(c)
    return out


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    # the server's tool-call parser for tool_choice "auto" (None: auto is refused); set by the app
    _auto_tool_parser: str | None = PrivateAttr(default=None)
    _tools: list[Tool] | None = PrivateAttr(default=None)  # `tools`, validated once
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # OpenAI's: false allows one call at most
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning parser's thinking out

    def check(self) -> None:
        self.check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self.tool_calls(checking=True)  # the tools and tool_choice are checked there
        self.check_template()
        if self.echo:
            raise bad_request("echo is not supported on chat completions by this server", "echo")

    def engine_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def tool_calls(self, checking: bool = False) -> ToolCalls | None:
        """The tool calls the output is to be, or None (text: no tools, or tool_choice "none",
        where the tools still reach the chat template). `checking`: while the body is parsed,
        before the app has said whether it reads "auto" calls (checked again then)."""
        tools = self._validated_tools()
        choice = self.tool_choice
        if choice == "none" or (choice is None and not tools):
            return None
        if not tools:
            raise bad_request("tool_choice needs tools", "tool_choice")
        if choice is None or choice == "auto":
            # the model chooses between text and a call, in its own syntax: that takes a parser
            # for it, which the server is given with its flags
            if checking:
                return None
            if self._auto_tool_parser is None:
                raise bad_request(
                    "tool_choice 'auto' (the default when tools are given) needs the server started with "
                    "--enable-auto-tool-choice --tool-call-parser NAME; give 'required', a named function, or 'none'",
                    "tool_choice",
                )
            return ToolCalls(tools, None, self._auto_tool_parser, self.parallel_tool_calls is not False)
        if choice == "required":
            return ToolCalls(tools, None, parallel=self.parallel_tool_calls is not False)
        fn = choice.get("function") if isinstance(choice, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request(
                'tool_choice is \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if name not in {t.function.name for t in tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        return ToolCalls(tools, name)

    def _validated_tools(self) -> list[Tool]:
        """`tools` as Tool models (the template gets the dicts): checked once a request, though
        the tool choice is read at parsing, for the engine's parameters and for the reply."""
        if self._tools is None:
            if self.tools is not None and len(self.tools) > MAX_TOOLS:
                raise bad_request(f"{len(self.tools)} tools; at most {MAX_TOOLS} are allowed", "tools")
            tools = []
            for i, t in enumerate(self.tools or ()):
                try:
                    tools.append(Tool.model_validate(t))
                except ValidationError as e:
                    errors = [{**err, "loc": ("tools", i, *err.get("loc", ()))} for err in e.errors()]
                    raise from_validation_errors(errors) from None
            self._tools = tools
        return self._tools

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, defaults)
        calls = self.tool_calls()
        if calls is not None and calls.parser is not None:
            # a model's call tags may be special tokens: the parser must see them (as vLLM does)
            params = dataclasses.replace(params, skip_special_tokens=False)
        return params

    def structured(self) -> StructuredOutputsParams | None:
        calls = self.tool_calls()
        other = super().structured()
        if calls is None or calls.parser is not None:  # "auto": the output is the model's own
            return other
        if other is not None:
            raise bad_request("a tool call's arguments are already held to the tools' schemas", "tool_choice")
        try:
            return StructuredOutputsParams(json=calls.schema())
        except InvalidRequest as e:
            raise bad_request(f"tools: {e}", "tools") from None

    def conversation(self) -> list[dict]:
        out = []
        for m in self.messages:
            d = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:  # an empty list is none (as vLLM drops it)
                d["tool_calls"] = _template_calls(m.tool_calls)
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            thought = m.reasoning_content if m.reasoning_content is not None else m.reasoning
            if thought is not None:
                d["reasoning_content"] = thought
            out.append(d)
        return out


class TokenizeRequest(_ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("give exactly one of prompt and messages", "prompt")
        self.check_template()


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[^\s=@]+$")
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(_Strict):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id: accepted, unused: adapters go by name)."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


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
    if requested and requested not in served:  # none or "" is the served model, as in vLLM
        raise APIError(
            404,
            f"the model {requested!r} does not exist; this server serves {served}",
            param="model",
            code="model_not_found",
        )
