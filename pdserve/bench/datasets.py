"""Workloads: lists of `Request`s built from a seed, a dataset file or a trace.

Every builder is deterministic for a given seed, so two runs (or two servers)
see exactly the same prompts. Prompts are token ids where the endpoint takes
them (`/v1/completions`): the length sent is then the length the server
prefills, with no tokenizer round trip; `as_text=True` gives text for chat.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from pdserve.bench.tokens import TokenSource

log = logging.getLogger("pdserve.bench")
MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the published Mooncake traces


class DatasetError(ValueError):
    """A dataset file that cannot be used; the message names the file and line."""


@dataclass
class Request:
    prompt: str | list[int]
    prompt_len: int  # tokens as built (or estimated for text); the server's usage count wins
    output_len: int  # sent as max_tokens
    arrival_s: float | None = None  # from the benchmark start; None: the arrival process decides
    tag: str = "default"  # a class of requests whose metrics are also reported on their own


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> np.ndarray:
    """Lengths uniform in [mean*(1-r), mean*(1+r)], as `vllm bench serve --random-range-ratio`."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    if mean < 1:
        raise ValueError(f"lengths must be >= 1 token, got {mean}")
    low, high = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, n)


def _prompt(ids: list[int], tokens: TokenSource, as_text: bool) -> str | list[int]:
    return tokens.text(ids) if as_text else ids


def random(
    num_prompts: int,
    input_len: int,
    output_len: int,
    tokens: TokenSource,
    *,
    seed: int = 0,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    as_text: bool = False,
    tag: str = "default",
) -> list[Request]:
    """Random token prompts; `prefix_len` tokens shared by all of them (a prefix-cache hit)."""
    rng = np.random.default_rng([seed, 1])
    in_lens = _lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = _lengths(rng, num_prompts, output_len, range_ratio)
    prefix = tokens.random_ids(rng, prefix_len)
    out = []
    for n_in, n_out in zip(in_lens.tolist(), out_lens.tolist()):
        ids = prefix + tokens.random_ids(rng, n_in)
        out.append(Request(_prompt(ids, tokens, as_text), len(ids), n_out, tag=tag))
    return out


@dataclass
class MixedConfig:
    """Steady short chats plus periodic bursts of long prompts: the interference experiment.

    Chats arrive by the arrival process (`--request-rate`), at most
    `chat_streams` at a time; with an infinite rate that is a closed loop of
    `chat_streams` users, each sending the next chat when the last one ends.
    Long prompts arrive on their own clock, `burst_size` at a time, at
    `first_burst_s + k * burst_interval_s`, whatever the chats are doing.
    """

    num_chats: int = 64
    chat_input_len: int = 64
    chat_output_len: int = 128
    chat_streams: int | None = 8  # None: no limit beyond --max-concurrency
    long_input_len: int = 2048
    long_output_len: int = 16
    burst_size: int = 1
    num_bursts: int = 3
    burst_interval_s: float = 6.0
    first_burst_s: float = 2.0

    def __post_init__(self):
        if (
            min(
                self.num_chats,
                self.burst_size,
                self.chat_input_len,
                self.long_input_len,
                self.chat_output_len,
                self.long_output_len,
            )
            < 1
            or self.num_bursts < 0
        ):
            raise ValueError("mixed workload: counts and lengths must be >= 1 (num_bursts >= 0)")
        if self.burst_interval_s <= 0 or self.first_burst_s < 0:
            raise ValueError("mixed workload: burst_interval_s must be > 0 and first_burst_s >= 0")
        if self.chat_streams is not None and self.chat_streams < 1:
            raise ValueError("mixed workload: chat_streams must be >= 1 (or None for no limit)")

    def tag_concurrency(self) -> dict[str, int]:
        return {} if self.chat_streams is None else {"chat": self.chat_streams}


def mixed(
    cfg: MixedConfig, tokens: TokenSource, *, seed: int = 0, range_ratio: float = 0.0, as_text: bool = False
) -> list[Request]:
    """Chats tagged "chat", long prompts tagged "long" (each unique, so each one is a full prefill)."""
    chats = random(
        cfg.num_chats,
        cfg.chat_input_len,
        cfg.chat_output_len,
        tokens,
        seed=seed,
        range_ratio=range_ratio,
        as_text=as_text,
        tag="chat",
    )
    rng = np.random.default_rng([seed, 2])
    longs = []
    for k in range(cfg.num_bursts):
        t = cfg.first_burst_s + k * cfg.burst_interval_s
        for _ in range(cfg.burst_size):
            ids = tokens.random_ids(rng, cfg.long_input_len)
            longs.append(Request(_prompt(ids, tokens, as_text), len(ids), cfg.long_output_len, arrival_s=t, tag="long"))
    return chats + longs


def sharegpt(
    path: str,
    num_prompts: int,
    tokens: TokenSource,
    *,
    seed: int = 0,
    output_len: int | None = None,
    skip_bad: bool = False,
) -> list[Request]:
    """First human turn as the prompt, the answer's length as the output length (vLLM's filter rules)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: not a ShareGPT JSON file: {e}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of conversations, got {type(data).__name__}")
    out, skipped = [], 0
    for i in np.random.default_rng([seed, 3]).permutation(len(data)).tolist():
        if len(out) == num_prompts:
            break
        turns = _sharegpt_turns(data[i])
        if isinstance(turns, str):
            if skip_bad:
                skipped += 1
                continue
            raise DatasetError(f"{path}: entry {i}: {turns} (--skip-bad-lines skips such entries)")
        if turns is None:
            continue  # fewer than two turns: nothing to answer, as vLLM skips them
        prompt, answer = turns
        n_in = tokens.count(prompt)
        n_out = output_len or tokens.count(answer)
        if output_len is None and (n_in < 4 or n_out < 4):
            continue
        if n_in > 1024 or n_in + n_out > 2048:  # vLLM's limits, so results compare
            continue
        out.append(Request(prompt, n_in, n_out))
    if skipped:
        log.warning("%s: skipped %d malformed entries", path, skipped)
    return out


def _sharegpt_turns(entry) -> tuple[str, str] | str | None:
    """(prompt, answer); None for a conversation too short to use; a reason string if malformed."""
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        return "no 'conversations' list"
    conv = entry["conversations"]
    if len(conv) < 2:
        return None
    values = [t.get("value") if isinstance(t, dict) else None for t in conv[:2]]
    if not all(isinstance(v, str) for v in values):
        return "a turn without a string 'value'"
    return values[0], values[1]


@dataclass
class MooncakeScaling:
    """How a production trace is shrunk to fit a small model; say which next to every result."""

    block_tokens: int = MOONCAKE_BLOCK_TOKENS  # tokens per hash id; lengths scale by block_tokens / 512
    output_scale: float = 1.0  # output lengths are multiplied by this
    time_scale: float = 1.0  # timestamps are multiplied by this (0.1: ten times faster)

    def __post_init__(self):
        if self.block_tokens < 1 or self.output_scale <= 0 or self.time_scale < 0:
            raise ValueError("mooncake scaling: block_tokens >= 1, output_scale > 0 and time_scale >= 0")


def mooncake(
    path: str,
    num_prompts: int,
    tokens: TokenSource,
    *,
    seed: int = 0,
    scaling: MooncakeScaling | None = None,
    as_text: bool = False,
    skip_bad: bool = False,
) -> list[Request]:
    """Replay a Mooncake trace: the same hash id is the same block of tokens in every request,
    so requests share exactly the prefixes the trace says they share."""
    records = itertools.islice(_jsonl(path, skip_bad), max(0, num_prompts))
    return mooncake_records(records, tokens, seed=seed, scaling=scaling, as_text=as_text)


def mooncake_records(
    records: Iterable[dict],
    tokens: TokenSource,
    *,
    seed: int = 0,
    scaling: MooncakeScaling | None = None,
    as_text: bool = False,
) -> list[Request]:
    """`mooncake` on trace records already read (a selection of a trace, in the order given);
    arrival times count from the first record's timestamp."""
    sc = scaling or MooncakeScaling()
    blocks: dict[int, list[int]] = {}
    rng = np.random.default_rng([seed, 4])
    out: list[Request] = []
    t0 = None
    for rec in records:
        n_in = max(1, round(rec["input_length"] * sc.block_tokens / MOONCAKE_BLOCK_TOKENS))
        ids: list[int] = []
        for h in rec["hash_ids"]:
            if len(ids) >= n_in:
                break
            if h not in blocks:  # each block's tokens depend on (seed, hash id) only
                blocks[h] = tokens.random_ids(np.random.default_rng([seed, 5, h]), sc.block_tokens)
            ids += blocks[h]
        ids = ids[:n_in] + tokens.random_ids(rng, max(0, n_in - len(ids)))
        t0 = rec["timestamp"] if t0 is None else t0
        arrival_s = (rec["timestamp"] - t0) / 1000 * sc.time_scale
        n_out = max(1, round(rec["output_length"] * sc.output_scale))
        out.append(Request(_prompt(ids, tokens, as_text), n_in, n_out, arrival_s=arrival_s))
    return out


def mooncake_conversations(
    path: str, conversations: int, *, min_turns: int, max_turns: int, max_input_tokens: int
) -> list[list[dict]]:
    """The first `conversations` multi-turn conversations of a Mooncake trace, each the records
    of its first `max_turns` turns in trace order.

    A conversation's turns share their first hash ids: hash 0 is the system prompt every request
    shares, the next ones the conversation's opening, so turns are grouped by their first three.
    A turn's last block is partial, so the next turn re-hashes it and only a prefix matches. Kept:
    conversations with at least `min_turns` turns whose kept turns are all at most
    `max_input_tokens` long (trace tokens, before any scaling)."""
    if min_turns < 1 or max_turns < min_turns:
        raise ValueError("mooncake conversations: 1 <= min_turns <= max_turns")
    chains: dict[tuple, list[dict]] = {}
    for rec in _jsonl(path, False):
        chains.setdefault(tuple(rec["hash_ids"][:3]), []).append(rec)
    keep = [
        c[:max_turns]
        for c in chains.values()
        if len(c) >= min_turns and max(t["input_length"] for t in c[:max_turns]) <= max_input_tokens
    ]
    return keep[:conversations]


def _jsonl(path: str, skip_bad: bool):
    """Each valid trace line as a dict; a clear error naming the line (or a skip) for the others."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    skipped = 0
    try:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                reason = _trace_problem(rec)
            except ValueError as e:  # also a UnicodeDecodeError from reading the line
                reason = f"not valid JSON ({e})"
            if reason is None:
                yield rec
            elif not skip_bad:
                raise DatasetError(f"{path}:{lineno}: {reason} (--skip-bad-lines skips such lines)")
            else:
                skipped += 1
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e})") from None
    finally:
        f.close()
        if skipped:
            log.warning("%s: skipped %d malformed lines", path, skipped)


def _trace_problem(rec) -> str | None:
    if not isinstance(rec, dict):
        return "a trace line must be a JSON object"
    for key in ("timestamp", "input_length", "output_length"):
        v = rec.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            return f"{key!r} must be a number >= 0, got {v!r}"
    if rec["input_length"] < 1:
        return "'input_length' must be >= 1"
    ids = rec.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        return "'hash_ids' must be a list of integers"
    return None
