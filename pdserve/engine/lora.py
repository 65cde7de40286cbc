"""LoRA adapters: many fine-tunes of one base model served from one copy of its weights.

A LoRA adapter changes a projection W into W + s * B @ A, with A (r x in) and B (out x r)
of a small rank r, and s = alpha / r (alpha / sqrt(r) with rsLoRA). The base weights stay
as they are: each projection's output gets s * (x A^T) B^T added for the rows of the
sequences that use the adapter, group by group, so sequences with different adapters (and
none) share every step, as in vLLM's and S-LoRA's batched LoRA. Adapters are PEFT's files
(adapter_config.json and adapter_model.safetensors; never a pickle), for the attention and
MLP projections of the decoder layers.

A request names its adapter by `SamplingParams.lora_adapter`: the adapter's key,
"name@fingerprint", where the fingerprint hashes its weights. The key starts the request's
block-hash chain (kv/hashing.py), so KV computed under one adapter is never reused under
another, nor under the same name after its weights changed, in any cache tier or worker; a
worker refuses a key whose weights it does not have, and the router places a request only
on workers that said they hold its key (control_api.WORKER_FEATURES).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.config import ConfigError, ModelConfig

# the projections an adapter may change: PEFT's module name -> (the fused product it is a
# part of in model.py, its index among that product's parts)
TARGETS = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}
MAX_ADAPTER_NAME_CHARS = 128
MAX_ADAPTER_FILE_BYTES = 8 << 30  # an adapter larger than this is not a low-rank one
_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
_NAME_RE = re.compile(rf"^[^\s=]{{1,{MAX_ADAPTER_NAME_CHARS}}}$")


class LoRAError(ConfigError):
    """An adapter that cannot be loaded: the reason names the file, the tensor or the setting."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter for `LLM.generate` (vLLM's type): its name, a number the caller keeps for
    it, and its directory. Loaded on first use; the same name with another directory (or
    changed files) is loaded again as a new adapter."""

    lora_name: str
    lora_int_id: int
    lora_path: str


def check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise LoRAError(f"adapter name {name!r}: 1 to {MAX_ADAPTER_NAME_CHARS} characters, no spaces and no '='")
    return name


def parse_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules' values: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ...}."""
    out = []
    for spec in specs or []:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                d = json.loads(spec)
            except json.JSONDecodeError as e:
                raise LoRAError(f"--lora-modules {spec!r} is not JSON: {e}") from None
            if not isinstance(d, dict) or not isinstance(d.get("name"), str) or not isinstance(d.get("path"), str):
                raise LoRAError(f'--lora-modules {spec!r}: a JSON module is {{"name": ..., "path": ...}}')
            name, path = d["name"], d["path"]
        else:
            name, sep, path = spec.partition("=")
            if not sep or not path:
                raise LoRAError(f"--lora-modules {spec!r}: expected NAME=PATH")
        out.append((check_name(name), path))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise LoRAError(f"--lora-modules names an adapter twice: {sorted(n for n in names if names.count(n) > 1)}")
    return out


@dataclass
class Part:
    """One projection's adapter matrices: A (r x in), B (out x r), where its rows fall in the
    fused product's output."""

    a: torch.Tensor
    b: torch.Tensor
    out_slice: slice


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    fingerprint: str
    # per decoder layer: fused product name ("qkv", "o", "gate_up", "down") -> its parts
    layers: list[dict[str, list[Part]]]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.fingerprint}"

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b.nbytes for layer in self.layers for parts in layer.values() for p in parts)


def _part_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """PEFT module name -> (in features, out features, first output row in its fused product)."""
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q, 0),
        "k_proj": (h, kv, q),
        "v_proj": (h, kv, q + kv),
        "o_proj": (q, h, 0),
        "gate_proj": (h, i, 0),
        "up_proj": (h, i, i),
        "down_proj": (i, h, 0),
    }


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"{path}: no adapter_config.json (a PEFT LoRA adapter directory is expected)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LoRAError(f"{cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"{cfg_path}: not a JSON object")
    kind = str(cfg.get("peft_type", "LORA")).upper()
    if kind != "LORA":
        raise LoRAError(f"{cfg_path}: peft_type {kind}; only LORA adapters are served")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (fully trained copies of base layers)",
        "rank_pattern": "per-module ranks (rank_pattern)",
        "alpha_pattern": "per-module alphas (alpha_pattern)",
        "layers_to_transform": "layers_to_transform",
        "layer_replication": "layer_replication",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise LoRAError(f"{cfg_path}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"{cfg_path}: bias {cfg['bias']!r}; only adapters without bias terms (bias 'none') are served")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{cfg_path}: r must be a positive integer, not {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{cfg_path}: lora_alpha must be a number, not {alpha!r}")
    return cfg


def load_adapter(
    name: str, path: str, model_config: ModelConfig, max_rank: int, dtype: torch.dtype, device="cpu"
) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for this model; LoRAError says what is wrong."""
    from safetensors import SafetensorError, safe_open

    check_name(name)
    if not os.path.isdir(path):
        raise LoRAError(f"adapter {name!r}: {path} is not a directory")
    cfg = _read_config(path)
    rank = cfg["r"]
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        why = (
            " (adapter_model.bin is a pickle, which pdserve never loads)"
            if os.path.exists(os.path.join(path, "adapter_model.bin"))
            else ""
        )
        raise LoRAError(f"adapter {name!r}: {path} has no adapter_model.safetensors{why}")
    if os.path.getsize(weights) > MAX_ADAPTER_FILE_BYTES:
        raise LoRAError(f"adapter {name!r}: {weights} is over {MAX_ADAPTER_FILE_BYTES >> 30} GiB")
    shapes = _part_shapes(model_config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([rank, cfg.get("lora_alpha", rank), bool(cfg.get("use_rslora"))]).encode())
    try:
        with safe_open(weights, framework="pt") as f:
            for tname in sorted(f.keys()):
                m = _TENSOR_RE.match(tname)
                if m is None or m["module"] not in TARGETS:
                    raise LoRAError(
                        f"adapter {name!r}: tensor {tname!r} is not a LoRA A/B matrix of a decoder layer's "
                        f"projection (supported: {', '.join(TARGETS)})"
                    )
                layer = int(m["layer"])
                if layer >= model_config.num_hidden_layers:
                    raise LoRAError(
                        f"adapter {name!r}: tensor {tname!r} is for layer {layer}; the model has "
                        f"{model_config.num_hidden_layers}"
                    )
                t = f.get_tensor(tname)
                digest.update(tname.encode() + b"\0" + str(tuple(t.shape)).encode() + str(t.dtype).encode())
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
                found.setdefault((layer, m["module"]), {})[m["ab"]] = t
    except SafetensorError as e:
        raise LoRAError(f"adapter {name!r}: {weights}: {e}") from None
    if not found:
        raise LoRAError(f"adapter {name!r}: {weights} holds no LoRA matrices")
    scaling = cfg.get("lora_alpha", rank) / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    layers: list[dict[str, list[Part]]] = [{} for _ in range(model_config.num_hidden_layers)]
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        fin, fout, first = shapes[module]
        if tuple(a.shape) != (rank, fin) or tuple(b.shape) != (fout, rank):
            raise LoRAError(
                f"adapter {name!r}: layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)}; this model "
                f"with rank {rank} needs A {(rank, fin)} and B {(fout, rank)} (an adapter of another model?)"
            )
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} holds non-finite values")
        fused, _ = TARGETS[module]
        part = Part(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), slice(first, first + fout))
        layers[layer].setdefault(fused, []).append(part)
    return LoRAAdapter(name, path, rank, float(scaling), digest.hexdigest(), layers)


class LoRABatch:
    """The adapters of one step's rows: (adapter, row indices or None for every row) groups."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor | None]]):
        self.groups = groups

    def add(self, layer: int, product: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each group's adapter delta on its rows, in place, as
        PEFT computes it: base + (x A^T) B^T * scaling."""
        for adapter, rows in self.groups:
            parts = adapter.layers[layer].get(product)
            if not parts:
                continue
            xs = x if rows is None else x.index_select(0, rows)
            for p in parts:
                delta = F.linear(F.linear(xs, p.a), p.b) * adapter.scaling
                out = y[:, p.out_slice]
                if rows is None:
                    out.add_(delta)
                else:
                    out.index_add_(0, rows, delta)
        return y


class LoRAManager:
    """The adapters an engine holds, by key and by name (the newest of a name), at most
    max_cpu_loras: past that, loading one unloads the least recently loaded adapter that no
    request uses and that was not given at start (--lora-modules), as vLLM's LRU cache does."""

    def __init__(self, model_config: ModelConfig, lora_config, dtype: torch.dtype, device="cpu"):
        self.model_config = model_config
        self.config = lora_config
        self.dtype, self.device = dtype, device
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # oldest first
        self.by_name: dict[str, str] = {}
        self.pinned: set[str] = set()  # the start-up adapters' keys: never unloaded
        self._lock = threading.Lock()  # loads come from the offline API's and the engine's threads

    def load(self, name: str, path: str, in_use=(), pin: bool = False) -> LoRAAdapter:
        """Load (or find already loaded) the adapter `name` from `path`; it becomes the name's
        adapter. `in_use`: keys that requests hold (never unloaded to make room)."""
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.device)
        with self._lock:
            if adapter.key not in self.adapters:
                if len(self.adapters) >= self.config.max_cpu_loras:
                    self._evict(name, set(in_use))
                self.adapters[adapter.key] = adapter
            self.adapters.move_to_end(adapter.key)
            self.by_name[name] = adapter.key
            if pin:
                self.pinned.add(adapter.key)
            return self.adapters[adapter.key]

    def _evict(self, name: str, in_use: set[str]) -> None:
        for key in self.adapters:
            if key not in in_use and key not in self.pinned:
                del self.adapters[key]
                self.by_name = {n: k for n, k in self.by_name.items() if k != key}
                return
        raise LoRAError(
            f"cannot load adapter {name!r}: the {len(self.adapters)} adapters loaded (--max-cpu-loras "
            f"{self.config.max_cpu_loras}) are all in use or given at start"
        )

    def names(self) -> dict[str, str]:
        """Adapter name -> key of the adapters requests may name."""
        return dict(self.by_name)

    def batch(self, row_keys: list[tuple[str | None, int, int]]) -> LoRABatch | None:
        """The step's groups from (key or None, first row, end row) spans; None when no row has an adapter."""
        spans: dict[str, list[range]] = {}
        total = 0
        for key, first, end in row_keys:
            total = max(total, end)
            if key is not None:
                spans.setdefault(key, []).append(range(first, end))
        if not spans:
            return None
        groups = []
        for key, ranges in spans.items():
            rows = [i for r in ranges for i in r]
            idx = None if len(rows) == total else torch.tensor(rows, dtype=torch.long, device=self.device)
            groups.append((self.adapters[key], idx))
        return LoRABatch(groups)
