"""Choosing workers for a request: adapts registry entries to the pure policy functions."""
from __future__ import annotations

from pdserve.router import policy
from pdserve.router.registry import Registry, WorkerInfo


def candidate(w: WorkerInfo) -> policy.Candidate:
    s = w.stats or {}
    return policy.Candidate(w.worker_id, int(s.get("num_waiting", 0)), int(s.get("num_running", 0)),
                            float(s.get("kv_usage", 0.0)))


class Placer:
    """Prefill by `prefill_policy`, decode by KV headroom (seed 000 §5.1)."""

    def __init__(self, prefill_policy: str = "least_loaded"):
        self.name = prefill_policy
        self._rr = policy.RoundRobin()
        self._prefill = {"least_loaded": policy.least_loaded, "round_robin": self._rr}[prefill_policy]

    def pick(self, registry: Registry, prompt: list[int]) -> tuple[WorkerInfo | None, WorkerInfo | None]:
        ps, ds = registry.alive("prefill"), registry.alive("decode")
        if not ps or not ds:
            return None, None
        # dedicated workers first: a `both` worker serves a role only when no specialist is alive
        ps = [w for w in ps if w.role == "prefill"] or ps
        ds = [w for w in ds if w.role == "decode"] or ds
        p = self._choose(ps, self._prefill)
        d = self._choose(ds, policy.most_kv_headroom)
        return p, d

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
