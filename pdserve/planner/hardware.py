"""Accelerators and networks as data, each figure with its source.

FLOP/s are dense (datasheets often print the 2:4-sparsity figure, twice as
large). Memory capacity is in GiB because DRAM is built in powers of two (an
"80 GB" H100 has 80 GiB of HBM3); bandwidths are decimal bytes/s as quoted.
``intra_node_bytes_per_s`` is the datasheet's NVLink/HCCS/PCIe figure, which
sums both directions; collectives use half of it (one direction).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.config import canonical_dtype
from pdserve.planner.units import GB, TB, GiB, catalog_lookup


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float | None  # dense FLOP/s; None: no FP8 tensor path
    memory_bytes: float
    memory_bytes_per_s: float
    intra_node_bytes_per_s: float
    nic_gbps: float  # NIC line rate per accelerator, gigabits/s
    gpus_per_node: int
    source: str

    def peak_flops(self, dtype: str) -> float:
        dtype = canonical_dtype(dtype)
        if dtype in ("bfloat16", "float16"):
            return self.bf16_flops
        if dtype == "fp8":
            if self.fp8_flops is None:
                raise ValueError(f"{self.name} has no FP8 tensor cores; use --dtype bfloat16")
            return self.fp8_flops
        raise ValueError(f"unknown compute dtype {dtype!r}; use bfloat16 or fp8")


_HGX = "; NIC: one 400 Gb/s ConnectX-7 per GPU as in HGX/DGX 8-GPU nodes"
_PCIE = "; PCIe Gen4 x16 (64 GB/s both ways), no NVLink; NIC 100 Gb/s assumed (not in datasheet)"
GPUS: dict[str, Accelerator] = {
    g.name: g
    for g in (
        Accelerator(
            "h100-sxm",
            989e12,
            1979e12,
            80 * GiB,
            3.35 * TB,
            900 * GB,
            400,
            8,
            "NVIDIA H100 datasheet (SXM5): BF16 1,979 / FP8 3,958 TFLOPS with sparsity, "
            "halved; 80 GB HBM3 3.35 TB/s; NVLink 900 GB/s" + _HGX,
        ),
        Accelerator(
            "h800",
            989e12,
            1979e12,
            80 * GiB,
            3.35 * TB,
            400 * GB,
            400,
            8,
            "NVIDIA H800 SXM product brief: H100 SXM compute and HBM3, NVLink cut to 400 GB/s" + _HGX,
        ),
        Accelerator(
            "h20",
            148e12,
            296e12,
            96 * GiB,
            4.0 * TB,
            900 * GB,
            400,
            8,
            "NVIDIA HGX H20 spec sheet (2024): BF16 148 / FP8 296 TFLOPS dense; 96 GB "
            "HBM3 4.0 TB/s; NVLink 900 GB/s" + _HGX,
        ),
        Accelerator(
            "h200",
            989e12,
            1979e12,
            141 * GiB,
            4.8 * TB,
            900 * GB,
            400,
            8,
            "NVIDIA H200 datasheet (SXM): H100 SXM tensor cores; 141 GB HBM3e 4.8 TB/s; NVLink 900 GB/s" + _HGX,
        ),
        Accelerator(
            "a100-40gb",
            312e12,
            None,
            40 * GiB,
            1.555 * TB,
            600 * GB,
            200,
            8,
            "NVIDIA A100 datasheet (SXM4 40GB): BF16 312 TFLOPS dense, no FP8; HBM2 "
            "1,555 GB/s; NVLink 600 GB/s; NIC 200 Gb/s HDR per GPU as in DGX A100",
        ),
        Accelerator(
            "a100-80gb",
            312e12,
            None,
            80 * GiB,
            2.039 * TB,
            600 * GB,
            200,
            8,
            "NVIDIA A100 datasheet (SXM4 80GB): BF16 312 TFLOPS dense, no FP8; HBM2e "
            "2,039 GB/s; NVLink 600 GB/s; NIC 200 Gb/s HDR per GPU as in DGX A100",
        ),
        Accelerator(
            "l40s",
            362.05e12,
            733e12,
            48 * GiB,
            864 * GB,
            64 * GB,
            100,
            8,
            "NVIDIA L40S datasheet: BF16 362.05 / FP8 733 TFLOPS dense (twice that with "
            "sparsity); 48 GB GDDR6 864 GB/s" + _PCIE,
        ),
        Accelerator(
            "rtx-4090",
            165.2e12,
            330.3e12,
            24 * GiB,
            1008 * GB,
            64 * GB,
            100,
            8,
            "NVIDIA Ada Lovelace whitepaper, RTX 4090: BF16 165.2 / FP8 330.3 TFLOPS dense "
            "with FP32 accumulate; 24 GB GDDR6X 1,008 GB/s" + _PCIE,
        ),
        Accelerator(
            "l4",
            121e12,
            242.5e12,
            24 * GiB,
            300 * GB,
            64 * GB,
            100,
            8,
            "NVIDIA L4 datasheet: BF16 242 / FP8 485 TFLOPS with sparsity, halved; 24 GB GDDR6 300 GB/s" + _PCIE,
        ),
        Accelerator(
            "ascend-910b",
            313e12,
            None,
            64 * GiB,
            1.6 * TB,
            392 * GB,
            200,
            8,
            "Huawei Ascend 910B (910B3 class), public reports and Atlas 800T A2 spec, "
            "approximate: ~313 TFLOPS FP16/BF16 dense, no FP8; 64 GB HBM2e ~1.6 TB/s; "
            "HCCS 7 x 56 GB/s = 392 GB/s; 200 Gb/s RoCE per NPU",
        ),
        Accelerator(
            "cpu-local",
            960e9,
            None,
            24 * GiB,
            38 * GB,
            24.5 * GB,
            33.6,
            1,
            "this machine, measured 2026-11-29: 2 cores AVX-512, bf16 matmul ~960 GFLOP/s; "
            "memory read ~38 GB/s with 2 threads, 24 GiB; "
            "'intra-node' = shared-memory copy 24.5 GB/s, 'NIC' = loopback TCP ~4.2 GB/s",
        ),
    )
}

GPU_ALIASES = {
    "h100": "h100-sxm",
    "h100-80gb": "h100-sxm",
    "h200-sxm": "h200",
    "h800-sxm": "h800",
    "a100": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "4090": "rtx-4090",
    "910b": "ascend-910b",
    "cpu": "cpu-local",
}

# Effective bytes/s a KV transfer sees on a NIC of the given line rate.
NETWORK_BYTES_PER_S: dict[int, float] = {
    100: 11 * GB,  # a common datacenter 100 Gb/s RoCE link moves about 11 GB/s
    200: 22.5 * GB,  # 90% of line rate, the 400 Gb/s efficiency below
    400: 45 * GB,  # 400 Gb/s RoCE / InfiniBand: about 45 GB/s of 50 on the wire
}

# Floor latency of one all-reduce in the roofline: NVLink takes 5-8 us, IB/RoCE
# between nodes 30-50 us; 6 us and 40 us are the usual figures to compute with.
ALLREDUCE_LATENCY_INTRA_NODE_S = 6e-6
ALLREDUCE_LATENCY_INTER_NODE_S = 40e-6


def resolve_gpu(name: str) -> Accelerator:
    """A catalog accelerator by name or alias (case and dashes ignored)."""
    found = catalog_lookup(name, GPUS, GPU_ALIASES)
    if found is not None:
        return found
    raise ValueError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)} (aliases: {', '.join(GPU_ALIASES)})")
