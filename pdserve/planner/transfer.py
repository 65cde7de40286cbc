"""KV transfer from a prefill instance to a decode instance: eager or layer-wise.

Eager sends the whole cache after the last layer, so all of it adds to TTFT.
Layer-wise sends layer i while layer i+1 computes; if a layer transfers faster
than a layer computes, only the last layer's transfer is left exposed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pdserve.planner.hardware import NETWORK_BYTES_PER_S
from pdserve.planner.units import GB, GiB

# Share of a link's line rate a bulk RDMA transfer reaches where the table has
# no measured figure (400 Gb/s = 50 GB/s on the wire gives about 45 GB/s).
LINE_RATE_EFFICIENCY = 0.9


def network_bytes_per_s(gbps: float) -> float:
    """Effective bytes/s of a link of ``gbps`` gigabits/s: the table's figure
    for 100, 200 and 400 Gb/s RDMA, else 90% of the line rate."""
    if gbps <= 0:
        raise ValueError(f"link speed must be > 0 Gb/s, got {gbps:g}")
    if gbps in NETWORK_BYTES_PER_S:
        return NETWORK_BYTES_PER_S[int(gbps)]
    return gbps * 1e9 / 8 * LINE_RATE_EFFICIENCY


def link(gbps: float | None = None, gbytes: float | None = None, binary: bool = False) -> tuple[str, float]:
    """(label, effective bytes/s) of a P->D link given in Gb/s or in GB/s.

    ``binary`` reads the resulting "GB/s" as GiB/s: hand calculations divide a
    KV size in GiB by a rate in "GB/s" as if both were binary, so 10 GiB over
    "11 GB/s" is 909 ms there and 976 ms with the decimal 11e9 B/s."""
    if (gbps is None) == (gbytes is None):
        raise ValueError("give a link in Gb/s or in GB/s")
    if gbytes is not None:
        if gbytes <= 0:
            raise ValueError(f"link bandwidth must be > 0 GB/s, got {gbytes:g}")
        rate, label = gbytes * GB, f"{gbytes:g}GB/s"
    else:
        rate, label = network_bytes_per_s(gbps), f"{gbps:g}"
    return label, (rate / GB * GiB if binary else rate)


DEFAULT_LINKS = tuple(link(g) for g in sorted(NETWORK_BYTES_PER_S))


def transfer_time_s(bytes_: float, bytes_per_s: float, links: int = 1) -> float:
    """T_transfer = Bytes_KV / B_net. ``links`` NICs in parallel, e.g. one per
    TP rank each sending its own KV shard."""
    return bytes_ / (bytes_per_s * links)


def exposed_transfer_s(layers: int, per_layer_transfer_s: float, per_layer_compute_s: float, layerwise: bool) -> float:
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
    network: str
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


def kv_transfer(kv_bytes: float, layers: int, prefill_s: float, net: tuple[str, float], links: int = 1) -> KVTransfer:
    """Eager and layer-wise exposure of one request's KV over one link ``net``
    = (label, bytes/s), as ``link`` returns it."""
    label, bw = net
    total = transfer_time_s(kv_bytes, bw, links)
    per_layer, compute = total / layers, prefill_s / layers
    return KVTransfer(
        label,
        bw * links,
        kv_bytes,
        total,
        per_layer,
        compute,
        exposed_transfer_s(layers, per_layer, compute, layerwise=False),
        exposed_transfer_s(layers, per_layer, compute, layerwise=True),
    )
