"""Predicted against measured for every held-out point (``heldout.py``).

python -m pdserve.planner.validate     # prints the table docs/planner.md shows
"""

from __future__ import annotations

import statistics

from pdserve.planner import perf
from pdserve.planner import roofline as rl
from pdserve.planner.deployment import Deployment
from pdserve.planner.hardware import resolve_gpu
from pdserve.planner.heldout import SETS
from pdserve.planner.models import resolve_model

GPU_OF_KIND = {"a100": "a100-80gb", "h100": "h100-sxm"}
BAND = (0.75, 1.33)
# how far a run's end-to-end time may stray from its own prompt and token times
CONSISTENCY_TOLERANCE = 0.10


def consistent_run(
    prompt_s: float, token_s: float, e2e_s: float, outputs: int, tol: float = CONSISTENCY_TOLERANCE
) -> bool:
    """Whether a measured run's end-to-end time is its prompt time plus ``outputs - 1`` token
    times, within ``tol``. A run that is not was not one steady batch: requests that did not fit
    the KV cache waited, were preempted and recomputed (its e2e grows by multiples), or generation
    stopped early at an end token (it shrinks). Its token time then is not the step time of the
    batch it is labelled with, and it can neither fit nor check a step-time model."""
    return abs(e2e_ratio(prompt_s, token_s, e2e_s, outputs) - 1.0) <= tol


def e2e_ratio(prompt_s: float, token_s: float, e2e_s: float, outputs: int) -> float:
    """A run's end-to-end time over its prompt time plus ``outputs - 1`` token times."""
    return e2e_s / (prompt_s + (outputs - 1) * token_s)


def predict(kind: str, tp: int, phase: str, tokens: int, batch: int, engine: str = "vidur") -> tuple[float, float]:
    """(fitted, roofline) seconds of one held-out point, with ``engine``'s host costs."""
    dep = Deployment(resolve_model("llama-2-70b"), resolve_gpu(GPU_OF_KIND[kind]), tp=tp, engine=engine)
    if phase == "prefill":
        return perf.prefill_cost(dep, tokens).total_s, rl.prefill_time(dep, tokens).total_s
    return (perf.decode_cost(dep, batch, tokens).total_s, rl.decode_step_time(dep, batch, tokens).total_s)


def rows(engines: dict[str, str] | None = None) -> list[dict]:
    """Every held-out point; ``engines`` maps a set's engine profile to another
    to price it with (the vLLM points under the overlapping reading, say)."""
    out = []
    for s in SETS:
        profile = (engines or {}).get(s["engine_profile"], s["engine_profile"])
        runs = s.get("runs", {})
        for kind, tp, phase, tokens, batch, measured in s["points"]:
            fitted, roof = predict(kind, tp, phase, tokens, batch, profile)
            run = runs.get((kind, tp, phase, tokens, batch))
            consistency = e2e_ratio(*run, s["outputs"]) if run else None
            valid = consistency is None or abs(consistency - 1.0) <= CONSISTENCY_TOLERANCE
            out.append(
                {
                    "engine": s["engine"],
                    "gpu": kind,
                    "tp": tp,
                    "phase": phase,
                    "tokens": tokens,
                    "batch": batch,
                    "measured_s": measured,
                    "predicted_s": fitted,
                    "ratio": fitted / measured,
                    "roofline_ratio": roof / measured,
                    # run = (prompt s, token s, end-to-end s) of the measured run, where the source has them
                    "valid": valid,
                    "e2e_consistency": consistency,
                }
            )
    return out


def summary(rs: list[dict]) -> dict:
    """Scores over the valid points; ``excluded`` counts the runs ``consistent_run`` rejects."""
    scored = [r for r in rs if r["valid"]]
    ratios = [r["ratio"] for r in scored]
    return {
        "points": len(scored),
        "excluded": len(rs) - len(scored),
        "median": statistics.median(ratios),
        "min": min(ratios),
        "max": max(ratios),
        "in_band": sum(BAND[0] <= x <= BAND[1] for x in ratios),
        "roofline_median": statistics.median(r["roofline_ratio"] for r in scored),
    }


def table(rs: list[dict]) -> str:
    head = "| engine | GPU | TP | phase | tokens | batch | measured ms | predicted ms | ratio | roofline ratio |"
    lines = [head, "|" + "---|" * 10]
    for r in rs:
        flag = "" if BAND[0] <= r["ratio"] <= BAND[1] else " *"
        if not r["valid"]:
            flag = f" (excluded: e2e {r['e2e_consistency']:.1f}x its own prompt + token times)"
        lines.append(
            f"| {r['engine']} | {r['gpu'].upper()} | {r['tp']} | {r['phase']} | "
            f"{r['tokens']} | {r['batch']} | {r['measured_s'] * 1e3:.1f} | "
            f"{r['predicted_s'] * 1e3:.1f} | {r['ratio']:.2f}{flag} | "
            f"{r['roofline_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main() -> int:
    rs = rows()
    print(table(rs))
    for engine in dict.fromkeys(r["engine"] for r in rs):
        s = summary([r for r in rs if r["engine"] == engine])
        print(
            f"{engine}: {s['points']} points, median ratio {s['median']:.2f} "
            f"(roofline {s['roofline_median']:.2f}), range {s['min']:.2f}-{s['max']:.2f}, "
            f"{s['in_band']} within {BAND[0]}-{BAND[1]}"
        )
    s = summary(rs)
    print(
        f"all: {s['points']} points, median ratio {s['median']:.2f}, {s['in_band']} within band "
        f"({s['excluded']} more excluded as inconsistent runs)"
    )
    # the other reading of the same engine fit (fitted.ENGINES), not the one the table shows
    alt = rows({"vllm-2023": "vllm-2023-overlap"})
    misses = [r for r in alt if r["valid"] and not BAND[0] <= r["ratio"] <= BAND[1]]
    s = summary(alt)
    print(
        f"all, vLLM priced with vllm-2023-overlap: median ratio {s['median']:.2f}, {s['in_band']} within band; "
        "misses: "
        + ", ".join(
            f"{r['gpu'].upper()} TP{r['tp']} {r['phase']} {r['tokens']}x{r['batch']} {r['ratio']:.2f}" for r in misses
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
