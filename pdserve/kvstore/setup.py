"""Build a worker's KV store from its configuration."""

from __future__ import annotations

import hashlib

import torch

from pdserve.auth import load_cluster_secret
from pdserve.kvstore import codec
from pdserve.kvstore.disk import DiskTier
from pdserve.kvstore.host import HostTier
from pdserve.kvstore.store import TieredKVStore


def weights_digest(model: torch.nn.Module) -> str:
    """A short digest of the weights (a sample of every parameter): two workers share KV
    blocks only if they run the same weights."""
    h = hashlib.blake2b(digest_size=8)
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = p.detach().reshape(-1)[:1024].float().cpu()
        h.update(name.encode())
        h.update(flat.numpy().tobytes())
    return h.hexdigest()


def build_kv_store(config, model_config, runner, secret: bytes | None = None) -> TieredKVStore:
    """`secret`: the cluster secret that signs blocks in the shared store (default: the one
    `pdserve.auth` finds, as every process of a deployment does)."""
    t = config.tiers
    # KV bytes depend on the weights, dtype and the kernels that computed them
    digest = f"{weights_digest(runner.model)}-q{runner.num_quantized_linears}-i8{int(config.int8_activations)}"
    fingerprint = codec.model_fingerprint(model_config, config.device.dtype, config.cache.block_size, digest)
    tiers = []
    disk = DiskTier(t.kv_disk_dir, t.kv_disk_bytes) if t.kv_disk_dir else None
    if t.kv_offload_bytes:
        spill = None
        if disk is not None:

            def spill(key: str, data: bytes | codec.KVBlock) -> bool:  # runs on the saver thread
                if disk.touch(key):  # written through when it entered host memory: nothing to encode
                    return True
                return disk.put(key, data.to_bytes() if isinstance(data, codec.KVBlock) else data)

        tiers.append(HostTier(t.kv_offload_bytes, spill=spill))
    if disk is not None:
        tiers.append(disk)
    try:
        if t.kv_store == "mooncake":
            from pdserve.kvstore.mooncake import MooncakeTier

            tiers.append(
                MooncakeTier.from_args(
                    t.kv_store_master, t.kv_store_metadata_url or None, segment_bytes=t.kv_store_segment_bytes
                )
            )
        if t.kv_store and secret is None:
            secret = load_cluster_secret()
        return TieredKVStore(tiers, fingerprint, runner.kv_caches, config.cache.block_size, secret=secret or b"")
    except BaseException:
        for tier in tiers:  # the disk tier's directory lock above all: a retry here would wait for it
            tier.close()
        raise
