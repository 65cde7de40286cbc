"""Does `pdserve sim` predict what our engine measures on this machine?

Reads a result directory of benchmarks/interference.py (the contract is in its
docstring): `workload.json` (the mixed workload's parameters, the resolved
configs, every request's prompt and output tokens and kind) and
`<config>.json`, the `pdserve bench` result of each configuration. For each
configuration it simulates the same requests, sent at the measured send times
(`start_times`; the chats are a closed loop, so their send times depend on the
server: replaying them keeps the comparison about latency, not arrival), on
the same engine settings, with a step-time profile, and prints measured vs
predicted mean and P99 TTFT and TPOT, over all requests and over the chats
alone.

The profile: when interference.py ran with `--calibrate`, the served
calibration grid went through each deployment just before its run, and each
engine process traced its steps; each config's profile (one per role for the
disaggregated one) is fitted to those steps (`pdserve sim --calibrate
--from-trace`). Otherwise, `pdserve sim --calibrate` of the engine alone for
the config's thread count. It also prices the steps the measured run itself
took with that profile: a bias there is the step model; the rest of an error
is queueing and batching.

    python benchmarks/interference.py --calibrate --out-dir /tmp/interference
    python benchmarks/sim_vs_engine.py --results /tmp/interference

Targets (issue 7): means within 10%, P99 within 20%.
Without interference.py's output, `--make-results DIR` produces a small
directory of the same format by running `pdserve serve` + `pdserve bench`
here (collocated configs only).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

from pdserve.config import SchedulerConfig
from pdserve.engine.step_trace import read as read_trace
from pdserve.sim.calibrate import fit_trace, trace_samples
from pdserve.sim.cluster import Cluster
from pdserve.sim.deploy import Hardware, Layout, build
from pdserve.sim.latency import ProfileLatency
from pdserve.sim.workload import SimRequest, from_workload_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CONTENDED_SHARE = 0.10  # others' share of the machine above which a measured run says little about the engine
METRICS = (("mean_ttft_ms", 0.10), ("mean_tpot_ms", 0.10), ("p99_ttft_ms", 0.20), ("p99_tpot_ms", 0.20))
ENGINE_MAX_NUM_SEQS = 64  # SchedulerConfig's default, what the servers ran with


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--results",
        required=True,
        nargs="+",
        help="interference.py --out-dir (workload.json + <config>.json); several: each compared, "
        "then the medians over runs and the engine's own run-to-run spread (see `across`)",
    )
    p.add_argument("--configs", default=None, help="comma-separated subset (default: every result present)")
    p.add_argument("--profile-dir", default=None, help="where sim-profile-threads<N>.json live (default: --results)")
    p.add_argument("--calibrate", action="store_true", help="(re)measure the profiles first, under --lock")
    p.add_argument(
        "--profiles",
        choices=["auto", "served", "engine"],
        default="auto",
        help="served: fit each config's profile(s) to the steps its own deployment ran for the "
        "calibration grid (interference.py --calibrate); engine: `pdserve sim --calibrate` of "
        "the engine alone; auto: served where the results have it",
    )
    p.add_argument("--lock", default="/tmp/pdserve-measure.lock")
    p.add_argument(
        "--kv-bytes-per-s",
        type=float,
        default=24.5e9,
        help="KV link of the disaggregated config (shared memory here: ~24.5 GB/s measured for a 16 MB copy between two processes)",
    )
    p.add_argument("--kv-transfer-latency-ms", type=float, default=0.0)
    p.add_argument(
        "--arrivals",
        choices=["closed-loop", "replay"],
        default="closed-loop",
        help="closed-loop: the simulated client runs the workload as the real one did (chat users "
        "send the next chat when the last ends, until the run's duration); replay: each request "
        "sent when the measured run sent it (a closed loop's send times carry the server's own "
        "latency, so a faster or slower simulated server meets the wrong concurrency)",
    )
    p.add_argument("--json-out", default=None, help="also write the comparison here")
    p.add_argument(
        "--by-step-kind",
        action="store_true",
        help="also price each kind of step (decode batch; prompt size, beside how many decodes, "
        "cached context or not) in the run and in the calibration windows: where a profile "
        "is off, and whether the run's steps ran like the calibration's",
    )
    return p.parse_args(argv)


def profile_path(args, threads: int, results_dir: str) -> str:
    return os.path.join(args.profile_dir or results_dir, f"sim-profile-threads{threads}.json")


def calibrate(args, threads: int, results_dir: str) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "sim",
        "--calibrate",
        "--threads",
        str(threads),
        "--profile",
        profile_path(args, threads, results_dir),
    ]
    if args.lock:
        cmd = ["flock", args.lock] + cmd
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def closed_loop_requests(results_dir: str) -> tuple[list[SimRequest], dict[str, int], float | None]:
    """The workload as the client ran it: every request of workload.json in order, chats (no
    arrival time) through `chat_streams` users who each send the next when the last ends,
    until `chat_duration_s`; the long prompts at their own times (`pdserve sim --workload-json`'s reading)."""
    reqs, doc = from_workload_json(os.path.join(results_dir, "workload.json"))
    params = doc.get("params") or {}
    streams = params.get("chat_streams")
    return reqs, ({"chat": int(streams)} if streams else {}), params.get("chat_duration_s")


def sim_requests(doc: dict, measured: dict) -> list[SimRequest]:
    """The requests the measured run sent (`request_indices` into workload.json, all when absent),
    each sent when it was sent there."""
    starts = measured["start_times"]
    indices = measured.get("request_indices") or list(range(len(starts)))
    out = []
    for k, (i, t) in enumerate(zip(indices, starts)):
        r = doc["requests"][i]
        n = int(r["prompt_tokens"])
        out.append(
            SimRequest(k, n, int(r["output_tokens"]), float(t), r.get("kind", "default"), token_ids=[-1 - i] * n)
        )
    return out


def calibration_windows(st: dict) -> tuple[list[list[float]], list | None]:
    """The served calibration grid's windows on the step traces (before the run and, when sent
    again, after it) and its round-trip probes."""
    cal = st.get("calibration")
    if not cal:
        return [], None
    # results written before the probes: the calibration was its bare window
    window, probes = (cal["window"], cal.get("rtt_probes")) if isinstance(cal, dict) else (cal, None)
    windows = [window]
    after = st.get("calibration_after")
    if after:  # the grid was sent again after the run: fit on both sides of it
        windows.append(after["window"])
        probes = probes + after.get("rtt_probes", [])
    return windows, probes


def served_profiles(measured: dict, cfg: dict) -> tuple[ProfileLatency, ProfileLatency | None] | None:
    """Profiles fitted to the steps the deployment itself ran for the served calibration grid
    (interference.py --calibrate): one for a collocated engine, one per role for (c)."""
    st = measured.get("step_traces") or {}
    windows, probes = calibration_windows(st)
    if not windows:
        return None
    paths = st["paths"]
    role_paths = lambda role: [p for r, p in paths.items() if r.startswith(role)]
    fit = lambda role, beside=None: fit_trace(
        role_paths(role), windows=windows, threads=int(cfg["threads"]), probes=probes, beside=beside, log=lambda m: None
    )
    if cfg["mode"] == "collocated":
        return fit("both"), None
    # the prefill worker as it serves: beside a decoding pool (fit_trace's `beside`)
    return fit("prefill", role_paths("decode")), fit("decode")


def by_role(profiles) -> dict[str, ProfileLatency]:
    """served_profiles' pair keyed by the roles the step traces are named after."""
    return {"both": profiles[0], "prefill": profiles[0], "decode": profiles[1]} if profiles else {}


def priced_steps(measured: dict, profiles: dict[str, ProfileLatency], windows: list[list[float]]):
    """Per traced role with a profile: its steps in `windows` as (shape, predicted s, measured s)."""
    for role, path in (measured.get("step_traces") or {}).get("paths", {}).items():
        prof = profiles.get(role.split("-")[0])
        if prof is None or not os.path.exists(path):
            continue
        yield (
            role,
            [(shape, prof.step_s(shape), t) for w in windows for shape, t in trace_samples(read_trace(path, *w))],
        )


def step_fit(measured: dict, profiles: dict[str, ProfileLatency]) -> dict[str, dict]:
    """How well each profile prices the steps the measured run itself took (its window of the
    same traces): median |error| and the bias of the summed time. A bias here is the step model;
    the rest of a TTFT/TPOT error is queueing and batching."""
    st = measured.get("step_traces") or {}
    if not st.get("run"):
        return {}
    out = {}
    for role, steps in priced_steps(measured, profiles, [st["run"]]):
        if not steps:
            continue
        pred = np.array([p for _, p, _ in steps])
        meas = np.array([t for _, _, t in steps])
        out[role] = {
            "steps": len(steps),
            "median_abs_error": float(np.median(np.abs(pred / meas - 1))),
            "sum_bias": float(pred.sum() / meas.sum() - 1),
            "measured_s": float(meas.sum()),
        }
    return out


def step_kind(shape) -> str:
    """A label that groups steps the profile should price alike."""
    if not shape.prefill_tokens:
        return f"decode {shape.decode_seqs:2d}"
    size = next((b for b in (16, 64, 128, 256, 512, 1024) if shape.prefill_tokens <= b), 2048)
    beside = (
        "0" if not shape.decode_seqs else "1-3" if shape.decode_seqs <= 3 else "4-6" if shape.decode_seqs <= 6 else "7+"
    )
    return f"prompt <={size:4d} beside {beside:>3} decodes{', cached prefix' if shape.prefill_context else ''}"


def step_kinds(measured: dict, profiles: dict[str, ProfileLatency]) -> list[str]:
    """Lines of a table: per role and kind of step, how the profile prices the run's steps and
    the calibration's (sum predicted / sum measured - 1)."""
    st = measured.get("step_traces") or {}
    windows = {"run": [st["run"]] if st.get("run") else [], "calibration": calibration_windows(st)[0]}
    tables: dict[str, dict[str, dict[str, list]]] = {}
    for label, wins in windows.items():
        for role, steps in priced_steps(measured, profiles, wins):
            for shape, pred, t in steps:
                tables.setdefault(role, {}).setdefault(step_kind(shape), {}).setdefault(label, []).append((pred, t))
    lines = []
    for role, table in tables.items():
        lines.append(f"   {role}: kind of step | run: steps, median ms, priced | calibration: steps, median ms, priced")
        for kind in sorted(table):
            cells = []
            for label in windows:
                pairs = np.array(table[kind].get(label, []))
                cells.append(
                    f"{len(pairs):5d} {1e3 * np.median(pairs[:, 1]):8.1f} "
                    f"{pairs[:, 0].sum() / pairs[:, 1].sum() - 1:+7.1%}"
                    if len(pairs)
                    else f"{0:5d}" + " " * 17
                )
            lines.append(f"     {kind:<45} | {cells[0]} | {cells[1]}")
    return lines


def simulate(
    args,
    cfg: dict,
    requests: list[SimRequest],
    goodput: dict,
    profiles: tuple[ProfileLatency, ProfileLatency | None] | None = None,
    tag_concurrency: dict[str, int] | None = None,
    send_until_s: float | None = None,
    results_dir: str = "",
) -> dict:
    prof, dprof = profiles or (ProfileLatency.load(profile_path(args, int(cfg["threads"]), results_dir)), None)
    sched = SchedulerConfig(
        int(cfg["max_num_batched_tokens"]),
        int(cfg.get("max_num_seqs", ENGINE_MAX_NUM_SEQS)),
        bool(cfg["enable_chunked_prefill"]),
        int(cfg.get("chunk_size_tokens") or 0),
    )
    if cfg["mode"] == "collocated":
        layout = Layout("chunked" if cfg["enable_chunked_prefill"] else "collocated", instances=cfg["pools"]["both"])
    else:
        layout = Layout("disagg", prefill=cfg["pools"]["prefill"], decode=cfg["pools"]["decode"])
    cc = build(
        layout,
        Hardware(profile=prof, num_blocks=prof.num_blocks or None, decode_profile=dprof),
        sched,
        block_size=prof.block_size,
        kv_bytes_per_s=args.kv_bytes_per_s,
        transfer_latency_s=args.kv_transfer_latency_ms / 1000,
        layerwise=True,
        tag_concurrency=tag_concurrency,
        client_rtt_s=prof.request_rtt_s,
    )
    return Cluster(cc).run(requests, goodput=goodput or None, send_until_s=send_until_s)


def compare(measured: dict, predicted: dict) -> list[dict]:
    rows = []
    for scope in ("all", "chat"):
        m = measured if scope == "all" else measured.get("by_tag", {}).get("chat")
        p = predicted if scope == "all" else predicted.get("by_tag", {}).get("chat")
        if not m or not p:
            continue
        for key, target in METRICS:
            mv, pv = m.get(key), p.get(key)
            err = None if not mv or pv is None else pv / mv - 1
            rows.append(
                {
                    "scope": scope,
                    "metric": key,
                    "measured": mv,
                    "predicted": pv,
                    "error": err,
                    "target": target,
                    "ok": err is not None and abs(err) <= target,
                }
            )
    return rows


def format_rows(name: str, rows: list[dict]) -> str:
    out = []
    for r in rows:
        err = "n/a" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        out.append(
            f"| {name} | {r['scope']} | {r['metric']} | {r['measured']:.1f} | {r['predicted']:.1f} | {err} | "
            f"±{100 * r['target']:.0f}% | {'yes' if r['ok'] else 'no'} |"
        )
    return "\n".join(out)


def compare_dir(args, results_dir: str, out=print) -> tuple[dict, dict, dict] | None:
    """One result directory: (report per config, the results, their served profiles);
    the table goes to `out`. None when a config lacks the calibration `--profiles served` needs."""
    with open(os.path.join(results_dir, "workload.json")) as f:
        doc = json.load(f)
    names = (
        args.configs.split(",")
        if args.configs
        else [n for n in doc["configs"] if os.path.exists(os.path.join(results_dir, f"{n}.json"))]
    )
    results = {}
    for name in names:
        with open(os.path.join(results_dir, f"{name}.json")) as f:
            results[name] = json.load(f)
    served = {}
    if args.profiles != "engine":
        for name in names:
            served[name] = served_profiles(results[name], doc["configs"][name])
            if served[name] is None and args.profiles == "served":
                print(
                    f"{name}: no calibration window in its step traces (run interference.py --calibrate)",
                    file=sys.stderr,
                )
                return None
    threads = sorted({int(doc["configs"][n]["threads"]) for n in names if not served.get(n)})
    for t in threads:
        if args.calibrate or not os.path.exists(profile_path(args, t, results_dir)):
            calibrate(args, t, results_dir)
    goodput = doc.get("params", {}).get("goodput_slos_ms") or {}
    out("| config | requests | metric | measured | predicted | error | target | within |")
    out("|---|---|---|---|---|---|---|---|")
    report = {}
    for name in names:
        measured = results[name]
        profiles = served.get(name)
        if args.arrivals == "closed-loop":
            reqs, tags, until = closed_loop_requests(results_dir)
            predicted = simulate(args, doc["configs"][name], reqs, goodput, profiles, tags, until, results_dir)
        else:
            predicted = simulate(
                args, doc["configs"][name], sim_requests(doc, measured), goodput, profiles, results_dir=results_dir
            )
        rows = compare(measured, predicted)
        fits = step_fit(measured, by_role(profiles))
        report[name] = {
            "rows": rows,
            "load_before": measured.get("load_before"),
            "cpu": measured.get("cpu"),
            "model": measured.get("model_id"),
            "requests": len(measured["start_times"]),
            "predicted_requests": len(predicted["start_times"]),
            "profiles": "served" if profiles else "engine",
            "step_fit": fits,
            "coef": {role: p.coef for role, p in zip(("prefill_or_both", "decode"), profiles or ()) if p is not None},
        }
        out(format_rows(name, rows))
    return report, results, served


def across(reports: dict[str, dict]) -> list[str]:
    """Several runs of the same experiment: how often the simulator is within target per run;
    the median over runs of each metric's error (the simulator's bias, the runs' noise averaged
    out); and
    the engine against itself: taking the median of the measured runs as the prediction, how
    many metrics of each run are within target (what run-to-run spread alone allows)."""
    lines = ["| run | simulator within target | engine's median of runs within target of this run |", "|---|---|---|"]
    cells: dict[tuple, dict[str, dict]] = {}  # (config, scope, metric) -> run -> row
    for run, report in reports.items():
        for name, rep in report.items():
            for r in rep["rows"]:
                cells.setdefault((name, r["scope"], r["metric"]), {})[run] = r
    own = {run: [0, 0] for run in reports}
    pooled = []
    for (name, scope, metric), by_run in cells.items():
        measured = [r["measured"] for r in by_run.values() if r["measured"]]
        predicted = [r["predicted"] for r in by_run.values() if r["predicted"] is not None]
        target = next(iter(by_run.values()))["target"]
        med = float(np.median(measured))
        for run, r in by_run.items():
            own[run][0] += abs(r["measured"] / med - 1) <= target
            own[run][1] += 1
        # each run's error is paired (its own calibration, its own measurement): their median is the bias
        err = float(np.median([r["error"] for r in by_run.values() if r["error"] is not None]))
        pooled.append(
            f"| {name} | {scope} | {metric} | {len(measured)} | {med:.1f} "
            f"({min(measured) / med - 1:+.0%}..{max(measured) / med - 1:+.0%}) | "
            f"{float(np.median(predicted)):.1f} | {100 * err:+.1f}% | ±{100 * target:.0f}% | "
            f"{'yes' if abs(err) <= target else 'no'} |"
        )
    for run, report in reports.items():
        rows = [r for rep in report.values() for r in rep["rows"]]
        lines.append(f"| {run} | {sum(r['ok'] for r in rows)} / {len(rows)} | {own[run][0]} / {own[run][1]} |")
    lines += [
        "",
        "| config | requests | metric | runs | measured: median (range over runs) | predicted: median "
        "| median of the runs' errors | target | within |",
        "|---|---|---|---|---|---|---|---|---|",
    ] + pooled
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if len(args.results) > 1:
        reports = {}
        for d in args.results:
            got = compare_dir(args, d, out=lambda line: None)
            if got is None:
                return 2
            reports[d] = got[0]
        print("\n".join(across(reports)))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(reports, f, indent=1)
        return 0
    got = compare_dir(args, args.results[0], out=lambda line: print(line, flush=True))
    if got is None:
        return 2
    report, results, served = got
    for name, r in report.items():
        cpu = {k: v for k, v in (r["cpu"] or {}).items() if not isinstance(v, list)}
        share = cpu.get("others_share_of_machine")
        flag = (
            f"  <- CONTENDED: other processes took {100 * share:.0f}% of the machine; contention that "
            f"changes during a run (or between the profile and the run) is not in the profile"
            if share is not None and share > CONTENDED_SHARE
            else ""
        )
        print(
            f"{name}: {r['requests']} requests of {r['model']} ({r['predicted_requests']} simulated); "
            f"measured under load {r['load_before']}, "
            f"cpu {json.dumps(cpu)}{flag}"
        )
        print(
            f"   profiles: {r['profiles']}"
            + "".join(
                f"; {role}: {f['steps']} steps of the run priced with median |error| {100 * f['median_abs_error']:.1f}%"
                f", total {100 * f['sum_bias']:+.1f}%"
                for role, f in r["step_fit"].items()
            )
        )
        if args.by_step_kind and served.get(name):
            print("\n".join(step_kinds(results[name], by_role(served[name]))))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["ok"] for rep in report.values() for r in rep["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
