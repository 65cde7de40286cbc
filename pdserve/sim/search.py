"""`pdserve sim --search`: the cheapest layout that meets an SLO-attainment target (DistServe-style).

DistServe sizes prefill and decode separately and then replicates; here the
whole cluster is simulated for each candidate, so queueing, prefix hits and
KV pressure are in the answer. Per TP combination the instance counts are
searched, not enumerated: attainment only grows with more instances of a
pool, so for each prefill count the smallest decode count that passes is
found by bisection, and prefill counts stop once they alone cost more GPUs
than the best layout found. Every simulated layout is printed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from pdserve.sim.deploy import Layout

COLUMNS = ("layout", "gpus", "SLO %", "goodput/s", "goodput/s/GPU", "P99 TTFT ms", "P99 TPOT ms", "ok")


class _Searcher:
    def __init__(self, args, run, target_pct: float, max_gpus: int, max_runs: int = 200):
        self.args, self.run, self.target, self.max_gpus, self.max_runs = args, run, target_pct, max_gpus, max_runs
        self.rows: list[tuple] = []
        self.seen: dict[str, bool] = {}
        self.best: tuple | None = None  # (gpus, -goodput, layout, result)

    def ok(self, layout: Layout) -> bool:
        key = layout.label()
        if key in self.seen:
            return self.seen[key]
        if len(self.seen) >= self.max_runs:
            raise StopIteration
        try:
            res = self.run(layout)
        except ValueError as e:  # the model does not fit this TP
            print(f"  {key}: skipped ({e})", file=sys.stderr)
            self.seen[key] = False
            return False
        att = res.get("slo_attainment_pct") or 0.0
        good = res.get("request_goodput") or 0.0
        passed = att >= self.target
        self.seen[key] = passed
        self.rows.append(
            (
                key,
                layout.gpus,
                att,
                good,
                good / layout.gpus,
                res.get("p99_ttft_ms"),
                res.get("p99_tpot_ms"),
                "yes" if passed else "",
            )
        )
        print(f"  tried {key}: {layout.gpus} GPUs, SLO attainment {att:.1f}%", file=sys.stderr)
        if passed:
            cand = (layout.gpus, -good, key, layout)
            if self.best is None or cand[:3] < self.best[:3]:
                self.best = cand
        return passed

    def budget(self) -> int:
        return self.best[0] if self.best else self.max_gpus

    def collocated(self, mode: str, tp: int) -> None:
        n = _smallest(lambda k: self.ok(Layout(mode, instances=k, tp=tp)), 1, self.budget() // tp)
        del n

    def disagg(self, ptp: int, dtp: int) -> None:
        p = 1
        while p * ptp + dtp <= self.budget():
            hi = (self.budget() - p * ptp) // dtp
            d = _smallest(
                lambda k, p=p: self.ok(Layout("disagg", prefill=p, decode=k, prefill_tp=ptp, decode_tp=dtp)), 1, hi
            )
            if d == 1 and self.seen.get(Layout("disagg", prefill=p, decode=1, prefill_tp=ptp, decode_tp=dtp).label()):
                break  # more prefill cannot be cheaper
            p += 1


def _smallest(passes, lo: int, hi: int) -> int | None:
    """Smallest k in [lo, hi] with passes(k), assuming passes is monotone; None if hi fails."""
    if hi < lo or not passes(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if passes(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def search(args, simulate: Callable[[Layout], dict], goodput) -> int:
    """Simulate layouts (`simulate(layout)`: the run's result) from the smallest up and print
    the cheapest that meets the SLOs in `goodput`."""
    if not goodput:
        raise ValueError("--search needs SLOs: --goodput ttft:MS tpot:MS")
    tps = [int(t) for t in args.search_tp.split(",") if t.strip()]
    modes = [m.strip() for m in args.search_modes.split(",") if m.strip()]
    s = _Searcher(args, simulate, args.search_target_pct, args.search_max_gpus)
    try:
        for tp in tps:
            for mode in modes:
                if mode != "disagg":
                    s.collocated(mode, tp)
        if "disagg" in modes:
            for ptp in tps:
                for dtp in tps:
                    s.disagg(ptp, dtp)
    except StopIteration:
        print("search: stopped after the maximum number of simulations", file=sys.stderr)
    print(format_table(s.rows))
    if s.best is None:
        print(f"no layout up to {args.search_max_gpus} GPUs reaches {args.search_target_pct:g}% SLO attainment")
        return 1
    print(f"cheapest: {s.best[2]} on {s.best[0]} GPUs ({-s.best[1]:.2f} good requests/s)")
    return 0


def format_table(rows: list[tuple]) -> str:
    out = [" | ".join(COLUMNS), " | ".join("---" for _ in COLUMNS)]
    for r in sorted(rows, key=lambda r: (r[1], r[0])):
        cells = [
            r[0],
            str(r[1]),
            f"{r[2]:.1f}",
            f"{r[3]:.2f}",
            f"{r[4]:.3f}",
            "n/a" if r[5] is None else f"{r[5]:.0f}",
            "n/a" if r[6] is None else f"{r[6]:.1f}",
            r[7],
        ]
        out.append(" | ".join(cells))
    return "\n".join(out)
