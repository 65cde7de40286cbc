"""The messages of the internal control API, shared by the router and the workers.

Every JSON body that crosses `/internal/*` between pdserve processes is one of the
pydantic models below. The routes take them (a malformed body is a 400 naming the
field, in OpenAI's error shape, never a 500) and the callers build them and read
the answers through them, so both ends agree by construction.

    worker routes (pdserve/worker/app.py)           body               answer
      POST /internal/prefill                        PrefillRequest     NDJSON: FirstTokenEvent, SavedEvent
      POST /internal/reserve                        ReserveRequest     ReserveResponse
      POST /internal/pull                           PullRequest        PullResponse
      POST /internal/kv_failed                      KVFailedRequest    KVFailedResponse
      POST /internal/decode                         DecodeRequest      NDJSON: KVReadyEvent, OutputEvent, ErrorEvent
      POST /internal/generate                       GenerateRequest    NDJSON: OutputEvent, ErrorEvent
      POST /internal/abort                          AbortRequest       AbortResponse
      POST /internal/drain                          (none)             DrainResponse
      POST /internal/fault                          FaultRequest       FaultResponse
      GET  /internal/state                                             StateResponse
    router routes (pdserve/router/app.py)
      POST /internal/register                       RegisterRequest    RegisterResponse
      POST /internal/heartbeat                      HeartbeatRequest   HeartbeatResponse
      POST /internal/admin/pools/poll               PoolPollRequest    PoolPollResponse
      POST /internal/admin/scale                    ScaleRequest       ScaleResponse
      POST /internal/resume/{completions,chat/completions}
                                                    ResumeRequest      SSE, as the /v1 route

Field names are the wire format: a router and workers of different versions must
understand each other, so fields are added with defaults, never renamed, and
unknown fields are ignored. Callers send only the fields they set
(`model_dump(exclude_unset=True)`), so a default lives in one place: the receiver.

This module imports nothing of pdserve but the engine's SamplingParams, so that the
router, the workers and their supervisors import it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.engine.sampling_params import SamplingParams

# What a caller may ask of a worker's leases and waits. The worker caps a lease at its
# `--max-kv-lease-s`; these are the defaults and the cap that does not depend on it.
DEFAULT_LEASE_S = 30.0  # a reservation's lease, and a decode's wait for its KV
RESERVE_WAIT_S = 10.0  # how long a reservation waits for KV room before 503 kv_full
MAX_RESERVE_WAIT_S = 60.0
MAX_REGISTRATION_CHARS = 512  # each string a worker registers with
MAX_PULL_ADDRESS_CHARS = 256
MAX_POOL_COUNT = 1024  # workers of one role a supervisor may say it runs
MAX_RESUMED_CHOICES = 4096  # the router also holds a resume to its --max-seqs-per-request
MAX_RESUMED_TOKENS = 1 << 20  # per choice; the engine holds it to the context length
# A KV destination: the engine holds it to the prompt and the sender to the cache files;
# these bound what the JSON alone may make a worker build.
MAX_KV_BLOCKS = 1 << 20  # block ids of one destination (a million-token prompt at block size 1)
MAX_KV_BLOCK_SIZE = 1 << 12
MAX_KV_FILES = 2 * 1024  # K and V of up to 1,024 layers
MAX_KV_PATH_CHARS = 4096  # PATH_MAX

Role = Literal["prefill", "decode", "both"]  # pdserve.router.registry.ROLES


class _Message(BaseModel):
    # Strict types (no "5" for 5, no true for 1) and finite numbers, as the OpenAI
    # bodies (pdserve/server/protocol.py); unknown fields are ignored so that a newer
    # peer's additions do not break an older one.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)

    def wire(self) -> dict:
        """The JSON body to send: the fields the caller set, as today's callers send them."""
        return self.model_dump(exclude_unset=True)


Seconds = Annotated[float, Field(ge=0)]  # a lease or a wait; the receiver caps it
RegisteredText = Annotated[str, Field(max_length=MAX_REGISTRATION_CHARS)]


def logprobs_to_wire(entries) -> list | None:
    """Per-token logprob dicts for JSON ({token id: logprob} keyed by the id as a string); a None
    entry (the first prompt token's) stays None; no entries at all is None."""
    if not entries:
        return None
    return [None if e is None else {str(k): v for k, v in e.items()} for e in entries]


def logprobs_from_wire(entries) -> list:
    """The inverse of `logprobs_to_wire` (token ids back to ints); None is no entries."""
    return [None if e is None else {int(k): v for k, v in e.items()} for e in entries or ()]


def params_to_json(p: SamplingParams) -> dict:
    return dataclasses.asdict(p)


def params_from_json(d: dict) -> SamplingParams:
    """SamplingParams from their JSON; fields this version does not know are dropped (a
    newer router's). Raises InvalidRequest (a ValueError) or TypeError for bad values."""
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in d.items() if k in fields})


# ---- worker routes: requests


class KVDestinationBody(_Message):
    """pdserve.transfer.connector.KVDestination on the wire (the same fields; a test keeps
    them equal). Mirrored rather than imported: that module needs torch."""

    transfer_id: str = Field(max_length=MAX_REGISTRATION_CHARS)
    address: str = Field(max_length=MAX_PULL_ADDRESS_CHARS)
    block_ids: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_KV_BLOCKS)
    block_size: int = Field(ge=1, le=MAX_KV_BLOCK_SIZE)
    start_token: int = Field(0, ge=0)
    num_tokens: int = Field(0, ge=0)
    pull: bool = False
    shm_paths: list[Annotated[str, Field(max_length=MAX_KV_PATH_CHARS)]] = Field([], max_length=MAX_KV_FILES)
    shm_shape: list[Annotated[int, Field(ge=1)]] = Field([], max_length=4)
    shm_dtype: str = Field("", max_length=16)
    expires_unix: float = Field(0.0, ge=0)
    lease_s: float = Field(0.0, ge=0)


class _ForRequest(_Message):
    request_id: str


class PrefillRequest(_ForRequest):
    prompt_token_ids: list[int]
    # SamplingParams' fields, checked by SamplingParams itself (params_from_json)
    params: dict[str, Any] = {}
    kv_destination: KVDestinationBody | None = None  # None: nobody waits for the KV


class ReserveRequest(_ForRequest):
    prompt_token_ids: list[int]
    params: dict[str, Any] = {}
    deadline_s: Seconds = DEFAULT_LEASE_S  # the lease, capped by the worker's --max-kv-lease-s
    # no room now: wait in line this long, then 503 (capped at MAX_RESERVE_WAIT_S)
    wait_s: Seconds = RESERVE_WAIT_S


class PullRequest(_ForRequest):
    # a prefill worker's KV export address; the connection itself is authenticated both ways
    address: str = Field(max_length=MAX_PULL_ADDRESS_CHARS, pattern=r"^tcp://")


class KVFailedRequest(_ForRequest):
    reason: str = "the prefill worker's transfer broke"


class DecodeRequest(_ForRequest):
    first_token: int | None = None  # None: the prefill failed, recompute the prompt
    kv_expected: bool = True
    timeout_s: Seconds = DEFAULT_LEASE_S  # the wait for the KV, capped by --max-kv-lease-s


class GenerateRequest(_ForRequest):
    prompt_token_ids: list[int]
    params: dict[str, Any] = {}
    resume_token_ids: list[int] | None = None  # output a lost worker already streamed


class AbortRequest(_ForRequest):
    pass


class FaultRequest(_Message):
    kv: str | None = None  # a KV sender fault, e.g. "cut_at_layer=3"
    worker: str | None = None  # a worker API fault, e.g. "delay_prefill=0:2"


# ---- worker routes: answers


class ReserveResponse(_Message):
    kv_destination: KVDestinationBody


class PullResponse(_Message):
    pulling: str


class KVFailedResponse(_Message):
    failed: str


class AbortResponse(_Message):
    aborted: str


class LoadLoRARequest(_Message):
    """Load a LoRA adapter at run time (vLLM's /v1/load_lora_adapter body): the router asks
    every worker; `lora_path` is a directory on the worker's host."""

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # replace an adapter of that name (else: 400 if there is one)


class LoadLoRAResponse(_Message):
    key: str  # the adapter's key (engine/lora.py): its feature is "lora:<key>"
    # every adapter the worker holds now (loading one may have unloaded another to make room)
    keys: list[Annotated[str, Field(max_length=MAX_REGISTRATION_CHARS)]] = Field(default_factory=list, max_length=64)


class LoRASource(_Message):
    """One adapter a worker serves, and where it read it from."""

    name: str = Field(max_length=128)
    key: str = Field(max_length=MAX_REGISTRATION_CHARS)
    path: str = Field(max_length=4096)
    pinned: bool  # given at start (--lora-modules), not loaded at run time


class LoRAListResponse(_Message):
    """GET /internal/lora/list: the adapters a worker serves (a router copies the ones loaded
    at run time to a worker that joins later, or comes back from a restart)."""

    adapters: list[LoRASource] = Field(default_factory=list, max_length=64)


class UnloadLoRARequest(_Message):
    lora_name: str = Field(min_length=1, max_length=128)


class UnloadLoRAResponse(_Message):
    unloaded: str


class DrainResponse(_Message):
    draining: bool = True


class FaultResponse(_Message):
    armed: dict[str, str]


class StateResponse(_Message):
    role: str
    ready: bool
    failure: str | None
    stats: dict[str, Any]  # the engine's stats, as LLMEngine.stats() names them
    time: float


# ---- worker streams: one JSON object per line


class _Event(_Message):
    event: str


class _Output(_Event):
    """One engine output's new part (pdserve.worker.app.output_event)."""

    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # per new token, {token id as a string: logprob}; a logprob may be -inf
    logprobs: list[dict[str, Annotated[float, Field(allow_inf_nan=True)]]] | None = None
    # with a request's first token: seconds from its first scheduling on this worker to that
    # token, so that the router can split the TTFT it sees into waiting and prefill
    prefill_s: Annotated[float, Field(ge=0.0)] | None = None
    # the prompt's logprobs (params.prompt_logprobs), once, as for `logprobs`; the first is None
    prompt_logprobs: list[dict[str, Annotated[float, Field(allow_inf_nan=True)]] | None] | None = None
    # with a request's first token: prompt tokens this worker found cached rather than computed
    num_cached_tokens: Annotated[int, Field(ge=0)] | None = None
    # with prompt_logprobs: each prompt token's rank in the vocabulary, the first None
    prompt_logprob_ranks: list[Annotated[int, Field(ge=1)] | None] | None = None


class FirstTokenEvent(_Output):
    event: Literal["first_token"] = "first_token"


class OutputEvent(_Output):
    event: Literal["output"] = "output"


class SavedEvent(_Event):
    """The prefill worker's KV save report. `exposed_s`: from the end of the prefill to the
    decode side's acknowledgement; `exposed_bytes`: what travelled in it."""

    event: Literal["saved"] = "saved"
    ok: bool
    bytes: int = 0
    retries: int = 0
    seconds: float = 0.0
    exposed_s: float | None = None
    exposed_bytes: float = 0.0
    error: str | None = None


class KVReadyEvent(_Event):
    """First line of a decode: whether the KV arrived (False: the prompt is recomputed)."""

    event: Literal["kv"] = "kv"
    ok: bool


class ErrorEvent(_Event):
    """The request failed after the stream began (the status and message of its APIError)."""

    event: Literal["error"] = "error"
    status: int = 500
    message: str = "worker error"


WorkerEvent = FirstTokenEvent | OutputEvent | SavedEvent | KVReadyEvent | ErrorEvent
_EVENTS: dict[str, type[_Event]] = {
    cls.model_fields["event"].default: cls
    for cls in (FirstTokenEvent, OutputEvent, SavedEvent, KVReadyEvent, ErrorEvent)
}


def event_line(ev: _Event) -> bytes:
    # json.dumps rather than model_dump_json: a -inf logprob travels as -Infinity, as it always has
    return (json.dumps(ev.model_dump(), separators=(",", ":")) + "\n").encode()


def parse_event(line: str | bytes) -> WorkerEvent | None:
    """One line of a worker's stream; None for an event this version does not know (a
    newer worker's: skipped, as it always was). ValueError if the line is malformed."""
    raw = json.loads(line)
    if not isinstance(raw, dict):
        raise ValueError("a worker's stream line must be a JSON object")
    cls = _EVENTS.get(raw.get("event"))
    return cls.model_validate(raw) if cls is not None else None


# ---- router routes (workers and supervisors call them)


# What a worker of this version does with a request that an older worker would silently drop
# (params_from_json ignores fields it does not know): the router places a request that uses one
# only on workers that say they have it, so a rolling upgrade never runs a salted request
# unsalted (into another tenant's cache) or ignores its bad words, nor holds a reasoning model's
# structured output to its grammar from the first token while the router reads it as thinking.
WORKER_FEATURES = ("cache_salt", "bad_words", "reasoning_token_ids")
# ... and the LoRA adapters it holds, each a feature "lora:<key>" (engine/lora.py): a request
# that names an adapter goes only to workers with that adapter's very weights
LORA_FEATURE_PREFIX = "lora:"
# a worker started with --enable-lora: the router gives it the adapters loaded at run time
LORA_ENABLED_FEATURE = "lora"


def features_needed(params: dict | object) -> frozenset[str]:
    """The WORKER_FEATURES a request's SamplingParams use, and its adapter's feature."""
    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k, None)
    need = {f for f in WORKER_FEATURES if get(f)}
    if get("lora_adapter"):
        need.add(LORA_FEATURE_PREFIX + get("lora_adapter"))
    return frozenset(need)


def adapter_features(keys) -> list[str]:
    """The features that say a worker holds these adapters (by key)."""
    return [LORA_FEATURE_PREFIX + k for k in sorted(keys)]


def adapters_of(features) -> list[str]:
    """The adapter keys among a worker's features."""
    return [f[len(LORA_FEATURE_PREFIX) :] for f in features if f.startswith(LORA_FEATURE_PREFIX)]


class RegisterRequest(_Message):
    worker_id: RegisteredText
    url: RegisteredText  # the worker's control API: http(s)://host:port
    role: Role
    kv_address: RegisteredText = ""  # where its KV receiver listens (decode / both)
    kv_export_address: RegisteredText = ""  # where it serves KV pulls (prefill / both)
    host: RegisteredText = ""
    restarts: int = Field(0, ge=0, lt=1 << 31)  # how often its supervisor restarted it
    features: list[RegisteredText] = Field(default_factory=list, max_length=64)  # of WORKER_FEATURES

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("url must be http(s)://host:port")
        return url


class RegisterResponse(_Message):
    registered: str
    # this router process's own id, new at each start: a worker that registers with another one
    # knows the router that reserved its blocks is gone (as a heartbeat's 404 tells it)
    router_id: str = Field("", max_length=64)


class KVEventBody(_Message):
    """One block-manager event, numbered within the worker's epoch (pdserve/worker/kv_publisher.py)."""

    seq: int
    kind: str
    block_hashes: list[int] = []


class KVSnapshotBody(_Message):
    seq: int  # the number of the last event it includes
    block_hashes: list[int] = []


class KVEventsBody(_Message):
    epoch: str
    events: list[KVEventBody] = []
    snapshot: KVSnapshotBody | None = None


class HeartbeatRequest(_Message):
    worker_id: str
    stats: dict[str, Any] = {}  # engine stats, calibration, cost models, "draining"
    kv_events: KVEventsBody | None = None  # absent while the engine thread is busy


class HeartbeatResponse(_Message):
    ok: bool = True
    kv_snapshot: bool | None = None  # True: send every cached hash with the next beat


class PoolPollRequest(_Message):
    running: dict[str, Annotated[int, Field(ge=0, le=MAX_POOL_COUNT)]] = {}


class PoolPollResponse(_Message):
    wanted: dict[str, int]


class ScaleRequest(_Message):
    # an absolute size (3) or a change ("+1", "-2"); None leaves that pool alone
    prefill: int | str | None = None
    decode: int | str | None = None


class ScaleResponse(_Message):
    wanted: dict[str, int]
    live: dict[str, int]
    note: str | None = None


# ---- a stream resumed on a restarted router (pdserve/server/front.py)
#
# The deployment's front (the process that holds the clients' connections under
# `pdserve serve`) asks the router for each streamed chunk's token ids with the
# header below. The router then writes them as SSE comment lines, which clients
# ignore and the front removes:
#
#     : pd-stream <created>                       once, first
#     : pd-t <choice index> <id,id,...> <0|1>     before the chunk of those tokens; 1: finished
#
# If the router dies mid-stream, the front sends the original body and what each
# choice streamed so far to the restarted router, which continues the stream under
# the same id: prompt + tokens so far run on a worker, as when a decode worker dies.
TOKEN_IDS_HEADER = "x-pdserve-token-ids"
STREAM_COMMENT = ": pd-stream "
TOKENS_COMMENT = ": pd-t "


def tokens_comment(index: int, token_ids, finished: bool) -> str:
    return f"{TOKENS_COMMENT}{index} {','.join(map(str, token_ids))} {int(finished)}\n"


def parse_tokens_comment(line: str) -> tuple[int, list[int], bool]:
    """(choice index, token ids, finished) of a `: pd-t` line; ValueError if it is not one."""
    index, ids, finished = line[len(TOKENS_COMMENT) :].split(" ")
    return int(index), [int(t) for t in ids.split(",")] if ids else [], finished == "1"


class ResumedChoice(_Message):
    index: int = Field(ge=0, lt=MAX_RESUMED_CHOICES)
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(default=[], max_length=MAX_RESUMED_TOKENS)
    finished: bool = False


class ResumeRequest(_Message):
    body: str  # the client's request body, as it sent it (held to --max-request-body-bytes)
    request_id: str = Field(max_length=128)  # the stream's id ("chatcmpl-...") the client already has
    created: int = Field(ge=0)
    choices: list[ResumedChoice] = Field(default=[], max_length=MAX_RESUMED_CHOICES)  # those that streamed
