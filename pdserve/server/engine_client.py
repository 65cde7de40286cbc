"""What the OpenAI front end (app.py, serving.py, streaming.py) needs of its engine, and the
types that cross between them: an `EngineInput` per engine request going in, a `ChoiceOutput`
per engine request and batch coming out.

Two engines implement it: the collocated `AsyncEngine` (async_engine.py: one
LLMEngine in a thread of its own) and the router's `DisaggEngine`
(pdserve/router/disagg.py: each request a prefill on one worker and a decode on
another). Both are checked against it, names and signatures, in
tests/server/test_engine_client.py: add a member here only if the front end
uses it, and to both engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.server.errors import APIError
    from pdserve.server.metrics import ServerMetrics


@dataclass
class EngineInput:
    """One engine request of an API call (one prompt x one choice)."""

    prompt_token_ids: list[int]
    params: SamplingParams
    kv_destination: object | None = None  # prefill role: where this request's KV goes
    resume_token_ids: list[int] | None = None  # output a lost worker already produced


@dataclass(slots=True)
class Completion:
    """The whole completion of one engine request, once it has finished."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token, when asked for
    finish_reason: str | None
    stop_reason: int | str | None = None
    # per prompt token, the first None, when asked for (SamplingParams.prompt_logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # prompt tokens found cached (prefix cache, KV tiers) by the worker that computed the prompt
    num_cached_tokens: int | None = None
    # with prompt_logprobs: each prompt token's rank in the vocabulary (the first None)
    prompt_logprob_ranks: list[int | None] | None = None


@dataclass(slots=True)
class ChoiceOutput:
    """What one engine request produced since its previous ChoiceOutput: the unit both engines
    stream to the front end. `new_text` is held back while a stop string may be completing;
    `new_logprobs` are those of `new_token_ids` ({sampled: lp, **top k} each), None unless
    asked for. The last one of a request carries its whole `final` completion."""

    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict[int, float]] | None = None
    final: Completion | None = None
    # on a request's first output: seconds from its first scheduling to its first token (the
    # engine's clock; a router adds it to its own view of the request's queue and prefill)
    prefill_s: float | None = None
    # the prompt's logprobs (SamplingParams.prompt_logprobs), on the output that first has them
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # on a request's first output: prompt tokens found cached rather than computed
    num_cached_tokens: int | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # with prompt_logprobs, as in Completion

    @property
    def finished(self) -> bool:
        return self.final is not None


class RequestStream(Protocol):
    """The engine requests of one API call (one per prompt x choice), accepted or refused together."""

    # one entry per engine request, in choice order; the front end only counts them
    subs: list

    async def accepted(self) -> None:
        """Wait until the engine took every request; raise its APIError if it did not."""

    async def next_batch(self) -> list[tuple[int, ChoiceOutput]] | None:
        """Every (choice index, ChoiceOutput) available now, at least one; None once all finished.
        Raises the APIError that ended the requests, if one did."""

    def abort(self) -> None:
        """Stop whatever is still running (the client left, an error); safe to call again."""


class EngineClient(Protocol):
    # set by serving.DrainingServer when a drain begins: new requests get 503 from then on
    draining: bool

    @property
    def engine(self):
        """The loaded engine core (tokenizer, model_config, max_model_len), None while it loads."""

    @property
    def metrics(self) -> ServerMetrics | None:
        """What /metrics renders (None until the engine is loaded)."""

    @property
    def stats(self) -> dict | None:
        """The latest engine stats (running, waiting, KV blocks) for /health."""

    @property
    def failure(self) -> str | None:
        """Why requests cannot be served now (503 with it), or None."""

    @property
    def loading(self) -> str | None:
        """What it is still waiting for before it can serve, nothing having failed (the model
        loading, workers registering): /health says "loading" with it; None once ready."""

    @property
    def num_waiting(self) -> int:
        """Requests accepted that have produced no token yet."""

    @property
    def num_in_flight(self) -> int:
        """Engine requests not yet finished (a drain waits for these)."""

    def start(self) -> None:
        """Start serving (in the app's lifespan, on its event loop)."""

    async def shutdown(self, reason: str = ...) -> None:
        """Fail what is in flight with a 503 giving `reason`, and stop."""

    async def compile_constraints(self, params: list[SamplingParams]) -> None:
        """Prepare the requests' output constraints (structured outputs) before `submit`, off
        the thread that steps the engine; raises APIError 400 for one that does not compile."""

    def lora_adapters(self) -> dict[str, str]:
        """Name -> key (SamplingParams.lora_adapter) of the LoRA adapters a request may name as
        its model; empty while none can be served."""

    async def load_lora_adapter(self, name: str, path: str, replace: bool = False) -> str:
        """Load the adapter in `path` as `name` (every worker, or none); its key. APIError 400
        for a bad adapter or a name already loaded (unless `replace`)."""

    async def unload_lora_adapter(self, name: str) -> None:
        """New requests may no longer name it; APIError 404 if no adapter has that name."""

    def submit(
        self, inputs: list[EngineInput], priority: int = 0, request_id: str | None = None, trace=None
    ) -> RequestStream:
        """Hand over the requests of one API call; raises APIError (503, 429, 400) if refused now.
        `trace`: the API request's span (pdserve.tracing), the parent of what the choices record."""

    def fail_all(self, err: APIError) -> None:
        """End every request in flight with `err` (a drain past its deadline)."""
