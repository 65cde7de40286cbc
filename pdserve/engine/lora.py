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
MAX_STAMPS = 256  # adapter files remembered as read and unchanged (LoRAManager.read)
MAX_ADAPTER_FILE_BYTES = 8 << 30  # an adapter larger than this is not a low-rank one
PEFT_DEFAULT_ALPHA = 8  # LoraConfig's lora_alpha when a config leaves it out
MAX_SCALING = 1024.0  # |alpha / r| (or / sqrt(r)) past this is no trained adapter's
MAX_WEIGHT = 1e4  # |A|, |B| entries past this are no trained adapter's (they would overflow the activations)
_TENSOR_RE = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<module>\w+)"
    r"\.lora_(?P<ab>[AB])(?:\.[\w-]+)?\.weight$"
)
_NAME_RE = re.compile(rf"^[^\s=@]{{1,{MAX_ADAPTER_NAME_CHARS}}}$")


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
        raise LoRAError(f"adapter name {name!r}: 1 to {MAX_ADAPTER_NAME_CHARS} characters, without spaces, '=' or '@'")
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
class Product:
    """An adapter's matrices for one fused product of a layer (q/k/v, gate/up: several
    projections), stacked so that its delta is two matrix products whatever the parts: A^T
    (in x r_total: each part's A side by side) and B^T (r_total x the product's whole output:
    each part's B in its rows and its own output columns, zero elsewhere). `blocks`: those
    nonzero blocks of B^T, (first row, end row, first column, end column) each."""

    a_t: torch.Tensor
    b_t: torch.Tensor
    blocks: torch.Tensor | None = None
    _f32: tuple | None = None

    def float32(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(A^T, B^T, blocks) in float32 for the C++ decode layer (which computes in float32 in
        either dtype): the matrices themselves in float32 mode, a copy made once in bfloat16."""
        if self._f32 is None:
            blocks = self.blocks
            if blocks is None:
                blocks = torch.tensor([[0, self.b_t.shape[0], 0, self.b_t.shape[1]]], dtype=torch.long)
            self._f32 = (self.a_t.float().contiguous(), self.b_t.float().contiguous(), blocks)
        return self._f32


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int
    scaling: float
    fingerprint: str
    # per decoder layer: fused product name ("qkv", "o", "gate_up", "down") -> its matrices
    layers: list[dict[str, Product]]

    @property
    def key(self) -> str:
        return f"{self.name}@{self.fingerprint}"

    @property
    def nbytes(self) -> int:
        return sum(p.a_t.nbytes + p.b_t.nbytes for layer in self.layers for p in layer.values())


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
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoRAError(f"{cfg_path}: r must be a positive integer, not {r!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoRAError(f"{cfg_path}: lora_alpha must be a number, not {alpha!r}")
    return cfg


def load_adapter(
    name: str, path: str, model_config: ModelConfig, max_rank: int, dtype: torch.dtype, device="cpu"
) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for this model; LoRAError says what is wrong."""
    try:
        return _load_adapter(name, path, model_config, max_rank, dtype, device)
    except LoRAError:
        raise
    except Exception as e:  # a file that parses but holds something no check above foresaw
        raise LoRAError(f"adapter {name!r}: {path} could not be read: {type(e).__name__}: {e}") from None


def _load_adapter(name, path, model_config: ModelConfig, max_rank: int, dtype: torch.dtype, device) -> LoRAAdapter:
    from safetensors import SafetensorError, safe_open

    check_name(name)
    if not os.path.isdir(path):
        raise LoRAError(f"adapter {name!r}: {path} is not a directory")
    cfg = _read_config(path)
    rank, alpha = cfg["r"], cfg.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if rank > max_rank:
        raise LoRAError(f"adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    if not abs(scaling) <= MAX_SCALING:
        raise LoRAError(f"adapter {name!r}: lora_alpha {alpha} scales its product by {scaling:g}, over {MAX_SCALING}")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights):
        pickled = os.path.exists(os.path.join(path, "adapter_model.bin"))
        why = " (adapter_model.bin is a pickle, which pdserve never loads)" if pickled else ""
        raise LoRAError(f"adapter {name!r}: {path} has no adapter_model.safetensors{why}")
    if os.path.getsize(weights) > MAX_ADAPTER_FILE_BYTES:
        raise LoRAError(f"adapter {name!r}: {weights} is over {MAX_ADAPTER_FILE_BYTES >> 30} GiB")
    shapes = _part_shapes(model_config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    digest = hashlib.blake2b(digest_size=8)
    digest.update(json.dumps([rank, alpha, bool(cfg.get("use_rslora"))]).encode())
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
                fin, fout, _ = shapes[m["module"]]
                want = (rank, fin) if m["ab"] == "A" else (fout, rank)
                got = tuple(f.get_slice(tname).get_shape())  # before reading it: a huge shape stays unread
                if got != want:
                    raise LoRAError(
                        f"adapter {name!r}: tensor {tname!r} has shape {got}; this model with rank {rank} needs "
                        f"{want} (an adapter of another model?)"
                    )
                t = f.get_tensor(tname)
                if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise LoRAError(f"adapter {name!r}: tensor {tname!r} is {t.dtype}; float16, bfloat16 or float32")
                digest.update(tname.encode() + b"\0" + str(t.dtype).encode())
                digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
                found.setdefault((layer, m["module"]), {})[m["ab"]] = t
    except SafetensorError as e:
        raise LoRAError(f"adapter {name!r}: {weights}: {e}") from None
    if not found:
        raise LoRAError(f"adapter {name!r}: {weights} holds no LoRA matrices")
    parts: dict[tuple[int, str], list[tuple[torch.Tensor, torch.Tensor, slice]]] = {}
    for (layer, module), ab in sorted(found.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"].to(dtype), ab["B"].to(dtype)  # checked as they will be used
        for which, t in (("A", a), ("B", b)):
            if not torch.isfinite(t).all() or t.numel() and t.abs().max().item() > MAX_WEIGHT:
                raise LoRAError(
                    f"adapter {name!r}: layer {layer} {module} lora_{which} holds values that are not finite, or "
                    f"over {MAX_WEIGHT:g} in {dtype} (not a trained adapter's)"
                )
        _, fout, first = shapes[module]
        parts.setdefault((layer, TARGETS[module][0]), []).append((a, b, slice(first, first + fout)))
    widths = _product_widths(model_config)
    layers: list[dict[str, Product]] = [{} for _ in range(model_config.num_hidden_layers)]
    for (layer, product), ps in parts.items():
        a_t = torch.cat([a for a, _, _ in ps]).t()
        b_t = torch.zeros(a_t.shape[1], widths[product], dtype=a_t.dtype)
        at, blocks = 0, []
        for a, b, out in ps:
            b_t[at : at + a.shape[0], out] = b.t()
            blocks.append([at, at + a.shape[0], out.start, out.stop])
            at += a.shape[0]
        layers[layer][product] = Product(
            a_t.to(device=device, dtype=dtype).contiguous(),
            b_t.to(device=device, dtype=dtype).contiguous(),
            torch.tensor(blocks, dtype=torch.long),
        )
    return LoRAAdapter(name, path, rank, float(scaling), digest.hexdigest(), layers)


def _product_widths(cfg: ModelConfig) -> dict[str, int]:
    """Each fused product's output width (model.py's DecoderLayer): where its last part ends."""
    widths: dict[str, int] = {}
    for module, (_, fout, first) in _part_shapes(cfg).items():
        product = TARGETS[module][0]
        widths[product] = max(widths.get(product, 0), first + fout)
    return widths


def _file_stamps(path: str) -> tuple:
    out = []
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        try:
            st = os.stat(os.path.join(path, f))
            out += [st.st_size, st.st_mtime_ns]
        except OSError:
            out += [None, None]
    return tuple(out)


class LoRABatch:
    """The adapters of one step's rows: (adapter, row indices or None for every row) groups."""

    def __init__(self, groups: list[tuple[LoRAAdapter, torch.Tensor | None]]):
        self.groups = groups

    def add(self, layer: int, product: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base product of x) plus each group's adapter delta on its rows, in place:
        y + scaling * (x A^T) B^T, PEFT's sum, in two or three operations a group (each
        operation costs ~10 us on a CPU whatever its size: per projection, as PEFT runs it,
        a one-row decode step of SmolLM2 spent ~12 ms in them, stacked ~3 ms)."""
        for adapter, rows in self.groups:
            p = adapter.layers[layer].get(product)
            if p is None:
                continue
            if rows is None:
                y.addmm_(x @ p.a_t, p.b_t, alpha=adapter.scaling)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ p.a_t) @ p.b_t, alpha=adapter.scaling)
        return y

    def fused_args(self, layer: int) -> list[tuple]:
        """The groups as the C++ decode layer takes them (csrc/decode_layer.cpp, LoraGroup):
        (rows, scaling, [(A^T, B^T, blocks) in float32 of qkv, o, gate_up, down, None where absent])."""
        out = []
        for adapter, rows in self.groups:
            mats = [adapter.layers[layer].get(p) for p in ("qkv", "o", "gate_up", "down")]
            out.append((rows, adapter.scaling, [m.float32() if m is not None else None for m in mats]))
        return out


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
        self._stamps: dict[tuple, str] = {}  # (name, path, its files' sizes and times) -> key
        self._lock = threading.Lock()  # loads come from the offline API's and the engine's threads

    def load(self, name: str, path: str, in_use=(), pin: bool = False) -> LoRAAdapter:
        """Load (or find already loaded) the adapter `name` from `path`; it becomes the name's
        adapter. `in_use`: keys that requests hold (never unloaded to make room)."""
        return self.install(self.read(name, path), in_use, pin)

    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter in `path`, read and checked, not yet servable (`install`); any thread.
        Files read before, unchanged since (their size and modification time), are not read again."""
        stamp = (name, os.path.realpath(path), *_file_stamps(path))
        with self._lock:
            key = self._stamps.get(stamp)
            if key in self.adapters:
                return self.adapters[key]
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank, self.dtype, self.device)
        with self._lock:
            if len(self._stamps) >= MAX_STAMPS:
                self._stamps.clear()
            self._stamps[stamp] = adapter.key
        return adapter

    def install(self, adapter: LoRAAdapter, in_use=(), pin: bool = False) -> LoRAAdapter:
        """Make a read adapter the one its name serves (making room past max_cpu_loras)."""
        name = adapter.name
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

    def sources(self) -> list[tuple[str, str, str, bool]]:
        """(name, key, path, given at start) of each adapter a name serves."""
        with self._lock:
            return [(n, k, self.adapters[k].path, k in self.pinned) for n, k in self.by_name.items()]

    def remove(self, name: str, in_use=()) -> bool:
        """Requests may no longer name `name`; its weights go now unless requests still use them
        (then with the next eviction). False if no adapter has that name."""
        with self._lock:
            key = self.by_name.pop(name, None)
            if key is None:
                return False
            if key not in self.by_name.values():
                self.pinned.discard(key)
                if key not in in_use:
                    del self.adapters[key]
            return True

    def _evict(self, name: str, in_use: set[str]) -> None:
        for key in self.adapters:
            if key not in in_use and key not in self.pinned:
                del self.adapters[key]
                self.by_name = {n: k for n, k in self.by_name.items() if k != key}
                return
        raise LoRAError(
            f"cannot load adapter {name!r}: the {len(self.adapters)} adapters loaded (--max-cpu-loras "
            f"{self.config.max_cpu_loras}) are all in use, named by the same call or given at start"
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
