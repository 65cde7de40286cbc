"""Pool sizes that change while serving: what is asked for, and how to get there.

The router holds the wanted size of each pool (prefill, decode). Three parties
change it: an operator (`pdserve scale`, the admin route), the autoscaler
(pdserve/router/autoscale.py), and the supervisor at start (`pdserve serve`,
`pdserve serve --ray`), which tells a router that has no wanted sizes yet
(a fresh or restarted one) what it runs.

Getting there is split by who can do what:
- **Growing** needs a new process: the supervisor polls the wanted sizes and
  starts workers. Without a supervisor, an operator starts them by hand.

A pool nobody gave a size to is not managed: the router neither grows nor
shrinks it. So on a deployment started by hand, `pdserve scale --decode 2`
manages the decode pool only, and a prefill worker started by hand later joins
as it always did (it once was retired at once: the command had pinned the
prefill pool at its size of that moment).
- **Shrinking** needs only a drain: the router picks the worker to retire,
  stops placing work on it at once, and asks it to drain (`/internal/drain`):
  its requests in flight finish, then it exits 0, which a supervisor takes as
  "retired", not "crashed".
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from pdserve.router.autoscale import PoolLoad, decide

POOL_ROLES = ("prefill", "decode")
MAX_POOL_SIZE = 256  # a typo in a scale command must not ask for ten thousand processes


@dataclass
class PoolSizes:
    wanted: dict[str, int] | None = None  # None: nobody said yet (fresh router); a role absent: unmanaged
    min_size: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    max_size: dict[str, int] = field(default_factory=lambda: {"prefill": MAX_POOL_SIZE, "decode": MAX_POOL_SIZE})
    supervisor_seen_s: float | None = None  # last time a supervisor polled
    changes: list[dict] = field(default_factory=list)  # recent changes, newest last (bounded)

    def supervised(self, now_s: float | None = None, within_s: float = 10.0) -> bool:
        now_s = time.monotonic() if now_s is None else now_s
        return self.supervisor_seen_s is not None and now_s - self.supervisor_seen_s < within_s

    def set(self, sizes: dict[str, int], by: str) -> dict[str, int]:
        """Set wanted sizes (bounded by min/max and MAX_POOL_SIZE); returns them."""
        wanted = dict(self.wanted or {})
        for role, n in sizes.items():
            wanted[role] = max(self.min_size[role], min(self.max_size[role], n))
        if all(r in wanted for r in POOL_ROLES) and sum(wanted[r] for r in POOL_ROLES) < 1:
            raise ValueError("a deployment needs at least one worker")
        if wanted != self.wanted:
            self.changes.append({"time": time.time(), "by": by, "from": self.wanted, "to": dict(wanted)})
            del self.changes[:-64]
        self.wanted = wanted
        return dict(wanted)


_DELTA = re.compile(r"^([+-]?)(\d{1,4})$")


def parse_change(current: int, spec) -> int:
    """`+1` / `-2` relative to the current size, `3` absolute (also as an int)."""
    if isinstance(spec, bool):
        raise ValueError("a pool size must be a number like 2, +1 or -1")
    if isinstance(spec, int):
        return spec
    m = _DELTA.match(str(spec).strip())
    if not m:
        raise ValueError(f"a pool size must be a number like 2, +1 or -1, not {spec!r}")
    sign, n = m.group(1), int(m.group(2))
    return current + n if sign == "+" else current - n if sign == "-" else n


def pick_to_retire(workers, n: int) -> list:
    """The `n` workers to drain away: the least busy first (fewest requests to finish),
    the newest among equals (its cache is the coldest)."""

    def busy(w) -> tuple:
        s = w.stats or {}
        return (s.get("num_running", 0) + s.get("num_waiting", 0), -w.registered_s)

    return sorted(workers, key=busy)[: max(0, n)]


class PoolManager:
    """The router's side: keep the registered pools at their wanted sizes (shrinking by
    drains), and let the autoscaler, when on, move the wanted sizes.

    `drain(worker)` asks one worker to drain and exit (async); `pd_advice()` is the
    router's current N_D / N_P recommendation or None."""

    def __init__(self, registry, drain, pd_advice=lambda: None, autoscale=None, log=None):
        self.registry = registry
        self.sizes = PoolSizes()
        self.autoscale = None  # AutoscaleConfig, or None: sizes change only when asked
        self.set_autoscale(autoscale)
        self.pd_advice = pd_advice
        self._drain, self._log = drain, log
        self.last_change_s = float("-inf")
        self.decisions: dict[tuple[str, str], int] = {}  # (role, "up"|"down") -> count
        self.retired = 0

    def set_autoscale(self, cfg) -> None:
        """Turn the autoscaler on (its bounds become the pools' bounds) or off (None)."""
        self.autoscale = cfg
        if cfg is not None:
            for role in POOL_ROLES:
                self.sizes.min_size[role], self.sizes.max_size[role] = cfg.bounds(role)

    def live(self, role: str) -> list:
        """Registered workers of exactly this role that take new work."""
        return [w for w in self.registry.alive() if w.role == role]

    def live_counts(self) -> dict[str, int]:
        return {role: len(self.live(role)) for role in POOL_ROLES}

    def supervisor_poll(self, running: dict[str, int]) -> dict[str, int]:
        """A supervisor reports what it runs; a router with no wanted sizes adopts them."""
        self.sizes.supervisor_seen_s = time.monotonic()
        unsized = [r for r in POOL_ROLES if r not in (self.sizes.wanted or {})]
        if unsized:  # a supervisor manages every pool: those nobody sized keep what it runs
            self.sizes.set({r: int(running.get(r, 0)) for r in unsized}, by="supervisor")
        return dict(self.sizes.wanted)

    def scale(self, changes: dict, by: str = "admin") -> dict[str, int]:
        """Set the wanted size of the pools named (+1 / -1 count from the wanted size, or from
        the live one for a pool not managed yet); the others are left as they are."""
        base = self.sizes.wanted or {}
        live = self.live_counts()
        sizes = {
            role: parse_change(base.get(role, live[role]), spec)
            for role, spec in changes.items()
            if role in POOL_ROLES and spec is not None
        }
        if not sizes:
            raise ValueError("name a pool to scale: prefill and/or decode")
        for role, n in sizes.items():
            if not 0 <= n <= MAX_POOL_SIZE:
                raise ValueError(f"{role} pool size must be within 0..{MAX_POOL_SIZE}, not {n}")
        self.last_change_s = time.monotonic()  # an operator's change resets the autoscaler's cool-down
        return self.sizes.set({**base, **sizes}, by=by)

    async def tick(self, now_s: float | None = None) -> None:
        """One round: maybe an autoscale step, then drain what is over its wanted size."""
        now_s = time.monotonic() if now_s is None else now_s
        if self.autoscale is not None and self.sizes.wanted is not None:
            self._autoscale(now_s)
        if self.sizes.wanted is None:
            return
        for role in POOL_ROLES:
            if role not in self.sizes.wanted:  # nobody sized it: not ours to shrink
                continue
            extra = len(self.live(role)) - self.sizes.wanted[role]
            for w in pick_to_retire(self.live(role), extra):
                await self.retire(w)

    async def retire(self, w) -> None:
        """Stop placing on w at once, and ask it to drain and exit."""
        w.stats = {**(w.stats or {}), "draining": True}
        self.retired += 1
        if self._log:
            wanted = (self.sizes.wanted or {}).get(w.role)
            self._log.info(
                "retiring worker %s (%s): the pool is over its wanted size (%s; `pdserve scale` changes it)",
                w.worker_id,
                w.role,
                wanted,
            )
        await self._drain(w)

    def _autoscale(self, now_s: float) -> None:
        d = decide(
            self.autoscale, self._load("prefill"), self._load("decode"), self.pd_advice(), now_s - self.last_change_s
        )
        if d is None:
            return
        self.last_change_s = now_s
        current = self.sizes.wanted.get(d.role, len(self.live(d.role)))
        self.sizes.set({d.role: current + d.delta}, by=f"autoscale: {d.reason}")
        key = (d.role, "up" if d.delta > 0 else "down")
        self.decisions[key] = self.decisions.get(key, 0) + 1
        if self._log:
            self._log.info("autoscale: %s pool %+d (%s) -> wanted %s", d.role, d.delta, d.reason, self.sizes.wanted)

    def _load(self, role: str) -> PoolLoad:
        ws = self.live(role)
        stats = [w.stats or {} for w in ws]
        blocks = sum(s.get("num_blocks", 0) for s in stats)
        free = sum(s.get("num_free_blocks", 0) for s in stats)
        return PoolLoad(
            workers=len(ws),
            running=sum(s.get("num_running", 0) for s in stats),
            waiting=sum(s.get("num_waiting", 0) for s in stats),
            kv_usage=1 - free / blocks if blocks else 0.0,
        )

    def status(self) -> dict:
        return {
            "wanted": self.sizes.wanted,
            "live": self.live_counts(),
            "supervised": self.sizes.supervised(),
            "min": self.sizes.min_size,
            "max": self.sizes.max_size,
            "changes": self.sizes.changes[-8:],
            "autoscale": vars(self.autoscale) if self.autoscale is not None else None,
            "retired": self.retired,
        }
