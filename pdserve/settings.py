"""The settings of the serving processes, and which command takes which.

`pdserve serve` is a router plus workers: it takes every section its children
take, and hands each child the values of the settings they share (see
server/launcher.py). The engine's own sections are in config.py. Standard library
only: `pdserve plan` imports the SLO section and starts without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve import auth
from pdserve.config import DTYPE_SPELLINGS, ENGINE_SECTIONS, EngineConfig
from pdserve.flags import Section, setting
from pdserve.planner.deployment import KV_DTYPES
from pdserve.router.autoscale import AutoscaleConfig
from pdserve.router.policy import POLICIES

# How long a decode worker keeps blocks reserved for KV that has not arrived (the lease
# the router asks for). A transfer that breaks is reported at once, so this only bounds a
# silent hang, and a CPU prefill queued behind long prompts can take tens of seconds.
KV_TIMEOUT_S = 120.0
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class ListenConfig:
    """Where this process listens."""

    host: str | None = setting(
        "127.0.0.1",
        help="address to bind (loopback by default; serve --ray --ray-address: each node's Ray address)",
    )
    port: int = setting(8000, help="port to listen on (0: any free port)")


@dataclass
class FrontendConfig:
    """The OpenAI API.

    Who may call it and how much one request may ask."""

    api_key: str | None = setting(
        None,
        env="PDSERVE_API_KEY",
        secret=True,
        help="require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize",
    )
    served_model_name: list[str] | None = setting(None, help="model id(s) clients use (default: the model's own name)")
    max_request_body_bytes: int = setting(1 << 20, help="larger request bodies get 413 before they are read")
    max_seqs_per_request: int = setting(256, help="most sequences (prompts x n) one request may ask for; more get 400")
    metrics_require_key: bool = setting(False, help="/metrics needs the --api-key too (by default it is open)")
    enable_auto_tool_choice: bool = setting(
        False,
        help="tool_choice 'auto' (the default when tools are given): the model decides whether to call, "
        "and --tool-call-parser reads its calls from its output (vLLM's flag)",
    )
    tool_call_parser: str | None = setting(
        None,
        choices=("hermes", "llama3_json", "mistral", "pythonic"),
        help="the model's own tool-call syntax, for --enable-auto-tool-choice (vLLM's names): hermes "
        "(<tool_call>{...}</tool_call>: Hermes, Qwen2.5, Qwen3), llama3_json (Llama 3.1-3.3), mistral "
        "([TOOL_CALLS]...), pythonic ([f(a=1), ...]: Llama 3.2 and 4)",
    )
    generation_config: str = setting(
        "auto",
        help="default sampling parameters of requests that leave them out (vLLM's flag): 'auto' takes the "
        "model directory's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty; "
        "max_new_tokens caps max_tokens), 'vllm' ignores it, or a directory with such a file",
    )
    override_generation_config: str | None = setting(
        None,
        metavar="JSON",
        help="""values that replace the generation config's, by its names: '{"temperature": 0.5}' (vLLM's flag)""",
    )
    trust_request_chat_template: bool = setting(
        False,
        help="requests may bring their own chat_template (vLLM's flag); it runs in Jinja's sandbox, but "
        "a template can still loop for as long as it likes and build large strings: only for callers you trust",
    )
    reasoning_parser: str | None = setting(
        None,
        choices=("deepseek_r1", "qwen3"),
        help="return a reasoning model's <think>...</think> apart from its answer, in the chat reply's "
        "reasoning (and reasoning_content) field (vLLM's flag): deepseek_r1 (DeepSeek-R1 and its distills, "
        "QwQ), qwen3",
    )
    enable_prompt_tokens_details: bool = setting(
        False,
        help="usage reports prompt_tokens_details.cached_tokens: prompt tokens found in the prefix cache or "
        "a KV tier rather than computed (vLLM's flag)",
    )
    allow_runtime_lora_updating: bool = setting(
        False,
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and unload LoRA adapters while "
        "serving (what vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING turns on): the caller names a directory "
        "that every worker reads, so only for callers you trust (they need the --api-key when one is set)",
    )
    vllm_metric_names: bool = setting(
        False,
        help="/metrics also exports the families vLLM has under its vllm: names (dashboards, alerts and "
        "autoscalers written for vLLM read them unchanged)",
    )


@dataclass
class ProcessConfig:
    """Logs and shutdown."""

    shutdown_timeout: float = setting(
        30.0,
        help="seconds in-flight requests get to finish after SIGTERM (new ones get 503 meanwhile; a worker "
        "tells its router to stop placing work on it at once)",
    )
    log_level: str = setting("info", choices=LOG_LEVELS, help="log level")
    log_format: str = setting("text", choices=("text", "json"), help="text (logfmt) or json, one line per event")


@dataclass
class TracingConfig:
    """Request traces (OpenTelemetry)."""

    otlp_traces_endpoint: str | None = setting(
        None,
        metavar="URL",
        help="export a trace of every request to this OpenTelemetry collector over OTLP (vLLM's flag): "
        "the router's, the workers' and the engine's spans in one trace, under the client's traceparent if it "
        "sends one; grpc (http://HOST:4317) unless OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf "
        "(http://HOST:4318/v1/traces); the OTEL_* variables set the rest (sampler, headers, service name). "
        "Needs pip install 'pdserve[tracing]'",
    )


@dataclass
class SecurityConfig:
    """The deployment's shared secret."""

    cluster_token_file: str | None = setting(
        None,
        secret=True,  # pdserve serve hands it to its children in their environment
        metavar="FILE",
        help="the deployment's shared secret, required on every internal route and KV connection "
        f"(default: ${auth.TOKEN_ENV}, else {auth.DEFAULT_TOKEN_FILE}, made on first use)",
    )


@dataclass
class InternalNames:
    """Names this process is reached at, besides its own socket's."""

    internal_aliases: list[str] | None = setting(
        None,
        metavar="HOST:PORT",
        help="host:port names that others reach this process at for internal calls when it is not "
        "its socket's (a Docker port mapping, a Kubernetes Service port): signatures made out to "
        "them are accepted (by default only those for the port it listens on)",
    )


@dataclass
class EngineServerConfig:
    """The process around an engine: its queue and its step trace."""

    max_waiting_requests: int = setting(
        256, help="sequences that may wait in the engine for their first token before new requests get 429"
    )
    step_trace: str | None = setting(
        None,
        metavar="FILE",
        help="append one JSON line per engine step (timing and batch shape), for `pdserve sim --calibrate "
        "--from-trace`; serve (disaggregated): FILE.<worker-id>.jsonl per worker",
    )


@dataclass
class SLOConfig:
    """SLO targets.

    The router refuses (429) requests predicted to miss them, before any prefill; the
    simulator does as the router does; the planner sizes the pools for them."""

    slo_ttft_ms: float | None = setting(None, help="time-to-first-token target, ms (off by default)")
    slo_tpot_ms: float | None = setting(None, help="time-per-output-token target, ms (off by default)")
    kv_watermark: float | None = setting(
        None, help="refuse new long requests while decode KV usage is above this fraction, e.g. 0.92 (off)"
    )
    long_request_tokens: int = setting(1024, help="prompt + max_tokens at or above this is long, for --kv-watermark")


@dataclass
class RouterConfig:
    """The router.

    Placement, the KV handoff it drives, how long it waits."""

    router_policy: str = setting(
        "cache_aware",
        flag="--policy",
        choices=POLICIES,
        help="prefill placement (cache_aware: lowest (1 - cache hit) x prefill time + alpha x queue wait, from "
        "the prefix index); decode goes to the worker with the most free KV. The engine's own order is "
        "--scheduling-policy",
    )
    kv_mode: str = setting(
        "push", choices=("push", "pull"), help="push: P writes into blocks D reserved; pull: D fetches from P"
    )
    kv_bandwidth_gbps: float | None = setting(
        None,
        help="KV transfer bandwidth in Gbit/s (10^9 bits) for the TTFT prediction (default: measured from the "
        "exposed part of past transfers, 10 Gbit/s until the first one)",
    )
    worker_timeout_s: float = setting(3.0, help="seconds without a heartbeat before a worker is dead")
    kv_timeout_s: float = setting(KV_TIMEOUT_S, help="lease of a decode reservation whose KV has not arrived")
    max_num_seqs_in_flight: int = setting(1024, help="sequences the router handles at once")
    max_local_prefill_length: int = setting(
        0,
        help="conditional disaggregation: a prompt with at most this many tokens not already cached on "
        "the chosen decode worker is prefilled there, not on a prefill worker (no queue there, no KV "
        "transfer); 0: every prompt goes to a prefill worker",
    )
    autoscale: bool = setting(
        False,
        help="grow and shrink the pools from queue and KV-usage signals and the P:D advice, within "
        "--min/--max-prefill and --min/--max-decode, one worker per --autoscale-cooldown-s",
    )


@dataclass
class KVTransferConfig:
    """KV transfer from prefill to decode workers."""

    kv_transport: str = setting(
        "auto",
        choices=("auto", "tcp", "nixl"),
        help="auto: shared memory when the decode worker is on the same host, else TCP; nixl: the decode "
        "worker's cache is a NIXL WRITE target (needs nixl-cu12) that prefill workers write into one-sided",
    )
    kv_layerwise: bool = setting(True, help="send each layer's KV as soon as it is computed (off: eager)")
    kv_wire: str = setting("none", choices=("none", "int8", "fp8"), help="KV compression on the wire")


@dataclass
class WorkerConfig:
    """The worker and its router.

    Heartbeats, start-up calibration, KV leases."""

    kv_shm_dir: str = setting("/dev/shm", help="decode side: directory for the shared KV cache ('' to disable)")
    heartbeat_s: float = setting(1.0, help="seconds between heartbeats to the router")
    calibrate: bool = setting(
        True,
        help="measure the cost models at start-up for the router's placement and admission: D_prefill(L) on "
        "prefill roles, decode step time vs batch and context on decode roles",
    )
    max_kv_lease_s: float = setting(
        600.0,
        help="cap on the lease of a KV reservation and on a decode's wait for its KV, whatever the router asks",
    )


@dataclass
class WorkerIdentity:
    """Which worker this is.

    pdserve serve sets these for each worker it starts."""

    role: str | None = setting(None, choices=("prefill", "decode", "both"), help="required: the worker's role")
    router: str | None = setting(None, help="router URL to register with, e.g. http://127.0.0.1:8000")
    advertise_host: str | None = setting(None, help="address others use to reach this worker (default: --host)")
    worker_id: str | None = setting(None, help="its id at the router (default: <role>-<random>)")
    cpu_cores: str | None = setting(None, help="pin this process to these cores, e.g. 0 or 0,1")


@dataclass
class DeploymentConfig:
    """What pdserve serve starts."""

    mode: str = setting(
        "disaggregated",
        choices=("disaggregated", "collocated"),
        help="disaggregated: router + prefill and decode worker processes; collocated: one engine",
    )
    prefill: int = setting(1, help="prefill workers (disaggregated)")
    decode: int = setting(1, help="decode workers (disaggregated)")
    pin: bool = setting(True, help="pin each worker to cores of its own")


@dataclass
class RayConfig:
    """Ray (pip install 'pdserve[ray]')."""

    ray: bool = setting(False, help="run the router and every worker as Ray actors on a Ray cluster")
    ray_address: str | None = setting(
        None, help="the cluster to join: auto, or HOST:PORT of its head (default: start a local one)"
    )
    placement: str = setting(
        "spread",
        choices=("spread", "pack"),
        help="spread: prefill and decode workers on different nodes where possible; pack: together",
    )
    ray_max_restarts: int = setting(-1, help="restarts Ray gives each actor (-1: no limit)")


@dataclass
class ModelledConfig:
    """The modelled model and accelerator (plan, sim)."""

    model_config: str | None = setting(
        None,
        metavar="NAME|config.json",
        help="the modelled model's shape: a catalog name (pdserve plan --list) or a Hugging Face config.json "
        "(the weights to serve or measure are --model)",
    )
    gpu: str | None = setting(
        None, help="the modelled accelerator (pdserve plan --list); plan: of the prefill pool, or of both"
    )
    kv_dtype: str = setting(
        "bfloat16", choices=KV_DTYPES, spellings=DTYPE_SPELLINGS, help="KV cache dtype of the modelled deployment"
    )


# the router tokenizes and checks lengths as the workers will: the same model and context
MODEL = Section(EngineConfig, only=("model", "max_model_len"))
AUTOSCALE = Section(AutoscaleConfig)
ROUTER_SECTIONS = (
    MODEL,
    Section(ListenConfig),
    Section(FrontendConfig),
    Section(RouterConfig),
    Section(SLOConfig),
    AUTOSCALE,
    Section(SecurityConfig),
    Section(InternalNames),
    Section(TracingConfig),
    Section(ProcessConfig),
)
WORKER_SECTIONS = (
    Section(WorkerIdentity),
    Section(ListenConfig, defaults={"port": 0}, why="a worker's control API: any free port, 8000 is the router's"),
    Section(KVTransferConfig),
    Section(WorkerConfig),
    Section(EngineServerConfig),
    *ENGINE_SECTIONS,
    Section(SecurityConfig),
    Section(InternalNames),
    Section(TracingConfig),
    Section(ProcessConfig),
)
SERVE_SECTIONS = (
    Section(DeploymentConfig),
    Section(
        ListenConfig,
        defaults={"host": None},
        why="None: loopback, unless --ray-address is given (then each node's own address)",
    ),
    Section(FrontendConfig),
    Section(RouterConfig),
    Section(SLOConfig),
    AUTOSCALE,
    Section(KVTransferConfig),
    Section(WorkerConfig),
    Section(EngineServerConfig),
    *ENGINE_SECTIONS,
    Section(SecurityConfig),
    Section(InternalNames),
    Section(RayConfig),
    Section(TracingConfig),
    Section(ProcessConfig),
)
COMMANDS = {"serve": SERVE_SECTIONS, "router": ROUTER_SECTIONS, "worker": WORKER_SECTIONS}
