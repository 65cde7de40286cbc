"""KV transfer from a prefill instance to a decode instance: eager or layer-wise.

Eager sends the whole cache after the last layer, so all of it adds to TTFT.
Layer-wise sends layer i while layer i+1 computes (seed 000 §3.2, §3.3); if a
layer transfers faster than a layer computes, only the last layer's transfer
is left exposed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.planner.hardware import NETWORK_BYTES_PER_S


def network_bytes_per_s(gbps: int) -> float:
    """Effective bytes/s of a 100, 200 or 400 Gbps RDMA network."""
    try:
        return NETWORK_BYTES_PER_S[gbps]
    except KeyError:
        known = ", ".join(str(g) for g in NETWORK_BYTES_PER_S)
        raise ValueError(f"unknown network {gbps} Gbps; known: {known}") from None


def transfer_time_s(bytes_: float, bytes_per_s: float, links: int = 1) -> float:
    """T_transfer = Bytes_KV / B_net (seed 000 §3.1 step 4). ``links`` NICs in
    parallel, e.g. one per TP rank each sending its own KV shard."""
    return bytes_ / (bytes_per_s * links)


def exposed_transfer_s(layers: int, per_layer_transfer_s: float,
                       per_layer_compute_s: float, layerwise: bool) -> float:
    """Transfer time left on the critical path after the prefill ends.

    Layer i's transfer starts when layer i is computed and the link is free.
    If a transfer is no longer than a layer's compute, every transfer hides
    under the next layer and only the last one shows. If it is longer, the
    link falls behind by (t_x - t_c) per layer.
    """
    if not layerwise:
        return layers * per_layer_transfer_s
    lag = max(0.0, per_layer_transfer_s - per_layer_compute_s)
    return per_layer_transfer_s + (layers - 1) * lag


@dataclass(frozen=True)
class KVTransfer:
    network_gbps: int
    bytes_per_s: float
    kv_bytes: float
    total_s: float
    per_layer_s: float
    per_layer_compute_s: float
    eager_exposed_s: float
    layerwise_exposed_s: float

    @property
    def hidden(self) -> bool:
        """Layer-wise transfer hides under compute (all but the last layer)."""
        return self.per_layer_s <= self.per_layer_compute_s

    def to_dict(self) -> dict:
        return {**asdict(self), "hidden": self.hidden}


def kv_transfer(kv_bytes: float, layers: int, prefill_s: float, network_gbps: int,
                links: int = 1) -> KVTransfer:
    """Eager and layer-wise exposure of one request's KV on one network."""
    bw = network_bytes_per_s(network_gbps)
    total = transfer_time_s(kv_bytes, bw, links)
    per_layer, compute = total / layers, prefill_s / layers
    return KVTransfer(network_gbps, bw * links, kv_bytes, total, per_layer, compute,
                      exposed_transfer_s(layers, per_layer, compute, layerwise=False),
                      exposed_transfer_s(layers, per_layer, compute, layerwise=True))
