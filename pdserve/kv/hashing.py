"""Chained block hashes: the identity of a full KV block across processes.

Block i's hash covers its own token ids and block i-1's hash, so equal hashes
mean equal whole prefixes. The hash is stable across processes and machines
(blake2b, not Python's salted `hash`), because the router's global prefix
index and the tiered cache on disk compare hashes computed by different workers.

A request's `cache_salt` (vLLM's name) changes the hash the chain starts from
(`salt_root`), so every block hash of a salted prompt differs from the same
prompt's with another salt or none: tenants that salt their requests never
reuse, or time, each other's cached prefixes, in any tier or on any worker. A request's LoRA
adapter does the same (`chain_root`): KV computed under one adapter is another model's KV.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0  # parent of the first block of an unsalted prompt
_SALT_DOMAIN = b"pdserve-cache-salt\0"
_LORA_DOMAIN = b"pdserve-lora-adapter\0"


def salt_root(cache_salt: str | None) -> int:
    """The parent of a prompt's first block: ROOT_HASH without a salt, else the salt's hash."""
    if not cache_salt:
        return ROOT_HASH
    h = hashlib.blake2b(_SALT_DOMAIN + cache_salt.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") or 1  # never ROOT_HASH


def chain_root(cache_salt: str | None, lora_adapter: str | None = None) -> int:
    """The parent of a request's first block: its salt's root, moved by its adapter's key
    ("name@fingerprint", engine/lora.py) where it has one."""
    root = salt_root(cache_salt)
    if not lora_adapter:
        return root
    h = hashlib.blake2b(_LORA_DOMAIN + root.to_bytes(8, "little") + lora_adapter.encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") or 1


def params_root(params) -> int:
    """`chain_root` of a request's SamplingParams (or their JSON dict)."""
    get = params.get if isinstance(params, dict) else lambda k: getattr(params, k, None)
    return chain_root(get("cache_salt"), get("lora_adapter"))


def hash_block(parent: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    if extra:
        h.update(extra)
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra: bytes = b"",
    start: list[int] | None = None,
    root: int = ROOT_HASH,
) -> list[int]:
    """Hashes of every full block of `token_ids`; `start` continues an earlier list; `root`:
    the chain's start (`salt_root` of the request's cache salt)."""
    out = list(start or [])
    extend_block_hashes(out, token_ids, len(token_ids) // block_size, block_size, extra, root)
    return out


def extend_block_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    num_blocks: int,
    block_size: int,
    extra: bytes = b"",
    root: int = ROOT_HASH,
) -> None:
    """Append to `hashes` those of blocks len(hashes) .. num_blocks - 1 of `token_ids`, in place:
    a sequence that fills one more block hashes that block alone, whatever its length."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_blocks):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra)
        hashes.append(parent)
