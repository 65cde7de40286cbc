"""One serving instance: a model on ``tp x pp`` accelerators with chosen dtypes.

This is the input every cost function takes, so the planner, the simulator
and the router price the same deployment the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import canonical_dtype
from pdserve.planner.hardware import Accelerator
from pdserve.planner.models import ModelShape
from pdserve.planner.units import element_bytes

COMPUTE_DTYPES = ("bfloat16", "fp8")
WEIGHT_QUANTS = ("none", "int8", "fp8", "int4")
KV_DTYPES = ("bfloat16", "float16", "fp8", "int8", "int4")
LATENCY_MODELS = ("fitted", "roofline")
# Whose host-side costs the fitted model adds (fitted.ENGINES): "vidur", the
# per-step CPU work Vidur profiled; "vllm-2023", that plus the per-sequence and
# per-prefill costs of the vLLM Splitwise measured (fitted on its BLOOM runs);
# "vllm-2023-overlap", the same runs read with that eager engine's kernel-issue
# window overlapping the GPU (the fit data cannot tell the two readings apart).
ENGINES = ("vidur", "vllm-2023", "vllm-2023-overlap")

# vLLM's default --gpu-memory-utilization: the other 10% is left to
# activations, temporary buffers and the framework: a plan that fills memory
# with weights and KV to the last byte does not run.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9


def modelled_dtype(name: str) -> str:
    """A compute dtype as the planner names it: `--dtype auto` is bfloat16, which every
    catalog accelerator computes natively; `bf16` is spelt bfloat16."""
    name = canonical_dtype(name)
    return "bfloat16" if name == "auto" else name


@dataclass(frozen=True)
class Deployment:
    model: ModelShape
    gpu: Accelerator
    tp: int = 1
    pp: int = 1
    dtype: str = "bfloat16"  # compute and activation dtype ("auto": bfloat16, native on every catalog chip)
    weight_quant: str = "none"  # "none": weights stored in `dtype`
    kv_dtype: str = "bfloat16"
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    # Fractions of peak FLOP/s and bandwidth reached; 1.0 is the pure roofline.
    compute_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    # "fitted": per-operator efficiencies, launches, all-reduces and per-step CPU
    # work fitted on profiles (perf.py); "roofline": the pure lower bound.
    latency_model: str = "fitted"
    engine: str = "vidur"

    def __post_init__(self) -> None:
        # one spelling of each dtype (bf16 -> bfloat16), as the engine's --dtype has it
        object.__setattr__(self, "dtype", modelled_dtype(self.dtype))
        object.__setattr__(self, "kv_dtype", canonical_dtype(self.kv_dtype))
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={self.tp} pp={self.pp}")
        if self.pp > self.model.layers:
            raise ValueError(f"pp={self.pp} exceeds the model's {self.model.layers} layers")
        for value, allowed, what in (
            (self.latency_model, LATENCY_MODELS, "latency model"),
            (self.engine, ENGINES, "engine"),
            (self.dtype, COMPUTE_DTYPES, "dtype"),
            (self.weight_quant, WEIGHT_QUANTS, "weight quant"),
            (self.kv_dtype, KV_DTYPES, "kv dtype"),
        ):
            if value not in allowed:
                raise ValueError(f"unknown {what} {value!r}; choose from {', '.join(allowed)}")
        self.gpu.peak_flops(self.dtype)  # raises where the chip lacks the dtype
        for value, what in (
            (self.gpu_memory_utilization, "gpu memory utilization"),
            (self.compute_efficiency, "compute efficiency"),
            (self.bandwidth_efficiency, "bandwidth efficiency"),
        ):
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{what} must be in (0, 1], got {value}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def weight_bytes_per_param(self) -> float:
        return element_bytes(self.dtype if self.weight_quant == "none" else self.weight_quant)

    @property
    def kv_bytes_per_element(self) -> float:
        return element_bytes(self.kv_dtype)

    @property
    def peak_flops(self) -> float:
        """FLOP/s of one accelerator, after the efficiency factor."""
        return self.gpu.peak_flops(self.dtype) * self.compute_efficiency

    @property
    def memory_bytes_per_s(self) -> float:
        return self.gpu.memory_bytes_per_s * self.bandwidth_efficiency

    @property
    def crosses_node(self) -> bool:
        """TP beyond one node's NVLink domain: every all-reduce then crosses the NIC."""
        return self.tp > self.gpu.gpus_per_node
