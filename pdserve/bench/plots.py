"""PNG plots of a result dict: latency CDFs, and a token timeline that shows decode stalls.

They read only the result dict (also as loaded back from its JSON file), so a
run can be plotted again later. matplotlib is imported here and nowhere else:
the rest of pdserve installs and runs without it.
"""

from __future__ import annotations

import os

import numpy as np


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plots need matplotlib: pip install 'pdserve[bench]' (or matplotlib)") from None
    matplotlib.use("Agg")  # files only; never open a window
    import matplotlib.pyplot as plt

    return plt


def token_times(result: dict) -> list[np.ndarray]:
    """Absolute time (s from the benchmark start) of each output chunk of each request."""
    out = []
    for start, ttft, itl in zip(result["start_times"], result["ttfts"], result["itls"]):
        if ttft <= 0 and not itl:  # nothing arrived
            out.append(np.zeros(0))
            continue
        out.append(start + ttft + np.concatenate(([0.0], np.cumsum(itl))))
    return out


def _by_tag(result: dict) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(result.get("tags") or ["default"] * len(result["ttfts"])):
        groups.setdefault(t, []).append(i)
    return groups


def _cdf(ax, values_ms, label):
    v = np.sort(np.asarray(values_ms, dtype=float))
    if v.size:
        ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=f"{label} (n={v.size})")


def plot_cdfs(result: dict, path: str, title: str = "") -> str:
    """TTFT, TPOT and ITL CDFs of the completed requests, one line per tag."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for tag, idx in _by_tag(result).items():
        ok = [i for i in idx if not result["errors"][i]]
        ttft = [result["ttfts"][i] * 1e3 for i in ok]
        tpot = [
            (result["e2els"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1) * 1e3
            for i in ok
            if result["output_lens"][i] > 1
        ]
        itl = [x * 1e3 for i in ok for x in result["itls"][i]]
        for ax, values in zip(axes, (ttft, tpot, itl)):
            _cdf(ax, values, tag)
    for ax, name in zip(axes, ("TTFT", "TPOT", "ITL")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        if ax.has_data():
            lo, hi = ax.dataLim.x0, ax.dataLim.x1
            if lo > 0 and hi / lo > 30:  # a long tail (a stall) next to the body: log scale shows both
                ax.set_xscale("log")
            ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_timeline(result: dict, path: str, title: str = "", mark_tag: str = "long") -> str:
    """Top: one row per request (send to last chunk), a dot per output chunk, so a decode
    stall is a gap in many rows at once. Bottom: every ITL at the time it ended; a stall
    is a spike. Dotted lines mark when requests tagged `mark_tag` were sent."""
    plt = _pyplot()
    from matplotlib.collections import LineCollection

    times = token_times(result)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(14, 8), sharex=True, height_ratios=[2, 1])
    order = sorted(range(len(times)), key=lambda i: result["start_times"][i])
    row = {i: r for r, i in enumerate(order)}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (tag, idx) in enumerate(_by_tag(result).items()):
        c = colors[k % len(colors)]
        segments = [
            [(result["start_times"][i], row[i]), (times[i][-1] if times[i].size else result["start_times"][i], row[i])]
            for i in idx
        ]
        # one collection, not one line object per request: thousands of requests stay fast
        top.add_collection(
            LineCollection(
                segments,
                colors=c,
                linewidths=0.6,
                alpha=0.4,
                linestyles=["-" if not result["errors"][i] else ":" for i in idx],
            )
        )
        xs = np.concatenate([times[i] for i in idx]) if idx else np.zeros(0)
        ys = np.concatenate([np.full(times[i].size, row[i]) for i in idx]) if idx else np.zeros(0)
        top.scatter(xs, ys, s=2, color=c, label=tag, linewidths=0)
        itl_t = np.concatenate([times[i][1:] for i in idx if times[i].size > 1] or [np.zeros(0)])
        itl_v = np.concatenate([np.asarray(result["itls"][i]) * 1e3 for i in idx if times[i].size > 1] or [np.zeros(0)])
        bottom.scatter(itl_t, itl_v, s=3, color=c, label=tag, linewidths=0)
    for i, tag in enumerate(result.get("tags") or []):
        if tag == mark_tag:
            for ax in (top, bottom):
                ax.axvline(result["start_times"][i], color="gray", ls=":", lw=0.8)
    _others_cpu(bottom, result)
    top.set_ylabel("request (by send time)")
    top.yaxis.get_major_locator().set_params(integer=True)
    top.legend(fontsize=8, loc="upper left", markerscale=4)
    bottom.set_ylabel("inter-token latency (ms)")
    bottom.set_xlabel("time since benchmark start (s)")
    if bottom.has_data():
        bottom.set_yscale("log")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.suptitle(title or "per-request token timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _others_cpu(ax, result: dict) -> None:
    """When the result carries it (benchmarks/interference.py), the share of the machine that
    processes outside the run took, on a second axis: a stall under a burst of it is load."""
    trace = (result.get("cpu") or {}).get("others_share_trace") or []
    if not trace:
        return
    t, share = np.asarray(trace, dtype=float).T
    twin = ax.twinx()
    twin.step(t, share * 100, where="post", color="gray", lw=0.8, alpha=0.7)
    twin.set_ylim(0, 100)
    twin.set_ylabel("others' CPU, % of machine", color="gray", fontsize=8)


def save_plots(result: dict, out_dir: str, prefix: str = "bench", title: str = "") -> list[str]:
    """Write `<prefix>_cdf.png` and `<prefix>_timeline.png` into out_dir; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    return [
        plot_cdfs(result, os.path.join(out_dir, f"{prefix}_cdf.png"), title),
        plot_timeline(result, os.path.join(out_dir, f"{prefix}_timeline.png"), title),
    ]
