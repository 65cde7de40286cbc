"""How long one engine iteration takes: the planner's fitted model, its roofline, or a profile.

An iteration is described by a `StepShape`: what the scheduler put in the
batch. Every model answers `step_s(shape)`; the simulator needs nothing else.

- `FittedLatency` (the default for a catalog GPU): the planner's step-time
  model (pdserve/planner/perf.py) -- per-operator efficiencies and launches,
  all-reduces and per-step CPU work fitted on operator profiles. The planner
  prints the same numbers: one model, two users.
- `RooflineLatency`: the planner's roofline (pdserve/planner/roofline.py), the
  lower bound, with optional efficiency factors and a fixed per-step overhead;
  used when efficiencies are given, and for this machine's CPU.
- `ProfileLatency`: t = a + b*prefill_tokens + c*decode_seqs + d*decode_context
  + e*prefill_attention (+ f for a step with prompt tokens, + g per pass over
  the weights of a small decode batch), least squares over steps of our engine
  measured on this machine (`pdserve sim --calibrate`, see calibrate.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np

from pdserve.costmodel import nonnegative_lstsq
from pdserve.planner import perf
from pdserve.planner.deployment import Deployment
from pdserve.planner.memory import kv_bytes_per_token, kv_shards
from pdserve.planner.models import ModelShape, param_count
from pdserve.planner.roofline import pp_hop_time_s, tp_comm_time_s, weight_bytes_read
from pdserve.planner.transfer import exposed_transfer_s
from pdserve.planner.transfer import network_bytes_per_s as _link_bytes_per_s


@dataclass
class StepShape:
    """One scheduled batch. `prefill_attention` counts causal query-key pairs of the
    prompt chunks: sum of n * (context_before + (n + 1) / 2) over chunks of n tokens."""

    prefill_tokens: int = 0
    prefill_seqs: int = 0
    prefill_attention: float = 0.0
    decode_seqs: int = 0
    decode_context: int = 0  # tokens already cached, summed over the decoding sequences
    prefill_context: int = 0  # tokens cached before each prompt chunk, summed (read, not recomputed)
    prefill_cached_pairs: float = 0.0  # the pairs of `prefill_attention` against those cached tokens

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_seqs

    def add(self, done: int, n: int, decode: bool) -> None:
        """Count one sequence's share of the step: `n` new tokens after `done` cached ones."""
        if decode:
            self.decode_seqs += 1
            self.decode_context += done
        else:
            self.prefill_tokens += n
            self.prefill_seqs += 1
            self.prefill_context += done
            self.prefill_attention += chunk_attention(done, n)
            self.prefill_cached_pairs += float(n * done)

    def features(self) -> list[float]:
        return [
            1.0,
            float(self.prefill_tokens),
            float(self.decode_seqs),
            float(self.decode_context),
            float(self.prefill_attention),
            1.0 if self.prefill_tokens else 0.0,
        ]


def chunk_attention(ctx_before: int, n: int) -> float:
    """Causal query-key pairs when n new tokens attend to ctx_before cached ones and to each other."""
    return n * (ctx_before + (n + 1) / 2.0)


# Roofline derating where no fitted model applies: (compute, bandwidth) shares of peak.
# cpu-local: our engine on this machine reaches about 1/3 of the matmul peak, attention less.
DEFAULT_EFFICIENCY = (0.55, 0.8)
EFFICIENCY: dict[str, tuple[float, float]] = {"cpu-local": (0.35, 0.5)}


class LatencyModel:
    """What the simulator asks of a latency model (a Protocol in spirit)."""

    name = "latency"

    def step_s(self, shape: StepShape) -> float:
        raise NotImplementedError

    def decode_steps_s(self, batch: int, context0: int, k: int) -> np.ndarray:
        """k pure-decode steps of `batch` sequences, the context growing by `batch` a step."""
        return np.array(
            [self.step_s(StepShape(decode_seqs=batch, decode_context=context0 + i * batch)) for i in range(k)]
        )

    def layers(self) -> int:
        """Layers the KV is sent in (layer-wise transfer overlaps one layer with the next)."""
        raise NotImplementedError

    def kv_bytes_per_token(self) -> float:
        raise NotImplementedError


class RooflineLatency(LatencyModel):
    """max(FLOPs / (TP x peak), bytes per GPU / bandwidth) + TP all-reduces + PP hops + overhead."""

    def __init__(self, dep: Deployment, overhead_s: float = 0.0):
        self.dep = dep
        self.overhead_s = overhead_s
        m = dep.model
        self.name = f"roofline {m.name} on {dep.gpu.name} tp={dep.tp}"
        self._linear_flops = 2.0 * param_count(m, active=True)
        self._attn_flops = 2.0 * m.layers * m.heads * (m.qk_dim + m.v_dim)  # per query-key pair
        self._kv_bytes = kv_bytes_per_token(m, dep.kv_bytes_per_element) / kv_shards(m, dep.tp)
        self._peak = dep.peak_flops * dep.tp
        self._bw = dep.memory_bytes_per_s
        self._weights: dict[int, float] = {}
        self._comm: dict[int, float] = {}

    def step_s(self, s: StepShape) -> float:
        tokens = s.prefill_tokens + s.decode_seqs
        if tokens == 0:
            return 0.0
        w = self._weights.get(tokens)
        if w is None:  # memoised: an MoE's weight read depends on the token count
            w = self._weights[tokens] = (
                weight_bytes_read(self.dep.model, tokens, self.dep.weight_bytes_per_param) / self.dep.tp
            )
            self._comm[tokens] = tp_comm_time_s(self.dep, tokens) + pp_hop_time_s(self.dep, tokens)
        flops = self._linear_flops * tokens + self._attn_flops * (s.prefill_attention + s.decode_context)
        # KV read for decode context and for prompt chunks' earlier context; KV written for new tokens
        kv_tokens = s.decode_context + s.prefill_context + tokens
        bytes_ = w + self._kv_bytes * kv_tokens
        return max(flops / self._peak, bytes_ / self._bw) + self._comm[tokens] + self.overhead_s

    def decode_steps_s(self, batch: int, context0: int, k: int) -> np.ndarray:
        self.step_s(StepShape(decode_seqs=batch))  # fills the per-token-count memo
        ctx = context0 + batch * np.arange(k, dtype=np.float64)
        flops = self._linear_flops * batch + self._attn_flops * ctx
        bytes_ = self._weights[batch] + self._kv_bytes * (ctx + batch)
        return np.maximum(flops / self._peak, bytes_ / self._bw) + (self._comm[batch] + self.overhead_s)

    def layers(self) -> int:
        return self.dep.model.layers

    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.dep.model, self.dep.kv_bytes_per_element)


class FittedLatency(LatencyModel):
    """The planner's fitted step time (perf.step_time) for a mixed batch, plus an optional overhead."""

    def __init__(self, dep: Deployment, overhead_s: float = 0.0):
        self.dep = dep
        self.overhead_s = overhead_s
        kind, _ = perf.fit_for(dep.gpu.name)
        m = dep.model
        self.name = f"fitted ({kind} profiles) {m.name} on {dep.gpu.name} tp={dep.tp}"
        self._rates = perf.attention_rates(dep)
        self._base: dict[tuple[int, int, int], perf.StepCost] = {}

    def step_s(self, s: StepShape) -> float:
        if s.prefill_tokens + s.decode_seqs == 0:
            return 0.0
        key = (s.prefill_tokens, s.decode_seqs, s.prefill_seqs)
        base = self._base.get(key)
        if base is None:  # memoised: all but the context-dependent attention terms
            base = self._base[key] = perf.step_time(self.dep, s.prefill_tokens, 0.0, s.decode_seqs, 0.0, s.prefill_seqs)
        r = self._rates
        kv_read = s.decode_context + s.prefill_context
        cached = min(s.prefill_cached_pairs, s.prefill_attention)
        attn = (
            (r.kv_fixed_s if kv_read and not s.decode_seqs else 0.0)
            + r.causal_pair_s * (s.prefill_attention - cached)
            + r.cached_pair_s * cached
            + r.kv_token_s * kv_read
        )
        # attention is GPU work: it adds to the GPU side of the step's host/GPU overlap
        return base.overhead_s + max(base.gpu_s + attn, base.launch_s) + base.pp_s + self.overhead_s

    def decode_steps_s(self, batch: int, context0: int, k: int) -> np.ndarray:
        # only the KV read grows with the context, linearly, on the GPU side of the overlap
        base = self.step_s(StepShape(decode_seqs=batch, decode_context=context0))  # memoises the step
        c = self._base[(0, batch, 0)]
        gpu = c.gpu_s + self._rates.kv_token_s * (context0 + batch * np.arange(k, dtype=np.float64))
        return np.maximum(gpu, c.launch_s) + (base - max(c.gpu_s + self._rates.kv_token_s * context0, c.launch_s))

    def layers(self) -> int:
        return self.dep.model.layers

    def kv_bytes_per_token(self) -> float:
        return kv_bytes_per_token(self.dep.model, self.dep.kv_bytes_per_element)


FEATURES = (
    "a_s",
    "b_s_per_prefill_token",
    "c_s_per_decode_seq",
    "d_s_per_context_token",
    "e_s_per_attention_pair",
    "f_s_per_prefill_step",
    "g_s_per_weight_pass",
    "h_s_per_dense_step",
)
# f: a step with any prompt tokens takes another code path than a decode-only one (our CPU
# engine: the layer-by-layer Python path instead of one C++ call per layer). With one intercept
# for both, a 32-token prompt was predicted at 131 ms against 234 ms measured, and a prefill
# worker's stream of short prompts ran 3x slower than the simulator said. Profiles written
# before it have five terms (f = 0).
# g and h: how the matmuls read the weights, by the rows of the step (prompt tokens plus
# decoding sequences). Up to `tile_max_rows` rows, our GGUF kernels stream the quantized
# weights once per tile of `row_tile` rows (csrc/gguf_matmul.cpp, engine/model.py Linear):
# g per pass, ceil(rows / row_tile), a staircase (one core: 4 -> 5 decoding sequences went
# 40 -> 55 ms while 3 -> 4 went 31 -> 40). Beyond that they multiply the fp32 weights: h, once
# per step. A prefill worker's 8-token prompts take the first way (81 ms on one core) and its
# 32-token ones the second (250 ms): with one f for both, a fit that saw both priced the chats'
# 64-token prompts 15% low. row_tile 0 (the default, and older profiles) drops g and h.


FIT_ROUNDS = 4  # the first weighs rows by 1/measured, the rest by 1/predicted
# A step that took more than this many times its fit was slowed by something else (another
# process on a busy machine, a page fault storm): such steps once priced every prefill 0.45 s
# high. The slowest of those, up to MAX_SLOW_SHARE of the steps, are left out and the rest
# refitted; a busier machine than that is reported, not papered over.
SLOW_OUTLIER = 2.0
MAX_SLOW_SHARE = 0.1


def _fit_relative(x0: np.ndarray, y0: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative least squares on relative error, iteratively reweighted by 1/predicted;
    each round leaves out the slow outliers of the last (see SLOW_OUTLIER: weighed by
    1/predicted, a step 20x its fit would otherwise pull hardest of all). Returns the
    coefficients and which rows they were fitted on."""
    n = len(y0)
    keep = np.ones(n, dtype=bool)
    scale = y0
    coef = nonnegative_lstsq(x0 / scale[:, None], y0 / scale)
    for _ in range(FIT_ROUNDS):
        pred = x0 @ coef
        if not np.all(pred > 0):
            break
        ratio = y0 / pred
        slow = np.argsort(-ratio)[: int(MAX_SLOW_SHARE * n)]
        keep = np.ones(n, dtype=bool)
        keep[slow[ratio[slow] > SLOW_OUTLIER]] = False
        scale = pred
        coef = nonnegative_lstsq(x0[keep] / scale[keep, None], y0[keep] / scale[keep])
    return coef, keep


@dataclass
class ProfileLatency(LatencyModel):
    """A per-iteration time fitted to measured steps of our engine (`pdserve sim --calibrate`)."""

    coef: list[float]
    model_layers: int = 30
    kv_bytes_per_token_: float = 0.0
    threads: int = 0
    source: str = ""
    samples: list[dict] = field(default_factory=list)  # what was measured, kept with the fit
    num_blocks: int = 0  # the measured engine's KV pool, a default for simulated instances
    num_slow_dropped: int = 0  # steps left out of the fit for running > SLOW_OUTLIER x their fit
    block_size: int = 16
    row_tile: int = 0  # g's staircase (see FEATURES); 0: no such term
    tile_max_rows: int = 0
    # served profiles: the client <-> engine round trip measured with them (ClusterConfig.client_rtt_s)
    request_rtt_s: float = 0.0

    def __post_init__(self):
        if 5 <= len(self.coef) < len(FEATURES):  # older profiles: the later terms are 0
            self.coef = list(self.coef) + [0.0] * (len(FEATURES) - len(self.coef))
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"a profile has {len(FEATURES)} coefficients ({', '.join(FEATURES)})")
        self.name = f"profile ({self.source or 'fitted'}, threads={self.threads})"
        self._c = [float(c) for c in self.coef]

    def step_s(self, s: StepShape) -> float:
        if s.prefill_tokens + s.decode_seqs == 0:
            return 0.0
        a, b, c, d, e, f, g, h = self._c
        rows = s.prefill_tokens + s.decode_seqs
        return (
            a
            + b * s.prefill_tokens
            + c * s.decode_seqs
            + d * s.decode_context
            + e * s.prefill_attention
            + (f if s.prefill_tokens else 0.0)
            + g * self.weight_passes(rows)
            + h * self.dense(rows)
        )

    def decode_steps_s(self, batch: int, context0: int, k: int) -> np.ndarray:
        a, _, c, d, _, _, g, h = self._c
        return (
            a
            + c * batch
            + g * self.weight_passes(batch)
            + h * self.dense(batch)
            + d * (context0 + batch * np.arange(k, dtype=np.float64))
        )

    def weight_passes(self, rows: int) -> int:
        """Passes of the tiled kernels over the weights in a step of `rows` rows (g's count)."""
        if not self.row_tile or rows > self.tile_max_rows:
            return 0
        return -(-rows // self.row_tile)

    def dense(self, rows: int) -> int:
        """1 when a step of `rows` rows multiplies the dense weights instead (h's count)."""
        return int(bool(self.row_tile) and rows > self.tile_max_rows)

    def features(self, s: StepShape) -> list[float]:
        rows = s.prefill_tokens + s.decode_seqs
        return s.features() + [float(self.weight_passes(rows)), float(self.dense(rows))]

    def layers(self) -> int:
        return self.model_layers

    def kv_bytes_per_token(self) -> float:
        return self.kv_bytes_per_token_

    @classmethod
    def fit(cls, samples: list[tuple[StepShape, float]], **kw) -> ProfileLatency:
        """Least squares on relative error, every coefficient >= 0: a term fitted negative (noise
        over a short range) is dropped and the rest refitted, so a longer batch is never
        predicted faster.

        Rows are weighted by 1/predicted, refitted a few times (iteratively reweighted): weighting
        by 1/measured instead favours the steps that ran fast, and on a machine whose steps
        vary by +-10% that priced served steps 6% low on average.

        Steps that ran more than SLOW_OUTLIER times their fit (at most the slowest
        MAX_SLOW_SHARE of them) are then left out and the rest refitted: noise on a shared
        machine only ever slows a step, and least squares follows a few such steps far."""
        shape = cls(
            coef=[0.0] * len(FEATURES), row_tile=kw.get("row_tile", 0), tile_max_rows=kw.get("tile_max_rows", 0)
        )
        x0 = np.array([shape.features(s) for s, _ in samples])
        y0 = np.array([t for _, t in samples])
        coef, keep = _fit_relative(x0, y0)
        rows = [{**asdict(s), "measured_s": t} for s, t in samples]
        return cls(coef=coef.tolist(), samples=rows, num_slow_dropped=int((~keep).sum()), **kw)

    def save(self, path: str) -> None:
        d = {
            "kind": "pdserve-sim-profile",
            "features": list(FEATURES),
            "coef": self._c,
            "model_layers": self.model_layers,
            "kv_bytes_per_token": self.kv_bytes_per_token_,
            "threads": self.threads,
            "source": self.source,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "row_tile": self.row_tile,
            "tile_max_rows": self.tile_max_rows,
            "request_rtt_s": self.request_rtt_s,
            "samples": self.samples,
        }
        with open(path, "w") as f:
            json.dump(d, f, indent=1)

    @classmethod
    def load(cls, path: str) -> ProfileLatency:
        with open(path) as f:
            d = json.load(f)
        if d.get("kind") != "pdserve-sim-profile":
            raise ValueError(f"{path}: not a profile written by `pdserve sim --calibrate`")
        return cls(
            coef=d["coef"],
            model_layers=d["model_layers"],
            kv_bytes_per_token_=d["kv_bytes_per_token"],
            threads=d.get("threads", 0),
            source=d.get("source", path),
            samples=d.get("samples", []),
            num_blocks=d.get("num_blocks", 0),
            block_size=d.get("block_size", 16),
            row_tile=d.get("row_tile", 0),
            tile_max_rows=d.get("tile_max_rows", 0),
            request_rtt_s=d.get("request_rtt_s", 0.0),
        )


def roofline_for(
    model: ModelShape,
    gpu,
    tp: int = 1,
    kv_dtype: str = "bf16",
    dtype: str = "bf16",
    efficiency: tuple[float, float] | None = None,
    overhead_s: float = 0.0,
) -> FittedLatency | RooflineLatency:
    """The latency model of one instance: the fitted model by default; the roofline
    derated by `efficiency` when one is given ((1, 1): the pure lower bound), and for
    accelerators the fitted model does not describe."""
    if efficiency is None and perf.has_fit(gpu.name):
        return FittedLatency(Deployment(model, gpu, tp=tp, dtype=dtype, kv_dtype=kv_dtype), overhead_s)
    ce, be = efficiency or EFFICIENCY.get(gpu.name, DEFAULT_EFFICIENCY)
    dep = Deployment(
        model,
        gpu,
        tp=tp,
        dtype=dtype,
        kv_dtype=kv_dtype,
        compute_efficiency=ce,
        bandwidth_efficiency=be,
        latency_model="roofline",
    )
    return RooflineLatency(dep, overhead_s)


def network_bytes_per_s(gbps: float) -> float:
    """Effective bytes/s of a link: the planner's figures for 100/200/400 Gbps, else 90% of line rate."""
    return _link_bytes_per_s(gbps)


@dataclass(frozen=True)
class TransferModel:
    """KV from a prefill to a decode instance: `links` NICs of `bytes_per_s`, eager or layer-wise."""

    bytes_per_s: float
    layerwise: bool = True
    links: int = 1
    latency_s: float = 0.0  # per transfer: connection, notification

    def exposed_s(self, kv_bytes: float, layers: int, prefill_s: float) -> tuple[float, float]:
        """(time the link is busy, time left on the critical path after the prefill ends)."""
        total = kv_bytes / (self.bytes_per_s * self.links)
        exposed = exposed_transfer_s(layers, total / layers, prefill_s / layers, self.layerwise)
        return total, exposed + self.latency_s
