"""Choosing workers for a request: adapts registry entries to the pure policy functions."""

from __future__ import annotations

import time

from pdserve.costmodel import PrefillCostModel
from pdserve.kv.hashing import ROOT_HASH, block_hashes, hash_block
from pdserve.router import conductor, policy
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Registry, WorkerInfo

# Until a worker reports its calibrated D_prefill (stats "prefill_cost_s": [a, b, c]): only the
# ratio of the score's two terms matters, and both come from this same model, so its scale is moot.
DEFAULT_PREFILL_COST = PrefillCostModel(0.005, 1e-4, 0.0)
HASH_PREFIX_TOKENS = 64  # consistent_hash keys on this much of the prompt (the system prompt, say)


def candidate(w: WorkerInfo) -> policy.Candidate:
    s = w.stats or {}
    return policy.Candidate(
        w.worker_id, int(s.get("num_waiting", 0)), int(s.get("num_running", 0)), float(s.get("kv_usage", 0.0))
    )


def prefill_cost(w: WorkerInfo) -> PrefillCostModel:
    return PrefillCostModel.from_stats(w.stats) or DEFAULT_PREFILL_COST


DEFAULT_TIER_LOAD_COST = 0.2  # a lower-tier block's load time over its prefill time, until measured


def tier_load_cost(w: WorkerInfo) -> float:
    """What loading a block from this worker's lower tiers costs, as a share of computing it:
    the tiers' measured load seconds per block over the prefill model's seconds per block."""
    s = w.stats or {}
    tiers = ((s.get("kv_store") or {}).get("tiers") or {}).values()
    hits = sum(t.get("hits", 0) for t in tiers if isinstance(t, dict))
    bs = int(s.get("kv_block_size", 0) or 0)
    if hits < 8 or not bs:
        return DEFAULT_TIER_LOAD_COST
    load_s = sum(t.get("load_seconds", 0.0) for t in tiers if isinstance(t, dict)) / hits
    compute_s = prefill_cost(w)(1024) / 1024 * bs
    return min(1.0, max(0.0, load_s / compute_s)) if compute_s > 0 else DEFAULT_TIER_LOAD_COST


class Placer:
    """Prefill by `prefill_policy`, decode by KV headroom (the worker with the most free KV)."""

    def __init__(
        self,
        prefill_policy: str = "cache_aware",
        index: PrefixIndex | None = None,
        alpha: float | None = None,
        clock=time.monotonic,
    ):
        if prefill_policy not in policy.POLICIES:
            raise ValueError(f"policy must be one of {policy.POLICIES}")
        self.name = prefill_policy
        self.index = index or PrefixIndex()
        self.alpha = alpha  # None: adaptive to the prefill pool's load
        self._clock = clock
        self._busy_until_s: dict[str, float] = {}
        # decode worker -> {request id: (prompt tokens, max_tokens)} of what this router sent it
        self._decode_booked: dict[str, dict[str, tuple[int, int]]] = {}
        self._rr = policy.RoundRobin()
        self._prefill = {"least_loaded": policy.least_loaded, "round_robin": self._rr}.get(prefill_policy)

    def pick(
        self, registry: Registry, prompt: list[int], root: int = ROOT_HASH
    ) -> tuple[WorkerInfo | None, WorkerInfo | None]:
        """A (prefill, decode) pair for the prompt; `root`: its hash chain's start (the
        request's cache salt, `hashing.salt_root`), here and in the other prompt methods."""
        ps, ds = registry.alive("prefill"), registry.alive("decode")
        if not ps or not ds:
            return None, None
        # dedicated workers first: a `both` worker serves a role only when no specialist is alive
        ps = [w for w in ps if w.role == "prefill"] or ps
        ds = [w for w in ds if w.role == "decode"] or ds
        if self.name == "cache_aware":
            p = self._cache_aware(ps, prompt, root)
        elif self.name == "consistent_hash":
            key = hash_block(root, prompt[:HASH_PREFIX_TOKENS])
            p = {w.worker_id: w for w in ps}[policy.consistent_hash(key, [w.worker_id for w in ps])]
        else:
            p = self._choose(ps, self._prefill)
        d = self._choose(ds, policy.most_kv_headroom)
        return p, d

    def _cache_aware(self, ps: list[WorkerInfo], prompt: list[int], root: int) -> WorkerInfo:
        now = self._clock()
        best = self._best_prefill(ps, prompt, now, root)
        self._busy_until_s[best.worker_id] = conductor.next_busy_until_s(
            now, self._busy_until_s.get(best.worker_id, now), (1 - best.hit_ratio) * best.prefill_time_s
        )
        return next(w for w in ps if w.worker_id == best.worker_id)

    def peek_prefill(
        self, registry: Registry, prompt: list[int], root: int = ROOT_HASH
    ) -> conductor.PrefillCandidate | None:
        """The prefill candidate cache_aware would pick now, booking nothing (for admission)."""
        ps = registry.alive("prefill")
        ps = [w for w in ps if w.role == "prefill"] or ps
        return self._best_prefill(ps, prompt, self._clock(), root) if ps else None

    def _best_prefill(
        self, ps: list[WorkerInfo], prompt: list[int], now: float, root: int
    ) -> conductor.PrefillCandidate:
        hashes: dict[int, list[int]] = {}
        cands = []
        for w in ps:
            bs = int((w.stats or {}).get("kv_block_size", 0))
            if bs and bs not in hashes:
                hashes[bs] = block_hashes(prompt, bs, root=root)
            hit = 0.0
            if bs:
                local = self.index.hit_blocks(w.worker_id, hashes[bs])
                lower = self.index.lower_hit_blocks(w.worker_id, hashes[bs], local)
                hit = conductor.effective_hit_ratio(local, lower, bs, len(prompt), tier_load_cost(w))
            prefill_s = prefill_cost(w)(len(prompt))
            # the router's own bookings, or what the last heartbeat saw waiting (work other
            # routers sent, or a cost model that runs slow): whichever is longer
            booked_s = self._busy_until_s.get(w.worker_id, now) - now
            queue_s = max(0.0, booked_s, int((w.stats or {}).get("num_waiting", 0)) * prefill_s)
            cands.append(conductor.PrefillCandidate(w.worker_id, hit, prefill_s, queue_s))
        alpha = self.alpha
        if alpha is None:
            horizon_s = max(c.prefill_time_s for c in cands) * 4  # "busy" = four prompts like this queued
            alpha = conductor.adaptive_alpha(conductor.pool_utilisation([c.queue_drain_s for c in cands], horizon_s))
        return conductor.choose_prefill(cands, alpha)[0]

    # ---- decode bookings: heartbeats are a second stale, a burst is not
    def book_decode(self, worker_id: str, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        self._decode_booked.setdefault(worker_id, {})[request_id] = (prompt_tokens, max_tokens)

    def release_decode(self, request_id: str) -> None:
        for booked in self._decode_booked.values():
            booked.pop(request_id, None)

    def decode_load(self, w: WorkerInfo) -> tuple[int, float]:
        """(sequences, context tokens) a decode worker is running: the longer of what its
        last heartbeat saw and what this router has sent it (each booked request at
        its midpoint, prompt + half its output, as conductor.predict_tpot counts)."""
        s = w.stats or {}
        booked = self._decode_booked.get(w.worker_id, {}).values()
        seen_seqs = int(s.get("num_running", 0)) + int(s.get("num_waiting", 0))
        seen_ctx = float(s.get("running_context_tokens", 0))
        return (max(seen_seqs, len(booked)), max(seen_ctx, sum(p + m / 2 for p, m in booked)))

    def pick_decode(self, registry: Registry) -> WorkerInfo | None:
        """The decode worker `pick` would choose now, booking nothing (for admission)."""
        ds = registry.alive("decode")
        ds = [w for w in ds if w.role == "decode"] or ds
        return self._choose(ds, policy.most_kv_headroom) if ds else None

    def cached_tokens(self, w: WorkerInfo, prompt: list[int], root: int = ROOT_HASH) -> int:
        """Leading tokens of the prompt that the worker's own pool holds, by the prefix index."""
        bs = int((w.stats or {}).get("kv_block_size", 0))
        return self.index.hit_blocks(w.worker_id, block_hashes(prompt, bs, root=root)) * bs if bs else 0

    def pick_any(self, registry: Registry, exclude: set[str]) -> WorkerInfo | None:
        """A worker to run a whole request: a decode worker if one is left, else a prefill worker."""
        for role in ("decode", "prefill"):
            ws = [w for w in registry.alive(role) if w.worker_id not in exclude]
            if ws:
                return self._choose(ws, policy.least_loaded)
        return None

    @staticmethod
    def _choose(workers: list[WorkerInfo], fn) -> WorkerInfo:
        by_id = {w.worker_id: w for w in workers}
        return by_id[fn([candidate(w) for w in workers]).worker_id]
