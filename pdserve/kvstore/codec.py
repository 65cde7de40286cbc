"""How one KV block is written to a tier, and how it is trusted when read back.

A stored block is self-describing and checked:

    b"PDKV" | version u16 | header length u32 | header (JSON) | digest (16 B) | data

The header names who wrote the block (the model fingerprint: architecture,
weights, dtype and cache layout), which block it is (its chained prefix hash and
its token ids) and the data's shape. The digest is blake2b over header and data.
A block whose digest does not match is corrupt; one whose header names another
model, layout or token sequence is foreign. Both are misses to the caller:
recomputing is always correct, loading a wrong block never is.

Blocks in the shared store (Mooncake Store, which has no authentication of its own:
whoever reaches it can read and write any object) are *sealed* with the cluster
secret instead (`seal` / `unseal`):

    b"PDKV" | version 2 u16 | nonce (12 B) | AES-256-GCM(header length u32 | header | data)

under a key derived from the secret and the object's name (the prefix before the
ciphertext authenticated too), so a sealed block is readable only by the cluster
(its token ids and KV are users' prompts), cannot be altered or written by anyone
else, and cannot be moved under another name. Headers are padded, so a block's
size does not tell its token ids' digits. Its name
(`shared_key`) is keyed too: without the secret, nobody can compute which name a
given prompt's blocks would have, so the store cannot be asked whether someone
sent that prompt.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import torch

MAGIC = b"PDKV"
VERSION = 1
SEALED_VERSION = 2
_PREFIX = struct.Struct("<4sHI")
_SEALED = struct.Struct("<4sH12s")  # magic, version, nonce
_HEAD_LEN = struct.Struct("<I")
_DIGEST = 16


class BadBlock(ValueError):
    """A stored block that must not be used; `kind` is "corrupt" or "foreign"."""

    def __init__(self, kind: str, why: str):
        super().__init__(f"{kind} KV block: {why}")
        self.kind = kind


@dataclass(frozen=True)
class KVBlock:
    """A block kept decoded, in this process's memory (the host tier): nothing to encode when
    it is written, nothing to check but its identity when it is read. It becomes bytes
    (`to_bytes`) only when it leaves the process, for the disk below."""

    fingerprint: str
    block_hash: int
    token_ids: tuple
    kv: torch.Tensor  # [layers, 2, block_size, kv_heads, head_dim], owned by this block

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def to_bytes(self) -> bytes:
        return encode(self.fingerprint, self.block_hash, self.token_ids, self.kv)

    def check(self, fingerprint: str, block_hash: int, token_ids, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """The block's tensor if it is the block asked for; else BadBlock("foreign")."""
        if (
            self.fingerprint != fingerprint
            or self.block_hash != block_hash
            or tuple(int(t) for t in token_ids) != tuple(self.token_ids)
            or list(self.kv.shape) != list(shape)
            or self.kv.dtype != dtype
        ):
            raise BadBlock("foreign", "not the block asked for")
        return self.kv


def _digest(head: bytes, data, key: bytes = b"") -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST, key=key[:64])
    h.update(head)
    h.update(data)
    return h.digest()


def block_key(fingerprint: str, block_hash: int) -> str:
    """The name a block has in every tier: the model's fingerprint and the block's prefix hash."""
    return f"{fingerprint}-{block_hash:016x}"


def _derive(secret: bytes, purpose: bytes) -> bytes:
    """A 32-byte key for one use of the cluster secret (names, sealing)."""
    return hashlib.blake2b(purpose, key=hashlib.blake2b(secret).digest(), digest_size=32).digest()


def shared_key(fingerprint: str, block_hash: int, secret: bytes) -> str:
    """A block's name in the shared store: the model's fingerprint and a keyed digest of the
    block's prefix hash, which only the cluster can compute."""
    mac = hashlib.blake2b(
        f"{fingerprint}-{block_hash:016x}".encode(), key=_derive(secret, b"pdserve kv name"), digest_size=16
    )
    return f"{fingerprint}-s{mac.hexdigest()}"


def _aead(secret: bytes, name: str):
    """The cipher of one object: its key derived from the secret and the object's name, so that
    random nonces never pile up under one key however long the secret lives."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # only where a shared store is used

    return AESGCM(_derive(secret, b"pdserve kv seal\0" + name.encode()))


_HEAD_PAD = 1024  # headers padded to a multiple: a sealed block's size says nothing of its token ids


def seal(fingerprint: str, block_hash: int, token_ids, kv: torch.Tensor, secret: bytes, name: str) -> bytes:
    """A block for the shared store, encrypted and authenticated with the cluster secret and
    bound to its object `name`."""
    head, raw = _head_and_data(fingerprint, block_hash, token_ids, kv)
    head += b" " * (-len(head) % _HEAD_PAD)  # JSON ignores the trailing blanks
    prefix = _SEALED.pack(MAGIC, SEALED_VERSION, os.urandom(12))
    body = _aead(secret, name).encrypt(prefix[-12:], b"".join((_HEAD_LEN.pack(len(head)), head, raw)), prefix)
    return prefix + body


def unseal(
    blob: bytes,
    fingerprint: str,
    block_hash: int,
    token_ids,
    shape: list[int],
    dtype: torch.dtype,
    secret: bytes,
    name: str,
) -> torch.Tensor:
    """The tensor of a sealed block, if this cluster sealed it under `name` and it is the block
    asked for; else BadBlock."""
    from cryptography.exceptions import InvalidTag

    (nonce,) = _opened(blob, _SEALED, SEALED_VERSION, 16)  # (16: the tag)
    try:
        body = _aead(secret, name).decrypt(nonce, memoryview(blob)[_SEALED.size :], blob[: _SEALED.size])
    except InvalidTag:
        raise BadBlock("corrupt", "does not open (altered, moved, or not sealed by this cluster)") from None
    if len(body) < _HEAD_LEN.size:
        raise BadBlock("corrupt", "truncated header")
    (head_len,) = _HEAD_LEN.unpack_from(body)
    if _HEAD_LEN.size + head_len > len(body):
        raise BadBlock("corrupt", "truncated header")
    head = body[_HEAD_LEN.size : _HEAD_LEN.size + head_len]
    data = memoryview(body)[_HEAD_LEN.size + head_len :]
    return _checked(head, data, fingerprint, block_hash, token_ids, shape, dtype)


def _opened(blob: bytes, prefix: struct.Struct, version: int, more: int = 0) -> tuple:
    """The fields after magic and version of a block's fixed prefix, once they say it is a block
    of this format (at least `more` bytes after the prefix); else BadBlock."""
    if len(blob) < prefix.size + more:
        raise BadBlock("corrupt", f"{len(blob)} bytes is shorter than a block's header")
    magic, got, *fields = prefix.unpack_from(blob)
    if magic != MAGIC:
        raise BadBlock("corrupt", "bad magic")
    if got != version:
        raise BadBlock("foreign", f"format version {got}; expected {version}")
    return tuple(fields)


def _head_and_data(fingerprint: str, block_hash: int, token_ids, kv: torch.Tensor) -> tuple[bytes, bytes]:
    kv = kv.contiguous()
    raw = kv.view(torch.uint8).numpy().tobytes()
    head = json.dumps(
        {
            "model": fingerprint,
            "hash": f"{block_hash:016x}",
            "tokens": [int(t) for t in token_ids],
            "dtype": str(kv.dtype).removeprefix("torch."),
            "shape": list(kv.shape),
            "nbytes": len(raw),
        },
        separators=(",", ":"),
    ).encode()
    return head, raw


def encode(fingerprint: str, block_hash: int, token_ids, kv: torch.Tensor, key: bytes = b"") -> bytes:
    """One block's K and V of every layer, `kv` shaped [layers, 2, block_size, kv_heads, head_dim]
    (`key`: a keyed digest; the shared store seals blocks instead, `seal`)."""
    head, raw = _head_and_data(fingerprint, block_hash, token_ids, kv)
    return b"".join((_PREFIX.pack(MAGIC, VERSION, len(head)), head, _digest(head, raw, key), raw))


def decode(
    blob: bytes, fingerprint: str, block_hash: int, token_ids, shape: list[int], dtype: torch.dtype, key: bytes = b""
) -> torch.Tensor:
    """The block's tensor, after checking it is intact and is the block asked for; else BadBlock."""
    (head_len,) = _opened(blob, _PREFIX, VERSION)
    start = _PREFIX.size
    if start + head_len + _DIGEST > len(blob):
        raise BadBlock("corrupt", "truncated header")
    head = blob[start : start + head_len]
    digest = blob[start + head_len : start + head_len + _DIGEST]
    data = memoryview(blob)[start + head_len + _DIGEST :]
    if _digest(head, data, key) != digest:
        raise BadBlock("corrupt", "checksum mismatch (truncated, altered, or not written by this cluster)")
    return _checked(head, data, fingerprint, block_hash, token_ids, shape, dtype)


def _checked(head: bytes, data, fingerprint: str, block_hash: int, token_ids, shape, dtype) -> torch.Tensor:
    """The data as the block's tensor, if the header says it is the block asked for."""
    try:
        meta = json.loads(head)
    except ValueError as e:
        raise BadBlock("corrupt", f"header is not JSON: {e}") from None
    if not isinstance(meta, dict):
        raise BadBlock("corrupt", "header is not a JSON object")
    want_dtype = str(dtype).removeprefix("torch.")
    for field, want in (
        ("model", fingerprint),
        ("hash", f"{block_hash:016x}"),
        ("tokens", [int(t) for t in token_ids]),
        ("dtype", want_dtype),
        ("shape", list(shape)),
    ):
        if meta.get(field) != want:
            raise BadBlock("foreign", f"{field} differs from this worker's")
    if meta.get("nbytes") != len(data) or len(data) != math.prod(shape) * dtype.itemsize:
        raise BadBlock("corrupt", "data length differs from the header's or the block's shape")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def model_fingerprint(model_config, dtype: str, block_size: int, weights_digest: str) -> str:
    """16 hex digits naming everything that decides a block's bytes: two workers share
    blocks only if they agree on all of it."""
    h = hashlib.blake2b(digest_size=8)
    h.update(
        json.dumps(
            {
                "arch": model_config.architecture,
                "layers": model_config.num_hidden_layers,
                "kv_heads": model_config.num_key_value_heads,
                "head_dim": model_config.head_dim,
                "hidden": model_config.hidden_size,
                "vocab": model_config.vocab_size,
                "rope_theta": model_config.rope_theta,
                "dtype": dtype,
                "block_size": block_size,
                "weights": weights_digest,
            },
            sort_keys=True,
        ).encode()
    )
    return h.hexdigest()
