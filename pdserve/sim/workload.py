"""What the simulated clients send: requests with token ids, lengths, arrival times.

Three sources:
- the benchmark's own generators (pdserve/bench/datasets.py: random, mixed,
  ShareGPT), used as they are;
- a Mooncake trace read lazily (`MooncakeTrace`): the whole 12,031-request
  conversation trace would be ~1 GB of token lists if built up front, so each
  request's prompt is made when it arrives and dropped when it ends. Its
  tokens come from its hash ids: hash id h is `block_tokens` copies of h, so
  requests that share hash ids share exactly those prefix blocks (the chained
  block hash makes equal tokens at different positions different blocks);
- a `workload.json` written by a measured run (benchmarks/interference.py),
  replayed with its arrival offsets, and the interference scenario
  (`seed_000_6_1`: chats with three long prompts among them).

Block hashes of a prompt are computed once per request (`prompt_hashes`), with
the real chained hash (pdserve/kv/hashing.py); for Mooncake prompts they are
memoised per (parent, hash id), so a prefix shared by a thousand requests is
hashed once.
"""

from __future__ import annotations

import json
import random as _random
from dataclasses import dataclass, field

import numpy as np

from pdserve.bench.datasets import MOONCAKE_BLOCK_TOKENS, _jsonl
from pdserve.kv.hashing import ROOT_HASH, block_hashes, hash_block


@dataclass
class SimRequest:
    rid: int
    prompt_len: int
    output_len: int
    arrival_s: float | None = None  # None: the arrival process decides
    tag: str = "default"
    token_ids: list[int] | None = None  # the prompt, when built up front
    hash_ids: list[int] | None = None  # Mooncake: the prompt is built from these on demand
    block_tokens: int = MOONCAKE_BLOCK_TOKENS

    def prompt_ids(self) -> list[int]:
        if self.token_ids is not None:
            return self.token_ids
        ids: list[int] = []
        for h in self.hash_ids or ():
            take = min(self.block_tokens, self.prompt_len - len(ids))
            if take <= 0:
                break
            ids += [h] * take
        if len(ids) < self.prompt_len:  # hash ids that do not cover the prompt: a unique tail
            ids += [-1 - self.rid] * (self.prompt_len - len(ids))
        return ids

    def prompt_array(self, ids: list[int]) -> np.ndarray:
        """The prompt as int32: what the router hashes. hash_block hashes int32 bytes, so the
        hashes are those of the list, without converting every block slice again."""
        if self.token_ids is None and self.hash_ids and len(self.hash_ids) * self.block_tokens >= self.prompt_len:
            return np.repeat(np.asarray(self.hash_ids, dtype=np.int32), self.block_tokens)[: self.prompt_len]
        return np.asarray(ids, dtype=np.int32)


@dataclass
class HashCache:
    """Full-block hashes of prompts for one block size, memoised along Mooncake hash-id chains."""

    block_size: int
    _chain: dict[tuple[int, int], list[int]] = field(default_factory=dict)

    def prompt_hashes(self, req: SimRequest, ids) -> list[int]:
        """`ids`: the prompt, best as the int32 array of `prompt_array`."""
        bs = self.block_size
        if req.hash_ids is None or req.block_tokens % bs:
            return block_hashes(ids, bs)
        out: list[int] = []
        parent, pos = ROOT_HASH, 0
        for h in req.hash_ids:
            take = min(req.block_tokens, req.prompt_len - pos)
            if take < bs:
                break
            if take == req.block_tokens:
                hs = self._chain.get((parent, h))
                if hs is None:
                    hs = self._chain[(parent, h)] = _chain(parent, h, bs, req.block_tokens // bs)
            else:
                hs = _chain(parent, h, bs, take // bs)
            out += hs
            parent, pos = hs[-1], pos + take
            if take < req.block_tokens:
                return out
        # the unique tail (hash ids that stop short of the prompt)
        return block_hashes(ids, bs, start=out) if pos < req.prompt_len else out


def _chain(parent: int, token: int, block_size: int, n: int) -> list[int]:
    """Hashes of n blocks of `token` repeated: hash_block of an int32 array is hash_block of the
    same ids as a list (it hashes their int32 bytes), without a list -> array conversion per block."""
    block = np.full(block_size, token, dtype=np.int32)
    out = []
    for _ in range(n):
        parent = hash_block(parent, block)
        out.append(parent)
    return out


def from_bench(requests) -> list[SimRequest]:
    """Requests built by pdserve/bench/datasets.py (token-id prompts)."""
    out = []
    for i, r in enumerate(requests):
        if not isinstance(r.prompt, list):
            raise ValueError("the simulator needs token-id prompts (build the workload with as_text=False)")
        out.append(SimRequest(i, len(r.prompt), r.output_len, r.arrival_s, r.tag, token_ids=r.prompt))
    return out


def mooncake_trace(
    path: str,
    num_prompts: int | None = None,
    *,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
    output_scale: float = 1.0,
    time_scale: float = 1.0,
    skip_bad: bool = False,
) -> list[SimRequest]:
    """A Mooncake trace, lengths and clock scaled as `pdserve bench --dataset-name mooncake` scales them."""
    out: list[SimRequest] = []
    t0 = None
    for rec in _jsonl(path, skip_bad):
        if num_prompts is not None and len(out) == num_prompts:
            break
        n_in = max(1, round(rec["input_length"] * block_tokens / MOONCAKE_BLOCK_TOKENS))
        t0 = rec["timestamp"] if t0 is None else t0
        out.append(
            SimRequest(
                len(out),
                n_in,
                max(1, round(rec["output_length"] * output_scale)),
                (rec["timestamp"] - t0) / 1000 * time_scale,
                hash_ids=list(rec.get("hash_ids", [])),
                block_tokens=block_tokens,
            )
        )
    return out


def from_workload_json(path: str) -> tuple[list[SimRequest], dict]:
    """Replay a measured run: {"requests": [{"arrival_s", "prompt_tokens", "output_tokens", "tag"?}, ...], ...}
    (benchmarks/interference.py writes this; arrival_s null: sent by the arrival process or a closed loop).

    Prompts get unique token ids (no prefix sharing) unless a request lists
    "prompt_token_ids"; the rest of the file (settings) is returned as is."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc["requests"] if isinstance(doc, dict) else doc
    out = []
    for i, r in enumerate(rows):
        n_in = int(r.get("prompt_tokens", r.get("prompt_len", 0)))
        n_out = int(r.get("output_tokens", r.get("output_len", 0)))
        if n_in < 1 or n_out < 1:
            raise ValueError(f"{path}: request {i}: prompt_tokens and output_tokens must be >= 1")
        ids = r.get("prompt_token_ids") or [-1 - i] * n_in
        arrival = r.get("arrival_s", r.get("start_s"))
        tag = r.get("tag", r.get("kind", "default"))  # interference.py calls it "kind"
        out.append(
            SimRequest(
                i, n_in, n_out, None if arrival is None else float(arrival), tag, token_ids=[int(t) for t in ids]
            )
        )
    return out, (doc if isinstance(doc, dict) else {})


def seed_000_6_1() -> list[SimRequest]:
    """The interference scenario (`--scenario seed-000-6.1`): 20 requests 50-200 ms apart,
    short chats (300-800 tokens in, 40-80 out) and 16,000-token prompts at i = 5, 10, 15.
    Collocated, each long prefill stalls every running chat; disaggregated, it does not.
    Drawn from random.Random(42) in a fixed order, so every run sees the same requests."""
    rng = _random.Random(42)
    out, t = [], 0.0
    for i in range(20):
        t += rng.uniform(0.05, 0.2)
        if i in (5, 10, 15):
            n_in, n_out, tag = 16000, 60, "long"
        else:
            n_in, n_out, tag = rng.randint(300, 800), rng.randint(40, 80), "chat"
        out.append(SimRequest(i, n_in, n_out, t, tag, token_ids=[-1 - i] * n_in))
    return out
