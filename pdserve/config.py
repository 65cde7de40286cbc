"""Configuration: flat dataclasses, validated at construction, composed into one.

Field names follow vLLM's engine arguments where one exists, so that
`--max-num-batched-tokens`, `--block-size`, `--enable-chunked-prefill` mean
what an operator of vLLM expects.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from pdserve.flags import Section, internal, setting, settings


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM, Qwen2, Qwen3, Mistral)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and of k, before RoPE
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = "llama"
    name: str = "model"

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> ModelConfig:
        """Build from a Hugging Face config.json dict."""
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in cfg.items() if k in known and v is not None}
        rope = cfg.get("rope_parameters")
        if isinstance(rope, dict):  # transformers 5 writes RoPE's theta and scaling here
            if rope.get("rope_theta") is not None:
                kw["rope_theta"] = rope["rope_theta"]
            scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
            if scaling.get("rope_type", scaling.get("type", "default")) != "default":
                kw["rope_scaling"] = scaling
        kw.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        kw["attention_bias"] = bool(cfg.get("attention_bias", False)) or arch.startswith("Qwen2")
        kw["qk_norm"] = arch.startswith("Qwen3")
        kw["architecture"] = arch
        kw["name"] = name
        return cls(**kw)

    def to_hf(self) -> dict[str, Any]:
        """The config.json that `transformers` and vLLM load for this shape."""
        arch, model_type = self.hf_architecture()
        out = {
            "architectures": [arch],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id,
        }
        if model_type != "qwen2":  # Qwen2's q, k, v always have a bias; the others say
            out["attention_bias"] = self.attention_bias
        if model_type == "llama":
            out["mlp_bias"] = False
        return out

    def hf_architecture(self) -> tuple[str, str]:
        """(architectures[0], model_type) of this shape's Hugging Face config.json."""
        if self.qk_norm:
            return "Qwen3ForCausalLM", "qwen3"
        if self.architecture.startswith("Qwen2"):
            return "Qwen2ForCausalLM", "qwen2"
        return "LlamaForCausalLM", "llama"

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


# One spelling of each dtype in help and output (vLLM's and torch's), the short ones also accepted.
DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32", "half": "float16", "float": "float32"}
# fp8: the accelerators plan and sim model; the engine computes in the other three
DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8")


def canonical_dtype(name: str) -> str:
    """`bf16` -> `bfloat16` and the like; other names unchanged."""
    return DTYPE_SPELLINGS.get(name, name)


@dataclass
class CacheConfig:
    """Paged KV cache.

    Block size and how many blocks the pool holds."""

    block_size: int = setting(16, help="tokens per KV cache block (a power of two)")
    num_gpu_blocks: int | None = setting(
        None,
        help="KV cache blocks (default: as many as --kv-cache-memory-bytes holds; sim: as many as the "
        "accelerator's memory left after the weights holds)",
    )
    kv_cache_memory_bytes: int = setting(1 << 30, help="memory for the KV cache when --num-gpu-blocks is not given")
    enable_prefix_caching: bool = setting(True, help="reuse the KV blocks of a prompt prefix seen before")
    kv_cache_shm_dir: str = internal(
        "",
        why="a decode worker sets it from --kv-shm-dir (files a prefill worker on the same host "
        "writes into directly; '' -> private memory)",
    )

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size must be a positive power of two")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ConfigError("num_gpu_blocks must be >= 1")


@dataclass
class SchedulerConfig:
    """Scheduler.

    A token budget per step: one loop for collocated, prefill and decode roles."""

    max_num_batched_tokens: int = setting(2048, help="tokens one engine step may process (the token budget)")
    max_num_seqs: int = setting(64, help="sequences one engine step may run")
    enable_chunked_prefill: bool = setting(True, help="split long prompts over steps within the token budget")
    long_prefill_token_threshold: int = setting(
        0, help="largest slice of one prompt per step with chunked prefill (0: the whole token budget)"
    )
    max_num_partial_prefills: int = setting(
        1,
        help="with chunked prefill, how many prompts may be split over steps at once (0: any number); "
        "shorter prompts that finish within a step pass a split one waiting. 1 (vLLM's default): long "
        "prompts are prefilled one after another, not all at a fraction of the pace",
    )
    policy: str = setting(
        "fcfs",
        flag="--scheduling-policy",
        choices=("fcfs", "priority"),
        help="the engine's order of waiting requests (the router's placement is --policy)",
    )
    kv_transfer_headroom: float = setting(
        0.05,
        help="share of the KV pool that admitting remote KV (a P->D transfer) leaves free for the running "
        "sequences to grow into",
    )

    def __post_init__(self):
        if not 0.0 <= self.kv_transfer_headroom < 1.0:
            raise ConfigError("kv_transfer_headroom must be in [0, 1)")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError("policy must be 'fcfs' or 'priority'")
        if self.long_prefill_token_threshold < 0:
            raise ConfigError("long_prefill_token_threshold must be >= 0")
        if self.max_num_partial_prefills < 0:
            raise ConfigError("max_num_partial_prefills must be >= 0")


@dataclass
class KVTierConfig:
    """KV tiers below the pool (pdserve/kvstore).

    Each off unless named."""

    kv_offload_bytes: int = setting(0, help="host memory for blocks evicted from the pool (L2; 0: none)")
    kv_disk_dir: str = setting(
        "",
        help="directory for blocks the host tier drops (L3; kept across restarts; "
        "pdserve serve gives each worker a subdirectory)",
    )
    kv_disk_bytes: int = setting(4 << 30, help="bound on --kv-disk-dir")
    kv_store: str = setting("", choices=("", "mooncake"), help="shared tier every worker can load from: Mooncake Store")
    kv_store_master: str = setting(
        "", metavar="HOST:PORT", help="the Mooncake master to join (serve starts one on loopback when not given)"
    )
    kv_store_metadata_url: str = setting("", help="its metadata server (default http://<master host>:8080/metadata)")
    kv_store_segment_bytes: int = setting(256 << 20, help="memory this worker lends to the shared store")

    def __post_init__(self):
        if self.kv_offload_bytes < 0 or self.kv_disk_bytes <= 0 or self.kv_store_segment_bytes <= 0:
            raise ConfigError("kv_offload_bytes must be >= 0, kv_disk_bytes and kv_store_segment_bytes > 0")
        if self.kv_store not in ("", "mooncake"):
            raise ConfigError(f"unknown kv_store {self.kv_store!r} (the shared tier is 'mooncake')")
        if self.kv_store and not self.kv_store_master:
            raise ConfigError("kv_store needs kv_store_master (HOST:PORT of the Mooncake master)")
        if self.kv_disk_dir:
            # the directory (or the nearest part of its path that exists) must be a directory
            at = os.path.abspath(self.kv_disk_dir)
            while not os.path.exists(at) and os.path.dirname(at) != at:
                at = os.path.dirname(at)
            if not os.path.isdir(at):
                raise ConfigError(f"kv_disk_dir {self.kv_disk_dir!r}: {at} is not a directory")

    @property
    def enabled(self) -> bool:
        return bool(self.kv_offload_bytes or self.kv_disk_dir or self.kv_store)


ATTENTION_BACKENDS = ("auto", "torch", "triton")
GGUF_MAX_ROWS_LIMIT = 64  # past this the block kernels lose to any GEMM


@dataclass
class DeviceConfig:
    """Device, dtype and threads."""

    device: str = setting("auto", help="auto (cuda when present, else cpu), cpu, cuda, cuda:N")
    dtype: str = setting(
        "auto",
        choices=DTYPES,
        spellings=DTYPE_SPELLINGS,
        help="compute dtype; auto: bfloat16 where the hardware computes it natively, else float32 "
        "(plan and sim: bfloat16); fp8: the accelerators plan and sim model, not the engine",
    )
    threads: int = setting(0, help="CPU threads for torch (0: torch's default)")
    attention_backend: str = setting(
        "auto",
        choices=ATTENTION_BACKENDS,
        help="paged attention: auto (triton on cuda; on cpu the C++ kernels, else torch), torch (SDPA and "
        "index_copy, no compiled kernels), triton (the Triton kernels: on cpu only under TRITON_INTERPRET=1)",
    )
    enforce_eager: bool = setting(
        False,
        help="never capture CUDA graphs: every decode step runs eagerly (cuda with the triton backend "
        "captures them by default; cpu is always eager)",
    )
    dtype_reason: str = internal("", why="set when 'auto' is resolved, logged at start-up")

    def __post_init__(self):
        import torch

        self.dtype = canonical_dtype(self.dtype)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.dtype == "auto":
            native, why = native_bf16(self.device)
            self.dtype = "bfloat16" if native else "float32"
            self.dtype_reason = f"auto: {why}"
        elif not self.dtype_reason:
            self.dtype_reason = "set explicitly"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}: the engine computes in float32, bfloat16 or float16")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)


MAX_LORA_RANK_LIMIT = 512  # --max-lora-rank's ceiling (vLLM's largest)
MAX_LORAS_LIMIT = 60  # adapters one worker holds: each is advertised to the router as a feature


@dataclass
class LoRAConfig:
    """LoRA adapters.

    Fine-tunes of the served model that requests choose by their `model` field."""

    enable_lora: bool = setting(False, help="serve LoRA adapters (vLLM's flag): requests name one as their model")
    lora_modules: list[str] | None = setting(
        None,
        metavar="NAME=PATH",
        help="""adapters loaded at start, each a PEFT adapter directory (adapter_config.json and
        adapter_model.safetensors), as NAME=PATH or '{"name": NAME, "path": PATH}' (vLLM's flag); a request
        whose model is NAME runs with it""",
    )
    max_loras: int = setting(1, help="most distinct adapters in one engine step (vLLM's flag and default)")
    max_lora_rank: int = setting(16, help="adapters of a higher rank are refused (vLLM's flag and default)")
    max_cpu_loras: int | None = setting(
        None,
        help="most adapters one worker holds; loading one more unloads the least recently loaded that no "
        "request uses and --lora-modules did not name (default: --max-loras, or the --lora-modules given "
        f"if more; at most {MAX_LORAS_LIMIT})",
    )

    def __post_init__(self):
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules needs --enable-lora")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ConfigError(f"max_lora_rank must be within 1..{MAX_LORA_RANK_LIMIT}, not {self.max_lora_rank}")
        if not 1 <= self.max_loras <= MAX_LORAS_LIMIT:
            raise ConfigError(f"max_loras must be within 1..{MAX_LORAS_LIMIT}, not {self.max_loras}")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = min(MAX_LORAS_LIMIT, max(self.max_loras, len(self.lora_modules or ())))
        if not self.max_loras <= self.max_cpu_loras <= MAX_LORAS_LIMIT:
            raise ConfigError(
                f"max_cpu_loras must be within max_loras ({self.max_loras})..{MAX_LORAS_LIMIT}, not {self.max_cpu_loras}"
            )
        if len(self.lora_modules or ()) > self.max_cpu_loras:
            raise ConfigError(f"{len(self.lora_modules)} --lora-modules; --max-cpu-loras is {self.max_cpu_loras}")


SPEC_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16  # drafts a sequence may carry into one step
MAX_PROMPT_LOOKUP = 64  # longest n-gram looked for


@dataclass
class SpeculativeConfig:
    """Speculative decoding, by vLLM's `--speculative-config` keys.

    "ngram" (prompt lookup): no draft model; a sequence's next tokens are guessed by
    finding its last n tokens earlier in its own prompt and output and proposing what
    followed them there. It pays off where outputs copy their input (editing, extraction,
    summaries that quote, code) and costs a little where they do not (each step computes
    the drafts whether or not they are kept)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 5  # vLLM's defaults; one given alone sets both
    prompt_lookup_min: int = 5
    # no drafts in a step that runs this many sequences or more (None: always): a large
    # batch already fills the matrix units, and rejected drafts there are pure cost
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            raise ConfigError(
                f"speculative method {self.method!r} is not supported: only 'ngram' (prompt lookup); draft "
                "models, EAGLE and MTP need a second model or heads pdserve does not load"
            )
        for name, value, lo, hi in (
            ("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", self.prompt_lookup_max, 1, MAX_PROMPT_LOOKUP),
            ("prompt_lookup_min", self.prompt_lookup_min, 1, MAX_PROMPT_LOOKUP),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ConfigError(f"speculative {name} must be an integer within {lo}..{hi}, not {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        d = self.disable_by_batch_size
        if d is not None and (not isinstance(d, int) or isinstance(d, bool) or d < 1):
            raise ConfigError(f"speculative disable_by_batch_size must be an integer >= 1, not {d!r}")

    @classmethod
    def parse(cls, value: str | dict) -> SpeculativeConfig:
        """From the flag's JSON or a dict (`LLM(speculative_config={...})`)."""
        import json

        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ConfigError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ConfigError(
                'speculative_config must be a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}'
            )
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config keys {unknown}; known: {sorted(known)}")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise ConfigError("speculative_config needs 'method' and 'num_speculative_tokens'")
        kw = dict(value)
        if "prompt_lookup_max" in kw and "prompt_lookup_min" not in kw:
            kw["prompt_lookup_min"] = kw["prompt_lookup_max"]
        elif "prompt_lookup_min" in kw and "prompt_lookup_max" not in kw:
            kw["prompt_lookup_max"] = kw["prompt_lookup_min"]
        return cls(**kw)


@dataclass
class EngineConfig:
    """The model and the engine.

    Everything one worker's engine needs, composed from the parts above."""

    model: str | None = setting(
        None, help="GGUF file or Hugging Face directory of the weights (default: the embedded SmolLM2-135M-Instruct)"
    )
    tokenizer: str | None = internal(
        None, why="set from Python: the router reads its tokenizer from --model, one flag would have to reach both"
    )
    max_model_len: int | None = setting(None, help="context length (default: the model's)")
    seed: int = internal(0, why="set from Python; `generate --seed` is the sampling seed of each prompt")
    use_gguf_kernels: bool = setting(
        True, help="small-batch matmuls read a GGUF file's Q4_0/Q4_1/Q8_0 blocks directly (CPU, fp32)"
    )
    gguf_max_rows: int | None = setting(
        None,
        help="products of at most this many rows run on the GGUF blocks (and decode steps of at most this "
        "many sequences in the fused C++ layer); more rows take the dense GEMM. Default: 16 in float32 "
        "(where the fp32 GEMM is slower), 2 in bfloat16 (past 2 rows oneDNN's bf16 GEMM is faster)",
    )
    int8_activations: bool | None = setting(
        None,
        help="products on GGUF blocks round activations to int8 per 32 values (llama.cpp's Q8 x Q4 dot "
        "products), for any number of rows: faster prefill and decode on CPUs without native bf16, not "
        "token-identical to exact fp32 (agreement: docs/performance.md). Default: on under --dtype auto "
        "where it resolves to float32 on an AVX2 CPU, else off",
    )
    speculative_config: str | None = setting(
        None,
        metavar="JSON",
        help="""speculative decoding (vLLM's flag): '{"method": "ngram", "num_speculative_tokens": 4}' drafts
        tokens by finding the sequence's last few tokens earlier in it (prompt lookup) and checks them all in
        one forward pass; each position is sampled as without drafts, so greedy and seeded output is the same
        up to the last bits of the logits (float32: ~1e-6; bfloat16: near ties may differ). Keys:
        prompt_lookup_max/prompt_lookup_min (longest/shortest n-gram matched, default 5; one alone sets both),
        disable_by_batch_size (no drafts while this many sequences run)""",
    )
    speculative: SpeculativeConfig | None = internal(None, why="parsed from speculative_config")
    cache: CacheConfig = internal(default_factory=CacheConfig, why="a section of its own")
    scheduler: SchedulerConfig = internal(default_factory=SchedulerConfig, why="a section of its own")
    device: DeviceConfig = internal(default_factory=DeviceConfig, why="a section of its own")
    tiers: KVTierConfig = internal(default_factory=KVTierConfig, why="a section of its own")
    lora: LoRAConfig = internal(default_factory=LoRAConfig, why="a section of its own")

    def __post_init__(self):
        if self.gguf_max_rows is not None and not 0 <= self.gguf_max_rows <= GGUF_MAX_ROWS_LIMIT:
            raise ConfigError(f"gguf_max_rows must be within 0..{GGUF_MAX_ROWS_LIMIT}, not {self.gguf_max_rows}")
        if self.int8_activations is None:
            self.int8_activations, why = auto_int8(self.device)
            if why:
                self.device.dtype_reason += f"; {why}"
        if self.tiers.enabled and not self.cache.enable_prefix_caching:
            raise ConfigError("KV tiers find blocks by their prefix hash: they need prefix caching on")
        if self.speculative is None and self.speculative_config is not None:
            self.speculative = SpeculativeConfig.parse(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Accept flat vLLM-style keyword arguments and route each to its part."""
        split: dict[str, dict] = {name: {} for name in ENGINE_PARTS}
        top: dict[str, Any] = {}
        top_names = {f.name for f in dataclasses.fields(cls)} - set(ENGINE_PARTS)
        for key, value in kwargs.items():
            if key in top_names:
                top[key] = value
                continue
            for name, klass in ENGINE_PARTS.items():
                if key in {f.name for f in dataclasses.fields(klass)}:
                    split[name][key] = value
                    break
            else:
                raise ConfigError(f"unknown engine argument {key!r}")
        return cls(**top, **{name: ENGINE_PARTS[name](**kw) for name, kw in split.items()})


ENGINE_PARTS = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "device": DeviceConfig,
    "tiers": KVTierConfig,
    "lora": LoRAConfig,
}
# the engine's flags, section by section (serve, worker and generate all take these)
ENGINE_SECTIONS = tuple(
    Section(c) for c in (EngineConfig, DeviceConfig, CacheConfig, SchedulerConfig, KVTierConfig, LoRAConfig)
)


def engine_kwargs(args) -> dict:
    """The engine's settings found in a parsed namespace, flat, all but the model:
    `EngineConfig.from_kwargs(model=args.model, **engine_kwargs(args))`, `LLM(args.model, **...)`."""
    out = {}
    for section in ENGINE_SECTIONS:
        for s in settings(section):
            if s.name != "model" and hasattr(args, s.name):
                out[s.name] = getattr(args, s.name)
    return out


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo ("?" where it names none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "?"


def cpu_description() -> str:
    """One line for a benchmark's report: model, the vector features that decide the kernels
    and dtype, and the CPU count, e.g. "AMD EPYC 9B45 (avx512_bf16, avx512f, avx2), 2 CPUs"."""
    flags = cpu_flags()
    isa = [f for f in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2") if f in flags]
    return f"{cpu_model()} ({', '.join(isa) or 'no AVX'}), {os.cpu_count()} CPUs"


_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def native_bf16(device: str, flags: set[str] | None = None, onednn_bf16: bool | None = None) -> tuple[bool, str]:
    """Whether bf16 is what this device computes fastest, and why (for the start-up log).

    GPUs: yes. CPUs: yes with AVX512-BF16 or AMX-BF16 (dense bf16 GEMM measured ~3.5-4x
    float32 on a 2-core Zen 5, `docs/performance.md`); on an AVX2-only CPU bf16 is
    emulated and measured 3-5x *slower* than float32, so float32. The flags come from
    /proc/cpuinfo: `torch.backends.cpu.get_cpu_capability()` says "AVX512" for a Zen 4/5
    that has AVX512-BF16, so it cannot tell. oneDNN's own bf16 check must agree (a torch
    built without oneDNN bf16 would emulate it)."""
    import torch

    if device.startswith("cuda"):
        return True, "CUDA device"
    if os.environ.get("PDSERVE_AUTO_DTYPE") in ("float32", "bfloat16", "int8"):  # operator override of "auto"
        forced = os.environ["PDSERVE_AUTO_DTYPE"]
        return forced == "bfloat16", f"PDSERVE_AUTO_DTYPE={forced}"
    flags = cpu_flags() if flags is None else flags
    have = [f for f in _BF16_FLAGS if f in flags]
    if onednn_bf16 is None:
        try:
            onednn_bf16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        except Exception:  # noqa: BLE001 - no oneDNN in this torch build
            onednn_bf16 = False
    if have and onednn_bf16:
        return True, f"CPU has {'+'.join(have)} (native bf16 dot products) and oneDNN bf16 is supported"
    if have:
        return False, f"CPU has {'+'.join(have)} but this torch's oneDNN has no bf16 kernels"
    if onednn_bf16:
        return False, "no avx512_bf16/amx_bf16 in the CPU flags (oneDNN would emulate bf16): float32 is faster"
    return False, "no native bf16 on this CPU (AVX2-class): bf16 would be emulated, float32 is faster"


def auto_int8(device: DeviceConfig, flags: set[str] | None = None) -> tuple[bool, str]:
    """Whether int8 activations are on when the caller did not say, and why (for the start-up log).

    Only under dtype "auto" resolved to float32 on a CPU with AVX2 (`vpmaddubsw`): there fp32
    is the fastest float GEMM and int8 products on the GGUF blocks run ~1.5-3x faster, at the
    agreement measured in docs/performance.md. An explicit dtype (float32 is the exact mode)
    keeps them off; PDSERVE_AUTO_DTYPE=float32 makes "auto" exact too."""
    if not device.dtype_reason.startswith("auto") or device.dtype != "float32" or device.device != "cpu":
        return False, ""
    if os.environ.get("PDSERVE_AUTO_DTYPE") == "float32":
        return False, ""
    if os.environ.get("PDSERVE_AUTO_DTYPE") == "int8":
        return True, "int8 activations (PDSERVE_AUTO_DTYPE=int8)"
    if "avx2" not in (cpu_flags() if flags is None else flags):
        return False, ""
    return True, "int8 activations on the GGUF blocks (AVX2 vpmaddubsw; --no-int8-activations for exact fp32)"


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
