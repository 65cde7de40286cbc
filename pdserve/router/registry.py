"""Which workers exist, what role each plays, and which are alive.

Workers register themselves (they may start on another host, under any
scheduler; registration is signed with the cluster secret) and heartbeat with
their load; a worker that misses heartbeats for `timeout_s`, or that a request
could not reach, is marked dead and gets no new work until it answers again.
A worker that says it is draining keeps its requests in flight but gets no
new ones.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pdserve.settings import RouterConfig

ROLES = ("prefill", "decode", "both")


@dataclass
class WorkerInfo:
    worker_id: str
    url: str  # the worker's control API, e.g. http://127.0.0.1:8101
    role: str
    kv_address: str = ""  # where its KV receiver listens (decode / both)
    kv_export_address: str = ""  # where it serves KV pulls (prefill / both)
    host: str = ""
    stats: dict = field(default_factory=dict)  # last heartbeat's engine stats
    last_seen_s: float = 0.0
    alive: bool = True
    registered_s: float = field(default_factory=time.monotonic)
    restarts: int = 0  # how often its supervisor restarted it (reported at registration)
    features: frozenset = frozenset()  # control_api.WORKER_FEATURES it said it has

    @property
    def draining(self) -> bool:
        return bool((self.stats or {}).get("draining"))

    def can_prefill(self) -> bool:
        return self.role in ("prefill", "both")

    def can_decode(self) -> bool:
        return self.role in ("decode", "both")


class Registry:
    def __init__(self, timeout_s: float = RouterConfig.worker_timeout_s):
        self.timeout_s = timeout_s
        self._workers: dict[str, WorkerInfo] = {}
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    def register(self, info: WorkerInfo) -> None:
        if info.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        info.last_seen_s = time.monotonic()
        info.alive = True
        with self._lock:
            self._workers[info.worker_id] = info
            self.changed.notify_all()

    def heartbeat(self, worker_id: str, stats: dict) -> bool:
        """False if the worker is unknown (the router restarted): it must register again."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None:
                return False
            w.stats, w.last_seen_s, w.alive = stats, time.monotonic(), True
            return True

    def mark_dead(self, worker_id: str) -> None:
        with self._lock:
            w = self._workers.get(worker_id)
            if w is not None:
                w.alive = False

    def update_features(self, worker_id: str, add=(), remove=()) -> None:
        """A worker's features changed since it registered (a LoRA adapter loaded or unloaded)."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is not None:
                w.features = (w.features - frozenset(remove)) | frozenset(add)

    def forgive(self, seconds: float) -> None:
        """Do not count `seconds` the router itself stalled against any live worker's silence."""
        with self._lock:
            for w in self._workers.values():
                if w.alive:
                    w.last_seen_s += seconds

    def expire(self, now: float | None = None) -> list[str]:
        """Mark workers silent for longer than the timeout dead; returns their ids."""
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for w in self._workers.values():
                if w.alive and now - w.last_seen_s > self.timeout_s:
                    w.alive = False
                    gone.append(w.worker_id)
        return gone

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        """Workers that take new work: alive and not draining."""
        with self._lock:
            ws = [w for w in self._workers.values() if w.alive and not w.draining]
        if role == "prefill":
            return [w for w in ws if w.can_prefill()]
        if role == "decode":
            return [w for w in ws if w.can_decode()]
        return ws

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def having(self, features: frozenset) -> Registry | RegistryView:
        """This registry as placement sees it for a request that needs `features`."""
        return RegistryView(self, features) if features else self

    def all(self) -> list[WorkerInfo]:
        with self._lock:
            return list(self._workers.values())


class RegistryView:
    """A registry whose `alive` lists only the workers with some features (for a request that
    needs them); everything else is the registry's own."""

    def __init__(self, registry: Registry, features: frozenset):
        self.registry, self.features = registry, features

    def alive(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.registry.alive(role) if self.features <= w.features]

    def __getattr__(self, name):
        return getattr(self.registry, name)
