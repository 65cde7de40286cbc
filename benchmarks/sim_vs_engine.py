"""Does `pdserve sim` predict what our engine measures on this machine?

Reads a result directory of benchmarks/interference.py (the contract is in its
docstring): `workload.json` (the mixed workload's parameters, the resolved
configs, every request's prompt and output tokens and kind) and
`<config>.json`, the `pdserve bench` result of each configuration. For each
configuration it simulates the same requests, sent at the measured send times
(`start_times`; the chats are a closed loop, so their send times depend on the
server: replaying them keeps the comparison about latency, not arrival), on
the same engine settings, with the step-time profile `pdserve sim --calibrate`
measured for its thread count. Then it prints measured vs predicted mean and
P99 TTFT and TPOT, over all requests and over the chats alone.

    python benchmarks/sim_vs_engine.py --results /tmp/interference [--calibrate]

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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pdserve.config import SchedulerConfig  # noqa: E402
from pdserve.sim.cluster import Cluster  # noqa: E402
from pdserve.sim.deploy import Hardware, Layout, build  # noqa: E402
from pdserve.sim.latency import ProfileLatency  # noqa: E402
from pdserve.sim.workload import SimRequest  # noqa: E402

CONTENDED_SHARE = 0.10  # others' share of the machine above which a measured run says little about the engine
METRICS = (("mean_ttft_ms", 0.10), ("mean_tpot_ms", 0.10), ("p99_ttft_ms", 0.20), ("p99_tpot_ms", 0.20))
ENGINE_MAX_NUM_SEQS = 64  # SchedulerConfig's default, what the servers ran with


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", required=True, help="interference.py --out-dir (workload.json + <config>.json)")
    p.add_argument("--configs", default=None, help="comma-separated subset (default: every result present)")
    p.add_argument("--profile-dir", default=None, help="where sim-profile-threads<N>.json live (default: --results)")
    p.add_argument("--calibrate", action="store_true", help="(re)measure the profiles first, under --lock")
    p.add_argument("--lock", default="/tmp/pdserve-measure.lock")
    p.add_argument("--kv-bytes-per-s", type=float, default=24.5e9,
                   help="KV link of the disaggregated config (shared memory here: 24.5 GB/s, shared/FINDINGS.md)")
    p.add_argument("--kv-transfer-latency-ms", type=float, default=0.0)
    p.add_argument("--json-out", default=None, help="also write the comparison here")
    return p.parse_args(argv)


def profile_path(args, threads: int) -> str:
    return os.path.join(args.profile_dir or args.results, f"sim-profile-threads{threads}.json")


def calibrate(args, threads: int) -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", "sim", "--calibrate", "--threads", str(threads),
           "--profile", profile_path(args, threads)]
    if args.lock:
        cmd = ["flock", args.lock] + cmd
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def sim_requests(doc: dict, measured: dict) -> list[SimRequest]:
    """The requests the measured run sent (`request_indices` into workload.json, all when absent),
    each sent when it was sent there."""
    starts = measured["start_times"]
    indices = measured.get("request_indices") or list(range(len(starts)))
    out = []
    for k, (i, t) in enumerate(zip(indices, starts)):
        r = doc["requests"][i]
        n = int(r["prompt_tokens"])
        out.append(SimRequest(k, n, int(r["output_tokens"]), float(t), r.get("kind", "default"),
                              token_ids=[-1 - i] * n))
    return out


def simulate(args, cfg: dict, requests: list[SimRequest], goodput: dict) -> dict:
    prof = ProfileLatency.load(profile_path(args, int(cfg["threads"])))
    sched = SchedulerConfig(int(cfg["max_num_batched_tokens"]), int(cfg.get("max_num_seqs", ENGINE_MAX_NUM_SEQS)),
                            bool(cfg["enable_chunked_prefill"]), int(cfg.get("chunk_size_tokens") or 0))
    if cfg["mode"] == "collocated":
        layout = Layout("chunked" if cfg["enable_chunked_prefill"] else "collocated", instances=cfg["pools"]["both"])
    else:
        layout = Layout("disagg", prefill=cfg["pools"]["prefill"], decode=cfg["pools"]["decode"])
    cc = build(layout, Hardware(profile=prof, num_blocks=prof.num_blocks or None), sched,
               block_size=prof.block_size, kv_bytes_per_s=args.kv_bytes_per_s,
               transfer_latency_s=args.kv_transfer_latency_ms / 1000, layerwise=True)
    return Cluster(cc).run(requests, goodput=goodput or None)


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
            rows.append({"scope": scope, "metric": key, "measured": mv, "predicted": pv, "error": err,
                         "target": target, "ok": err is not None and abs(err) <= target})
    return rows


def format_rows(name: str, rows: list[dict]) -> str:
    out = []
    for r in rows:
        err = "n/a" if r["error"] is None else f"{100 * r['error']:+.1f}%"
        out.append(f"| {name} | {r['scope']} | {r['metric']} | {r['measured']:.1f} | {r['predicted']:.1f} | {err} | "
                   f"±{100 * r['target']:.0f}% | {'yes' if r['ok'] else 'no'} |")
    return "\n".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    with open(os.path.join(args.results, "workload.json")) as f:
        doc = json.load(f)
    names = args.configs.split(",") if args.configs else [
        n for n in doc["configs"] if os.path.exists(os.path.join(args.results, f"{n}.json"))]
    threads = sorted({int(doc["configs"][n]["threads"]) for n in names})
    for t in threads:
        if args.calibrate or not os.path.exists(profile_path(args, t)):
            calibrate(args, t)
    goodput = doc.get("params", {}).get("goodput_slos_ms") or {}
    print("| config | requests | metric | measured | predicted | error | target | within |")
    print("|---|---|---|---|---|---|---|---|")
    report = {}
    for name in names:
        with open(os.path.join(args.results, f"{name}.json")) as f:
            measured = json.load(f)
        predicted = simulate(args, doc["configs"][name], sim_requests(doc, measured), goodput)
        rows = compare(measured, predicted)
        report[name] = {"rows": rows, "load_before": measured.get("load_before"), "cpu": measured.get("cpu"),
                        "model": measured.get("model_id"), "requests": len(measured["start_times"])}
        print(format_rows(name, rows), flush=True)
    for name, r in report.items():
        cpu = {k: v for k, v in (r["cpu"] or {}).items() if not isinstance(v, list)}
        share = cpu.get("others_share_of_machine")
        flag = (f"  <- CONTENDED: other processes took {100 * share:.0f}% of the machine; the profile timed the "
                f"engine alone, so this row compares against the contention, not the engine"
                if share is not None and share > CONTENDED_SHARE else "")
        print(f"{name}: {r['requests']} requests of {r['model']}; measured under load {r['load_before']}, "
              f"cpu {json.dumps(cpu)}{flag}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if all(r["ok"] for rep in report.values() for r in rep["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
