"""The OpenAI-compatible HTTP API of one collocated worker, as a FastAPI app.

Handlers validate and tokenize on the event loop, hand the engine a
`RequestGroup`, and answer from its stream; nothing here waits on the engine
except through asyncio. The engine is any `EngineClient` (engine_client.py):
the collocated AsyncEngine, or the router's DisaggEngine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic.json_schema import models_json_schema

from pdserve import tracing
from pdserve.control_api import TOKEN_IDS_HEADER, ResumeRequest
from pdserve.engine.sampling_params import thinking_closed
from pdserve.server import protocol as P
from pdserve.server.engine_client import EngineClient, EngineInput
from pdserve.server.errors import APIError, bad_request, install_handlers
from pdserve.server.format import ChatFormatter, CompletionFormatter, TokenText, cached_prompt_tokens, usage
from pdserve.server.metrics import CONTENT_TYPE
from pdserve.server.responses import ResponsesFormatter, ResponsesRequest
from pdserve.server.streaming import collect, read_body, sse_events
from pdserve.settings import FrontendConfig

log = logging.getLogger("pdserve.server")
_LONG_PROMPT_CHARS = 16_384  # tokenize longer prompts off the event loop


@dataclass
class ServerSettings:
    served_model_names: list[str] = field(default_factory=list)  # empty: the model's own name
    api_key: str | None = None
    # the flags' defaults (settings.py): one default each
    max_request_body_bytes: int = FrontendConfig.max_request_body_bytes
    # prompts x n: each is an engine sequence that waits, runs and is aborted on its own
    max_seqs_per_request: int = FrontendConfig.max_seqs_per_request
    metrics_require_key: bool = FrontendConfig.metrics_require_key  # /metrics behind api_key too
    tool_call_parser: str | None = None  # tool_choice "auto" reads calls with it (--enable-auto-tool-choice)
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    trust_request_chat_template: bool = False  # requests may bring their own chat template
    reasoning_parser: str | None = None  # --reasoning-parser: the thinking apart from the answer
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    # what a request's sampling fields default to: the model's generation config (vLLM's)
    sampling_defaults: dict = field(default_factory=dict)

    @classmethod
    def from_args(cls, args) -> ServerSettings:
        """From the parsed flags of the front-end section (settings.FrontendConfig)."""
        return cls(
            served_model_names=args.served_model_name or [],
            api_key=args.api_key,
            max_request_body_bytes=args.max_request_body_bytes,
            max_seqs_per_request=args.max_seqs_per_request,
            metrics_require_key=args.metrics_require_key,
            tool_call_parser=auto_tool_parser(args),
            prompt_tokens_details=getattr(args, "enable_prompt_tokens_details", False),
            trust_request_chat_template=getattr(args, "trust_request_chat_template", False),
            reasoning_parser=getattr(args, "reasoning_parser", None),
            allow_runtime_lora_updating=getattr(args, "allow_runtime_lora_updating", False),
            sampling_defaults=model_sampling_defaults(args),
        )


def model_sampling_defaults(args) -> dict:
    """The generation config's defaults for this server's requests (engine/generation_config.py),
    said once in the log, as vLLM says it."""
    from pdserve.engine.generation_config import sampling_defaults

    out = sampling_defaults(
        getattr(args, "model", None),
        getattr(args, "generation_config", "auto"),
        getattr(args, "override_generation_config", None),
    )
    if out:
        log.info("requests' default sampling parameters come from the model's generation config: %s", out)
    return out


def auto_tool_parser(args) -> str | None:
    """The parser `tool_choice: "auto"` uses, or None when auto is off (pdserve.cli refuses
    --enable-auto-tool-choice without --tool-call-parser)."""
    return getattr(args, "tool_call_parser", None) if getattr(args, "enable_auto_tool_choice", False) else None


def build_app(engine: EngineClient, settings: ServerSettings) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.shutdown()

    app = FastAPI(title="pdserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)
    install_handlers(app)
    api = _Api(engine, settings)
    app.state.api = api
    app.add_api_route(
        "/v1/completions", api.completions, methods=["POST"], openapi_extra=_json_body(P.CompletionRequest)
    )
    app.add_api_route(
        "/v1/chat/completions", api.chat, methods=["POST"], openapi_extra=_json_body(P.ChatCompletionRequest)
    )
    app.add_api_route("/v1/responses", api.responses, methods=["POST"], openapi_extra=_json_body(ResponsesRequest))
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", api.model, methods=["GET"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"], openapi_extra=_json_body(P.TokenizeRequest))
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"], openapi_extra=_json_body(P.DetokenizeRequest))
    app.add_api_route("/health", api.health, methods=["GET"])
    for method in ("GET", "POST"):  # vLLM's (SageMaker's) name for it
        app.add_api_route("/ping", api.health, methods=[method])
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/metrics", api.metrics, methods=["GET"])
    if settings.allow_runtime_lora_updating:  # as vLLM, the routes exist only when allowed
        app.add_api_route("/v1/load_lora_adapter", api.load_lora_adapter, methods=["POST"], include_in_schema=False)
        app.add_api_route("/v1/unload_lora_adapter", api.unload_lora_adapter, methods=["POST"], include_in_schema=False)
    return app


# Handlers read their bodies by hand (size limit first, then strict parsing), so
# FastAPI cannot see them: the schema names the pydantic models they parse into.
_BODY_MODELS = (
    P.CompletionRequest,
    P.ChatCompletionRequest,
    ResponsesRequest,
    P.TokenizeRequest,
    P.DetokenizeRequest,
)
_SCHEMA_REF = "#/components/schemas/{model}"


# a small request each route serves, shown in the OpenAPI document (clients' docs, fuzzers' first case)
_EXAMPLES = {
    "CompletionRequest": {"prompt": "Hello, my name is", "max_tokens": 8},
    "ChatCompletionRequest": {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 8},
    "ResponsesRequest": {"input": "Hello!", "max_output_tokens": 8},
    "TokenizeRequest": {"prompt": "Hello!"},
    "DetokenizeRequest": {"tokens": [1, 2, 3]},
}


def _json_body(model) -> dict:
    ref = _SCHEMA_REF.format(model=model.__name__)
    body = {"schema": {"$ref": ref}, "example": _EXAMPLES[model.__name__]}
    return {"requestBody": {"required": True, "content": {"application/json": body}}}


def _openapi(app: FastAPI) -> dict:
    """FastAPI's OpenAPI document plus the JSON schemas of the request bodies (for clients and fuzzers)."""
    if app.openapi_schema is None:
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS], ref_template=_SCHEMA_REF)
        doc.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
        app.openapi_schema = doc
    return app.openapi_schema


class _Api:
    def __init__(self, engine: EngineClient, settings: ServerSettings):
        self.engine = engine
        self.settings = settings
        self._token_text: TokenText | None = None
        self._think_ids: tuple[int, ...] | None = None  # <think>, </think> ids (_think_first)
        self._defaults: dict | None = None  # the generation config's, capped at the context (_sampling_defaults)
        self.created = int(time.time())  # the model cards' "created": when this server started

    # ---- helpers
    def _check_key(self, request: Request) -> None:
        key = self.settings.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key (send Authorization: Bearer <key>)", code="invalid_api_key")

    def _core(self):
        """The loaded engine, or 503 while it loads or after it failed."""
        e = self.engine
        if e.failure is not None:
            raise APIError(503, f"the engine is not available: {e.failure}")
        if e.engine is None:
            raise APIError(503, "the engine is still loading; retry shortly", headers={"Retry-After": "1"})
        return e.engine

    def served_names(self) -> list[str]:
        core = self._core()
        return self.settings.served_model_names or [core.model_config.name]

    def _model_names(self) -> list[str]:
        """What a request's model may be: the served names, then the LoRA adapters' names."""
        return self.served_names() + [n for n in self.engine.lora_adapters() if n not in self.served_names()]

    def _reply_model(self, req) -> str:
        """The model a reply names: the adapter the request asked for, else the first served name."""
        model = getattr(req, "model", None)
        return model if model and model not in self.served_names() else self.served_names()[0]

    def _name(self) -> str | None:
        core = self.engine.engine
        if self.settings.served_model_names:
            return self.settings.served_model_names[0]
        return core.model_config.name if core is not None else None

    async def _parse(self, request: Request, cls, resume: ResumeRequest | None = None):
        self._check_key(request)
        if resume is None:
            raw = await read_body(request, self.settings.max_request_body_bytes)
        else:
            raw = resume.body.encode()
            if len(raw) > self.settings.max_request_body_bytes:
                raise APIError(
                    413, f"the request body is over the limit of {self.settings.max_request_body_bytes} bytes"
                )
        req = P.parse_body(raw, cls)
        self._core()
        P.check_model(getattr(req, "model", None), self._model_names())
        return req

    async def _encode(self, text: str) -> list[int]:
        tok = self._core().tokenizer
        if len(text) > _LONG_PROMPT_CHARS:
            return await asyncio.to_thread(tok.encode, text)
        return tok.encode(text)

    def _chat_prompt(self, messages: list[dict], add_generation_prompt: bool, **kw) -> str:
        if kw.get("chat_template") is not None and not self.settings.trust_request_chat_template:
            raise bad_request(
                "a chat_template in the request needs a server started with --trust-request-chat-template "
                "(a template is code the server runs)",
                "chat_template",
            )
        try:
            return self._core().tokenizer.apply_chat_template(messages, add_generation_prompt, **kw)
        except Exception as e:  # the template itself refuses (raise_exception) or fails to render
            raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None

    def _sampling_defaults(self) -> dict:
        """The generation config's defaults, its max_new_tokens at most the context (a default
        past it must not make a 400 of a request that set no max_tokens)."""
        if self._defaults is None:  # once: the context is known once the model is
            d = self.settings.sampling_defaults
            if d.get("max_tokens") is not None and d["max_tokens"] > self._core().max_model_len:
                d = {**d, "max_tokens": self._core().max_model_len}
            self._defaults = d
        return self._defaults

    def _think_first(self, params, prompt: list[int]) -> bool:
        """Under --reasoning-parser, a structured output (a schema, a named or required tool call)
        holds only once the model has closed its thinking, as vLLM does: its params get the
        model's <think> and </think> token ids. True when it holds from its first token instead
        (no parser, a tokenizer without single-token tags, or a prompt that closed the thinking):
        the output is then thinking only where the grammar opens it (reasoning.py)."""
        if params.structured_outputs is None:
            return False
        if self._think_ids is None:
            ids = ()
            if self.settings.reasoning_parser is not None:
                tok = self._core().tokenizer
                pair = [tok.encode(t, add_special_tokens=False) for t in ("<think>", "</think>")]
                if all(len(x) == 1 for x in pair):
                    ids = (pair[0][0], pair[1][0])
            self._think_ids = ids
        if not self._think_ids:
            return True
        params.reasoning_token_ids = list(self._think_ids)
        return thinking_closed(prompt, *self._think_ids)

    def _text(self):
        if self._token_text is None:
            self._token_text = TokenText(self._core().tokenizer)
        return self._token_text

    def _check_request(self, req, prompts: list[str | list[int]]) -> None:
        """The checks that need the server's settings or the model: fan-out and vocabulary."""
        num_seqs, limit = len(prompts) * req.n, self.settings.max_seqs_per_request
        if num_seqs > limit:
            raise bad_request(
                f"this request asks for {num_seqs} sequences ({len(prompts)} prompts x n={req.n}); "
                f"the limit is max_seqs_per_request={limit}",
                "n" if req.n > 1 else "prompt",
                code="too_many_sequences",
            )
        vocab_size = self._core().model_config.vocab_size
        P.check_token_ids(req.stop_token_ids or [], vocab_size, "stop_token_ids")
        P.check_token_ids(req.allowed_token_ids or [], vocab_size, "allowed_token_ids")
        if req.logit_bias:
            try:
                biased = [int(k) for k in req.logit_bias]
            except ValueError:
                raise bad_request("logit_bias keys must be token ids", "logit_bias") from None
            P.check_token_ids(biased, vocab_size, "logit_bias")
        for p in prompts:
            if not isinstance(p, str):  # before echo decodes them: the tokenizer fails on unknown ids
                P.check_token_ids(p, vocab_size, "prompt")

    # ---- generation
    async def completions(self, request: Request):
        return await self._completions(request)

    async def chat(self, request: Request):
        return await self._chat(request)

    async def responses(self, request: Request):
        """OpenAI's Responses API for text (server/responses.py): the chat completion the
        request amounts to, returned as a response object or its stream of events."""
        r = await self._parse(request, ResponsesRequest)
        req = r.chat_request()
        req._auto_tool_parser = self.settings.tool_call_parser
        text = self._chat_prompt(req.conversation(), True, **req.template_kw())
        self._check_request(req, [text])
        prompt = req.truncate(await self._encode(text), self._core().max_model_len)
        params = req.sampling_params(req.max_tokens, None, self._sampling_defaults())
        rid = f"resp_{uuid.uuid4().hex}"
        fmt = ResponsesFormatter(
            rid,
            self._reply_model(r),
            self._text(),
            r,
            len(prompt),
            reasoning=self.settings.reasoning_parser,
            constrained=self._think_first(params, prompt),
            tool_calls=req.tool_calls(),
        )
        return await self._generate(request, req, rid, [prompt], params, fmt, None)

    async def resume(self, request: Request, b: ResumeRequest, path: str):
        """A stream the front resumes after its router died: the same request, the same id, only the
        choices not finished, each from its prompt and the tokens it streamed (control_api)."""
        return await (self._chat if path == "chat/completions" else self._completions)(request, b)

    async def _completions(self, request: Request, resume: ResumeRequest | None = None):
        req: P.CompletionRequest = await self._parse(request, P.CompletionRequest, resume)
        self._check_request(req, req.prompts())
        ctx = self._core().max_model_len
        texts = req.prompts()
        prompts = [req.truncate(await self._encode(p) if isinstance(p, str) else p, ctx) for p in texts]
        # echo with max_tokens 0: the prompt (and its logprobs) back, nothing generated, as
        # OpenAI's legacy API and vLLM do for scoring a text; the engine still samples one
        # token (its step computes the prompt), which the reply leaves out
        echo_only = req.echo and req.max_tokens == 0
        params = req.sampling_params(1 if echo_only else req.max_tokens, req.logprobs, self._sampling_defaults())
        # under --reasoning-parser a grammar waits for the end of the thinking here too (vLLM's
        # reasoner runs on every request); the engine looks for it in each prompt and output
        self._think_first(params, prompts[0])
        echo = None
        if req.echo:
            echo = [
                p if isinstance(p, str) and req.truncate_prompt_tokens is None else self._core().tokenizer.decode(ids)
                for p, ids in zip(texts, prompts)
            ]
            if req.logprobs is not None:  # the prompt's tokens are listed with their logprobs
                params = dataclasses.replace(params, prompt_logprobs=max(req.logprobs, req.prompt_logprobs or 0))
        rid = resume.request_id if resume else f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormatter(
            rid,
            self._reply_model(req),
            self._text(),
            len(prompts) * req.n,
            req.logprobs,
            echo_texts=echo,
            echo_ids=prompts if echo else None,
            n=req.n,
            prompt_ids=prompts if req.return_token_ids else None,
            tokens_as_ids=req.return_tokens_as_token_ids,
            prompt_logprobs=req.prompt_logprobs,
        )
        return await self._generate(request, req, rid, prompts, params, fmt, resume, echo_only=echo_only)

    async def _chat(self, request: Request, resume: ResumeRequest | None = None):
        req: P.ChatCompletionRequest = await self._parse(request, P.ChatCompletionRequest, resume)
        req._auto_tool_parser = self.settings.tool_call_parser
        text = self._chat_prompt(req.conversation(), req.add_generation_prompt, **req.template_kw())
        self._check_request(req, [text])
        prompt = req.truncate(await self._encode(text), self._core().max_model_len)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_params(max_tokens, req.engine_logprobs(), self._sampling_defaults())
        rid = resume.request_id if resume else f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormatter(
            rid,
            self._reply_model(req),
            self._text(),
            req.n,
            req.engine_logprobs(),
            tool_calls=req.tool_calls(),
            reasoning=self.settings.reasoning_parser,
            constrained=self._think_first(params, prompt),
            include_reasoning=req.include_reasoning,
            prompt_ids=[prompt] if req.return_token_ids else None,
            tokens_as_ids=req.return_tokens_as_token_ids,
            prompt_logprobs=req.prompt_logprobs,
        )
        return await self._generate(request, req, rid, [prompt], params, fmt, resume)

    async def _generate(
        self,
        request: Request,
        req,
        rid: str,
        prompts: list[list[int]],
        params,
        fmt,
        resume: ResumeRequest | None = None,
        echo_only: bool = False,
    ):
        model = getattr(req, "model", None)
        if model and model not in self.served_names():  # a LoRA adapter's name (checked by _parse)
            key = self.engine.lora_adapters().get(model)
            if key is None:  # its workers left since
                raise APIError(404, f"the model {model!r} is no longer served", param="model", code="model_not_found")
            params = dataclasses.replace(params, lora_adapter=key)
        inputs = []
        for ids in prompts:
            if not ids:
                raise bad_request("the prompt is empty", "prompt")
            for j in range(req.n):
                # choice j of a seeded request gets seed + j, as the offline LLM.generate does
                seed = None if params.seed is None else params.seed + j
                inputs.append(EngineInput(ids, _with_seed(params, seed)))
        indices, streamed, engine_rid = None, 0, rid
        if resume is not None:
            inputs, indices, streamed = _resumed(inputs, resume, req.stream, fmt)
            # the client keeps the stream's id; the workers get new ones (what the dead router
            # started under the old ids may still be there until its workers notice)
            engine_rid = f"{rid}-f{uuid.uuid4().hex[:8]}"
        t0 = time.monotonic()
        num_prompt_tokens = sum(len(p) for p in prompts)
        client_id = request.headers.get("x-request-id")
        span = tracing.NO_SPAN
        if tracing.enabled():
            span = self._trace_start(request, req, rid, model, params, num_prompt_tokens, client_id, resume, t0)
        try:
            await self.engine.compile_constraints([i.params for i in inputs])
            group = None
            if inputs:
                trace = span if span.traced else None
                group = self.engine.submit(inputs, priority=req.priority, request_id=engine_rid, trace=trace)
            try:
                if group is not None:
                    await group.accepted()
            except BaseException:
                group.abort()
                raise
        except BaseException as e:  # refused (429, 503, a 400 from the engine) or gone
            span.set({"http.response.status_code": getattr(e, "status", None), "pdserve.outcome": "refused"})
            span.fail(str(e) or type(e).__name__)
            span.end()
            raise
        if echo_only and group is not None:
            group = _NothingGenerated(group)
        if span.recording and group is not None:
            group = _FirstOutputTimer(group, span, t0)

        def done(outcome: str, completion_tokens: int) -> None:
            span.set(
                {
                    "pdserve.outcome": outcome,
                    "gen_ai.usage.completion_tokens": completion_tokens,
                    "gen_ai.latency.e2e": time.monotonic() - t0,
                }
            )
            if outcome.startswith("error"):
                span.fail(outcome)
            span.end()
            log.info(
                "request finished",
                extra={
                    "fields": {
                        "request_id": rid,
                        "client_request_id": client_id,
                        "outcome": outcome,
                        "stream": req.stream,
                        "choices": len(inputs),
                        "prompt_tokens": num_prompt_tokens,
                        "completion_tokens": completion_tokens,
                        "elapsed_ms": round((time.monotonic() - t0) * 1e3, 1),
                    }
                },
            )

        headers = {"X-Request-Id": rid}
        if req.stream:
            body = sse_events(
                group,
                fmt,
                req.include_usage,
                num_prompt_tokens,
                on_done=done,
                tag_tokens=request.headers.get(TOKEN_IDS_HEADER) == "1",
                indices=indices,
                completion_tokens=streamed,
                preamble=resume is None,
                choice_prompt_tokens=[len(p) for p in prompts for _ in range(req.n)] if req.continuous_usage else None,
                choice_tokens_before={c.index: len(c.token_ids) for c in resume.choices} if resume else None,
                cached_per_prompt_of=req.n if self.settings.prompt_tokens_details else None,
            )
            return StreamingResponse(
                body, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
            )
        try:
            finals = await collect(group, request.receive)
        except APIError as e:
            done(f"error {e.status}", 0)
            raise
        except BaseException:  # cancelled (a forced shutdown), or a bug: logged, its span ended
            done("cancelled", 0)
            raise
        completion_tokens = sum(len(f.final.token_ids) for f in finals)
        done("ok", completion_tokens)
        cached = None
        if self.settings.prompt_tokens_details:
            cached = cached_prompt_tokens({i: f.final.num_cached_tokens for i, f in enumerate(finals)}, req.n)
        return JSONResponse(fmt.full(finals, usage(num_prompt_tokens, completion_tokens, cached)), headers=headers)

    def _trace_start(self, request, req, rid, model, params, num_prompt_tokens, client_id, resume, t0):
        """The API request's span (tracing.py), under the caller's traceparent if it sent one."""
        return tracing.start(
            "llm_request",
            tracing.extract(request.headers),
            kind="server",
            attributes={
                "gen_ai.request.id": rid,
                "gen_ai.response.model": model or self.served_names()[0],
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.n": req.n,
                "gen_ai.usage.prompt_tokens": num_prompt_tokens,
                "pdserve.stream": bool(req.stream),
                "pdserve.priority": req.priority,
                "pdserve.client_request_id": client_id[:128] if client_id else None,
                "pdserve.resumed": resume is not None,
            },
            start_s=t0,
        )

    # ---- everything else
    async def models(self, request: Request):
        self._check_key(request)
        core = self._core()
        cards = [self._model_card(n, core) for n in self.served_names()]
        cards += [self._adapter_card(n, core) for n in self._model_names()[len(cards) :]]
        return {"object": "list", "data": cards}

    async def model(self, request: Request, model_id: str):
        self._check_key(request)
        core = self._core()
        P.check_model(model_id, self._model_names())
        if model_id not in self.served_names():
            return self._adapter_card(model_id, core)
        return self._model_card(model_id, core)

    def _model_card(self, name: str, core) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "pdserve",
            "root": core.model_config.name,
            "max_model_len": core.max_model_len,
        }

    def _adapter_card(self, name: str, core) -> dict:
        """A LoRA adapter's card, as vLLM lists one: its parent is the base model."""
        return {**self._model_card(name, core), "root": name, "parent": self.served_names()[0]}

    async def load_lora_adapter(self, request: Request):
        """vLLM's: load the adapter in `lora_path` as `lora_name` (every worker reads the path)."""
        self._check_key(request)
        req = P.parse_body(await read_body(request, self.settings.max_request_body_bytes), P.LoadLoRAAdapterRequest)
        self._core()
        if req.lora_name in self.served_names():
            raise bad_request(f"{req.lora_name!r} is the base model's name", "lora_name")
        key = await self.engine.load_lora_adapter(req.lora_name, req.lora_path, req.load_inplace)
        log.info("LoRA adapter %s loaded from %s (key %s)", req.lora_name, req.lora_path, key)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: Request):
        """vLLM's: requests may no longer name `lora_name`; those running with it finish."""
        self._check_key(request)
        req = P.parse_body(await read_body(request, self.settings.max_request_body_bytes), P.UnloadLoRAAdapterRequest)
        self._core()
        await self.engine.unload_lora_adapter(req.lora_name)
        log.info("LoRA adapter %s unloaded", req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def tokenize(self, request: Request):
        req: P.TokenizeRequest = await self._parse(request, P.TokenizeRequest)
        core = self._core()
        if req.messages is not None:
            text = self._chat_prompt(
                [m.model_dump(exclude_none=True) | {"content": m.text()} for m in req.messages],
                req.add_generation_prompt,
                **req.template_kw(),
            )
        else:
            text = req.prompt
        ids = core.tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
        out = {"count": len(ids), "max_model_len": core.max_model_len, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [core.tokenizer.id_to_token(t) for t in ids]
        return out

    async def detokenize(self, request: Request):
        req: P.DetokenizeRequest = await self._parse(request, P.DetokenizeRequest)
        core = self._core()
        P.check_token_ids(req.tokens, core.model_config.vocab_size, "tokens")
        return {"prompt": core.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    async def version(self, request: Request):
        from pdserve import __version__

        return {"version": __version__}

    async def health(self, request: Request):
        """200 when the engine takes requests, 503 otherwise; KV block counts for operators and tests."""
        e = self.engine
        body = {"status": "ok", "model": None, "num_waiting_requests": e.num_waiting}
        if e.stats is not None:
            s = e.stats
            body.update(
                model=self._name(),
                num_running=s["num_running"],
                num_waiting=s["num_waiting"],
                num_free_blocks=s["num_free_blocks"],
                num_blocks=s["num_blocks"],
                kv_usage=s["kv_usage"],
            )
        loading = e.loading
        if e.failure is not None or e.engine is None or e.draining or loading:
            body["status"] = "failed" if e.failure else ("draining" if e.draining else "loading")
            body["reason"] = e.failure or loading
            return JSONResponse(body, status_code=503)
        return body

    async def metrics(self, request: Request):
        if self.settings.metrics_require_key:
            self._check_key(request)
        m = self.engine.metrics
        return Response(m.render() if m is not None else b"", media_type=CONTENT_TYPE)


class _FirstOutputTimer:
    """A request stream that marks its first output in the request's span (its time to first
    token as the API sees it: queue, prefill, and for a router the way to and from workers)."""

    def __init__(self, group, span: tracing.Span, t0: float):
        self.group, self.span, self.t0 = group, span, t0
        self.subs = group.subs
        self.first = True

    async def accepted(self) -> None:
        await self.group.accepted()

    async def next_batch(self):
        batch = await self.group.next_batch()
        if self.first and batch and any(out.new_token_ids for _, out in batch):
            self.first = False
            now = time.monotonic()
            self.span.set({"gen_ai.latency.time_to_first_token": now - self.t0})
            self.span.event("first_token", at_s=now)
        return batch

    def abort(self) -> None:
        self.group.abort()


class _NothingGenerated:
    """A request stream whose generated tokens are dropped (echo with max_tokens 0): each
    choice ends with its prompt logprobs and no token, finish reason "length"."""

    def __init__(self, group):
        self.group = group
        self.subs = group.subs

    async def accepted(self) -> None:
        await self.group.accepted()

    async def next_batch(self):
        batch = await self.group.next_batch()
        if batch is None:
            return None
        out = []
        for index, c in batch:
            final = None
            if c.final is not None:  # the prompt's logprobs and counts stay; the output goes
                f = c.final
                empty = [] if f.logprobs is not None else None
                final = dataclasses.replace(
                    f, text="", token_ids=[], logprobs=empty, finish_reason="length", stop_reason=None
                )
            empty_lps = [] if c.new_logprobs is not None else None
            out.append(
                (index, dataclasses.replace(c, new_token_ids=[], new_text="", new_logprobs=empty_lps, final=final))
            )
        return out

    def abort(self) -> None:
        self.group.abort()


def _resumed(inputs: list[EngineInput], resume: ResumeRequest, stream: bool, fmt):
    """(what still runs, its client choice indices, tokens streamed before) of a resumed stream."""
    if not stream:
        raise bad_request("only a streamed request can be resumed", "stream")
    before = {c.index: c for c in resume.choices}
    if any(i >= len(inputs) for i in before):
        raise bad_request(f"the request has {len(inputs)} choices; the resume names more", "choices")
    fmt.created = resume.created
    kept, indices, streamed = [], [], 0
    for i, inp in enumerate(inputs):
        c = before.get(i)
        if c is not None:
            streamed += len(c.token_ids)
            fmt.resume(i, c.token_ids)
            if c.finished:
                continue
            if c.token_ids:
                inp = EngineInput(inp.prompt_token_ids, inp.params, resume_token_ids=list(c.token_ids))
        kept.append(inp)
        indices.append(i)
    return kept, indices, streamed


def _with_seed(params, seed):
    return params if seed == params.seed else replace(params, seed=seed)
