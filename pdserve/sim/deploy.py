"""From flags to a `ClusterConfig`: latency model, KV pool size and scheduler per pool.

Roofline pools take the model and accelerator from the planner's catalogs and
size the KV pool the planner's way (memory left after the weights, at the
GPU memory utilisation, over KV bytes per token per GPU). Profile pools take
the measured engine's pool unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.config import SchedulerConfig
from pdserve.planner.hardware import resolve_gpu
from pdserve.planner.memory import free_kv_bytes_per_gpu, kv_bytes_per_token_per_gpu
from pdserve.planner.models import resolve_model
from pdserve.router.admission import AdmissionConfig
from pdserve.sim.cluster import ClusterConfig, PoolConfig
from pdserve.sim.latency import LatencyModel, ProfileLatency, TransferModel, network_bytes_per_s, roofline_for


@dataclass
class Hardware:
    """Where the latency of a pool comes from: a profile, or the roofline of model x GPU x TP."""

    model: str = "llama-3-70b"
    gpu: str = "h100"
    dtype: str = "bfloat16"
    kv_dtype: str = "bfloat16"
    efficiency: tuple[float, float] | None = None
    overhead_s: float = 0.0
    profile: ProfileLatency | None = None
    num_blocks: int | None = None  # per instance; None: from memory (roofline) or the profile
    # disagg: the decode pool's own profile (a worker timed in its role: `--from-trace`), else `profile`
    decode_profile: ProfileLatency | None = None

    def pool(self, count: int, tp: int, block_size: int, sched: SchedulerConfig) -> PoolConfig:
        if self.profile is not None:
            if tp != 1:
                raise ValueError("a profile is measured on one engine: TP must be 1")
            blocks = self.num_blocks or (self.profile.num_blocks * self.profile.block_size // block_size) or 4096
            return PoolConfig(count, self.profile, blocks, 1, sched)
        lat = roofline_for(
            resolve_model(self.model),
            resolve_gpu(self.gpu),
            tp,
            self.kv_dtype,
            self.dtype,
            self.efficiency,
            self.overhead_s,
        )
        free = free_kv_bytes_per_gpu(lat.dep)
        if free <= 0:
            raise ValueError(f"{self.model} does not fit on {tp} x {self.gpu}: no memory left for KV")
        blocks = self.num_blocks or int(free / kv_bytes_per_token_per_gpu(lat.dep) / block_size)
        return PoolConfig(count, lat, blocks, tp, sched)

    def latency(self, tp: int) -> LatencyModel:
        return self.pool(1, tp, 16, SchedulerConfig()).latency


@dataclass
class Layout:
    """How many instances of what: the thing `--search` varies."""

    mode: str
    instances: int = 1  # collocated / chunked
    tp: int = 1
    prefill: int = 1  # disagg
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1

    @property
    def gpus(self) -> int:
        if self.mode == "disagg":
            return self.prefill * self.prefill_tp + self.decode * self.decode_tp
        return self.instances * self.tp

    def label(self) -> str:
        if self.mode == "disagg":
            return f"{self.prefill}P(tp{self.prefill_tp})+{self.decode}D(tp{self.decode_tp})"
        return f"{self.instances}x{self.mode}(tp{self.tp})"


def build(
    layout: Layout,
    hw: Hardware,
    sched: SchedulerConfig,
    *,
    block_size: int = 16,
    enable_prefix_caching: bool = True,
    network_gbps: float = 400,
    kv_bytes_per_s: float | None = None,
    layerwise: bool = True,
    transfer_latency_s: float = 0.0,
    policy: str = "cache_aware",
    admission: AdmissionConfig | None = None,
    max_concurrency: int | None = None,
    tag_concurrency: dict[str, int] | None = None,
    client_rtt_s: float = 0.0,
) -> ClusterConfig:
    if layout.mode == "disagg":
        # a decode instance never prefills a long prompt: chunking changes nothing there
        pools = {
            "prefill": hw.pool(layout.prefill, layout.prefill_tp, block_size, sched),
            "decode": (replace(hw, profile=hw.decode_profile) if hw.decode_profile else hw).pool(
                layout.decode, layout.decode_tp, block_size, sched
            ),
        }
        # one NIC per GPU of the prefill instance, each sending its own KV shard
        transfer = TransferModel(
            kv_bytes_per_s or network_bytes_per_s(network_gbps),
            layerwise,
            links=1 if kv_bytes_per_s else layout.prefill_tp,
            latency_s=transfer_latency_s,
        )
    else:
        chunked = replace(sched, enable_chunked_prefill=layout.mode == "chunked")
        pools = {"both": hw.pool(layout.instances, layout.tp, block_size, chunked)}
        transfer = None
    return ClusterConfig(
        layout.mode,
        pools,
        block_size,
        enable_prefix_caching,
        transfer,
        policy,
        admission,
        max_concurrency,
        dict(tag_concurrency or {}),
        client_rtt_s,
    )
