"""The interference experiment: do long prompts (collocated with chats) freeze everyone's stream?

The same `mixed` workload (steady chat streams plus periodic long prompts,
`pdserve bench`'s dataset) runs against three deployments of the embedded
model on this host, each started on free 127.0.0.1 ports and always stopped:

    collocated          (a) one engine, 2 threads, no chunked prefill
    collocated_chunked  (b) the same with chunked prefill
    disaggregated       (c) router + 1 prefill + 1 decode worker, 1 thread each, pinned to different cores

and prints one table: the chats' P50/P99 TPOT and ITL, mean/P99 TTFT,
goodput at the same SLOs for all. Plots (CDFs, token timeline) per config.

    python benchmarks/interference.py --out-dir /tmp/interference --img-dir docs/img

Each configuration runs under `flock` on --lock (the lock every measurement on
this shared machine takes), with the load average and the CPU that other
processes took during the run written next to its numbers.

Contract with benchmarks/sim_vs_engine.py: `--out-dir DIR` holds
`workload.json` (the workload parameters, the resolved CONFIGS, and every
request in the order of the result arrays) and `DIR/<config>.json`, the
`pdserve bench` result (vLLM field names, per-request `ttfts` / `itls` /
`start_times`). `CONFIGS` and `resolve_config` are importable. Every engine
process writes a step trace (`DIR/<config>.<role>.steps.jsonl`, see
pdserve/engine/step_trace.py); `<config>.json` has their paths under
`step_traces`, with the measured run's [start, end] and, with `--calibrate`,
the window in which `pdserve sim --calibrate --served`'s grid went through the
same deployment just before the run (what sim_vs_engine.py fits the
simulator's profiles to).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import signal
import subprocess
import sys
import time

from interference_lib import ServerProcess, TreeCpu, build_kernels, format_table, load_str, snapshot, warm_up
from pdserve.bench import TokenSource, datasets, report, run_benchmark, save_plots

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each deployment is, as data the simulator can mirror. `max_num_batched_tokens=None`:
# large enough for a whole burst in one step (no chunking means the whole prompt in one step).
CONFIGS: dict[str, dict] = {
    "collocated": dict(
        label="(a) collocated, 2 threads, no chunked prefill",
        mode="collocated",
        threads=2,
        enable_chunked_prefill=False,
        chunk_size_tokens=0,
        max_num_batched_tokens=None,
        pools={"both": 1},
        pinned=False,
    ),
    "collocated_chunked": dict(
        label="(b) collocated, 2 threads, chunked prefill",
        mode="collocated",
        threads=2,
        enable_chunked_prefill=True,
        chunk_size_tokens=128,
        max_num_batched_tokens=512,
        pools={"both": 1},
        pinned=False,
    ),
    "disaggregated": dict(
        label="(c) disaggregated, 1 prefill + 1 decode, 1 thread each",
        mode="disaggregated",
        threads=1,
        enable_chunked_prefill=True,
        chunk_size_tokens=128,
        max_num_batched_tokens=2048,
        pools={"prefill": 1, "decode": 1},
        pinned=True,
        # the router relays every token and the client reads them: both share the prefill
        # worker's core, so the decode worker's core runs the decode worker only
        cores={"prefill": [0], "decode": [1], "router": [0], "client": [0]},
        kv_transfer="shm, layer-wise push",
        worker_timeout_s=120.0,
        kv_timeout_s=900.0,
    ),
}

# (d): a prefill worker short of compute (long prompts queue) beside a decode worker with slack
# (small batches, ITL far under its SLO): the relaying moves to where the slack is
CONFIGS["disaggregated_relay_on_d"] = dict(
    CONFIGS["disaggregated"],
    label="(d) disaggregated, as (c) but the router and the client on the decode worker's core",
    cores={"prefill": [0], "decode": [1], "router": [1], "client": [1]},
)
# (e): as (d), and conditional disaggregation: the chats' short prompts are prefilled on the
# decode worker, so the prefill worker runs long prompts only, in whole-budget chunks
CONFIGS["disaggregated_local_short"] = dict(
    CONFIGS["disaggregated_relay_on_d"],
    label="(e) disaggregated, as (d), prompts of <= 256 tokens prefilled on the decode worker",
    chunk_size_tokens=0,
    router_flags=["--max-local-prefill-length", "256"],
)

# Engine settings every config leaves at pdserve's defaults (here for the simulator to mirror).
ENGINE_DEFAULTS = dict(
    block_size=16,
    max_num_seqs=64,
    enable_prefix_caching=True,
    kv_cache_memory_bytes=1 << 30,
    dtype="auto (float32 on an AVX2-only CPU, bfloat16 with AVX512-BF16/AMX)",
    model="embedded SmolLM2-135M-Instruct Q4_1 GGUF",
)
# chunk_size_tokens is the engine's --long-prefill-token-threshold: the largest slice of one
# prompt per step; the rest of the step's budget goes to other sequences (decodes, short prompts).


def resolve_config(name: str, workload: datasets.MixedConfig, chunk_size_tokens: int | None = None) -> dict:
    """CONFIGS[name] with every number filled in for this workload."""
    cfg = dict(ENGINE_DEFAULTS, **CONFIGS[name], name=name)
    if chunk_size_tokens is not None and cfg["enable_chunked_prefill"]:
        cfg["chunk_size_tokens"] = chunk_size_tokens
        cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], 2 * chunk_size_tokens)
    if cfg["max_num_batched_tokens"] is None:
        burst = workload.burst_size * workload.long_input_len
        chats = (workload.chat_streams or 8) * workload.chat_input_len
        cfg["max_num_batched_tokens"] = max(2048, burst + chats)
    return cfg


def _engine_flags(cfg: dict, model: str | None) -> list[str]:
    return [
        "--threads",
        str(cfg["threads"]),
        "--max-num-batched-tokens",
        str(cfg["max_num_batched_tokens"]),
        "--long-prefill-token-threshold",
        str(cfg["chunk_size_tokens"]),
        "--enable-chunked-prefill" if cfg["enable_chunked_prefill"] else "--no-enable-chunked-prefill",
    ] + (["--model", model] if model else [])


def trace_paths(cfg: dict, out_dir: str) -> dict[str, str]:
    """Where each engine process of the config writes its step trace (engine/step_trace.py):
    role ("both", "prefill-0", "decode-0", ...) -> path."""
    if "pools" not in cfg:  # a peer's server (interference_vllm.py): no pdserve engine, no trace
        return {}
    if cfg["mode"] == "collocated":
        roles = ["both"]
    else:
        roles = [f"{role}-{i}" for role in ("prefill", "decode") for i in range(cfg["pools"][role])]
    return {r: os.path.abspath(os.path.join(out_dir, f"{cfg['name']}.{r}.steps.jsonl")) for r in roles}


def server_commands(
    cfg: dict, model: str | None, traces: dict[str, str] | None = None
) -> tuple[list[str], list[list[str]]]:
    """The front process (`pdserve serve`, or the router) and the workers that join it.

    Disaggregated workers are started by hand, as `pdserve serve --mode
    disaggregated` would start them (same flags, pinned one core each), because
    the launcher does not pass on the router's --worker-timeout-s / --kv-timeout-s
    and their defaults (3 s, 30 s) are shorter than one prefill step / one long
    prefill on one core of this machine (see docs/interference.md)."""
    py = [sys.executable, "-m", "pdserve.cli"]
    traces = traces or {}
    trace = lambda role: ["--step-trace", traces[role]] if role in traces else []
    if cfg["mode"] == "collocated":
        return py + [
            "serve",
            "--mode",
            "collocated",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            *_engine_flags(cfg, model),
            *trace("both"),
        ], []
    pin = lambda who: (
        ["taskset", "-c", ",".join(map(str, cfg["cores"][who]))]
        if cfg["pinned"] and who in cfg.get("cores", {})
        else []
    )
    router = (
        pin("router")
        + py
        + [
            "router",
            "--host",
            "127.0.0.1",
            "--port",
            "{port}",
            "--policy",
            "cache_aware",
            "--kv-mode",
            "push",
            "--worker-timeout-s",
            str(cfg["worker_timeout_s"]),
            "--kv-timeout-s",
            str(cfg["kv_timeout_s"]),
            *cfg.get("router_flags", []),
        ]
        + (["--model", model] if model else [])
    )
    workers = []
    for role in ("prefill", "decode"):
        for i in range(cfg["pools"][role]):
            cmd = py + [
                "worker",
                "--role",
                role,
                "--router",
                "{url}",
                "--host",
                "127.0.0.1",
                "--worker-id",
                f"{role}-{i}",
                *_engine_flags(cfg, model),
            ]
            if cfg["pinned"]:
                cmd += ["--cpu-cores", ",".join(map(str, cfg["cores"][role]))]
            workers.append(cmd + ["--kv-transport", "auto", *trace(f"{role}-{i}")])
    return router, workers


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = datasets.MixedConfig()
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of " + ", ".join(CONFIGS))
    p.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded SmolLM2-135M)")
    p.add_argument("--chat-streams", type=int, default=6, help="chat users in a closed loop")
    p.add_argument("--num-chats", type=int, default=1000, help="at most; --chat-duration usually ends them first")
    p.add_argument(
        "--chat-duration",
        type=float,
        default=130.0,
        help="s: chat users stop sending new chats after this (the run then drains)",
    )
    p.add_argument("--chat-input-len", type=int, default=64)
    p.add_argument("--chat-output-len", type=int, default=48)
    p.add_argument("--long-input-len", type=int, default=2048)
    p.add_argument("--long-output-len", type=int, default=8)
    p.add_argument("--burst-size", type=int, default=d.burst_size)
    p.add_argument("--num-bursts", type=int, default=3)
    p.add_argument("--burst-interval", type=float, default=40.0, help="s between long-prompt bursts")
    p.add_argument("--first-burst", type=float, default=10.0, help="s from the start to the first burst")
    p.add_argument("--chunk-size", type=int, default=None, help="override the chunked configs' chunk size (tokens)")
    p.add_argument(
        "--goodput",
        nargs="+",
        default=["ttft:3000", "tpot:250"],
        help="SLOs in ms, the same for all (3 s to the first token, 4 tokens/s: a reader's pace)",
    )
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.5,
        help="chat lengths uniform in [len*(1-r), len*(1+r)], so the closed loop's users drift apart",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="/tmp/interference")
    p.add_argument("--img-dir", default=None, help="also write the plots here as interference_<config>_*.png")
    p.add_argument("--lock", default="/tmp/pdserve-measure.lock", help="flock'ed around each config ('' off)")
    p.add_argument(
        "--max-load",
        type=float,
        default=3.0,
        help="before each config, wait for the 1-min load average to drop below this ...",
    )
    p.add_argument(
        "--lock-each",
        action="store_true",
        help="take --lock for each config instead of once for the whole run (~10 min)",
    )
    p.add_argument("--max-wait", type=float, default=60.0, help="... for at most this many s (then run anyway)")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--src",
        default="HEAD",
        help="git ref whose committed tree the servers run (a clean copy), or 'worktree' for this tree",
    )
    p.add_argument("--table-only", action="store_true", help="print the table of the JSONs in --out-dir")
    p.add_argument(
        "--calibrate-background",
        type=int,
        default=0,
        metavar="N",
        help="--calibrate the pinned config (c) with N more streams decoding all along (e.g. "
        "--chat-streams): its router and client share the prefill worker's core, and relaying "
        "tokens slows that worker 8-13%%; a collocated server streams in its own process",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="before each config's run, send `pdserve sim --calibrate --served`'s grid through the "
        "same deployment; its window in the step traces is what sim_vs_engine.py fits",
    )
    return p.parse_args(argv)


def workload_from(args) -> datasets.MixedConfig:
    return datasets.MixedConfig(
        num_chats=args.num_chats,
        chat_input_len=args.chat_input_len,
        chat_output_len=args.chat_output_len,
        chat_streams=args.chat_streams,
        long_input_len=args.long_input_len,
        long_output_len=args.long_output_len,
        burst_size=args.burst_size,
        num_bursts=args.num_bursts,
        burst_interval_s=args.burst_interval,
        first_burst_s=args.first_burst,
    )


def write_workload(path: str, workload: datasets.MixedConfig, requests, configs: dict, args) -> None:
    """The contract with the simulator: parameters, configs, and each request in result-array order."""
    doc = {
        "params": {
            **dataclasses.asdict(workload),
            "chat_duration_s": args.chat_duration,
            "range_ratio": args.range_ratio,
            "seed": args.seed,
            "goodput_slos_ms": _slos(args.goodput),
            "endpoint": "/v1/completions",
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "chat_arrivals": "closed loop: chat_streams users, each sends its next chat when its last one ends, "
        "until chat_duration_s; chats have arrival_s null. In <config>.json the arrays "
        "(start_times, ttfts, itls, ...) describe the requests sent, in the order of "
        "request_indices (indices into this list; all of them when absent)",
        "configs": configs,
        "requests": [
            {
                "index": i,
                "arrival_s": r.arrival_s,
                "prompt_tokens": r.prompt_len,
                "output_tokens": r.output_len,
                "kind": r.tag,
            }
            for i, r in enumerate(requests)
        ],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def _slos(items: list[str]) -> dict[str, float]:
    from pdserve.bench.metrics import parse_goodput

    return parse_goodput(items)


@contextlib.contextmanager
def measurement_lock(path: str):
    """The same lock `flock /tmp/pdserve-measure.lock CMD` takes (flock(2) on the file)."""
    if not path:
        yield
        return
    with open(path, "a") as f:
        t0 = time.monotonic()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.monotonic() - t0
        if waited > 1:
            print(f"  (waited {waited:.0f} s for {path})", flush=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def client_cores(cfg: dict):
    """Pin this process (the benchmark client) where the config says, for the run."""
    cores = cfg.get("cores", {}).get("client") if cfg.get("pinned") else None
    before = os.sched_getaffinity(0)
    if cores:
        os.sched_setaffinity(0, set(cores))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def wait_for_quiet(max_load: float, max_wait_s: float) -> None:
    """Other engineers' tests do not take the measurement lock: give them a moment to finish."""
    t0 = time.monotonic()
    while os.getloadavg()[0] > max_load and time.monotonic() - t0 < max_wait_s:
        time.sleep(5)
    if time.monotonic() - t0 > 5:
        print(f"   waited {time.monotonic() - t0:.0f} s for load < {max_load} (now {load_str()})", flush=True)


def run_config(cfg: dict, requests, workload, args, tokens, server: ServerProcess | None = None) -> dict:
    """Start the config's server (or the one given), warm it up, run the workload, stop it, save."""
    log_path = os.path.join(args.out_dir, f"{cfg['name']}.log")
    traces = trace_paths(cfg, args.out_dir)
    for path in traces.values():
        if os.path.exists(path):
            os.remove(path)  # a trace is appended to: start this config's afresh
    if server is None:
        front, workers = server_commands(cfg, args.model, traces)
        server = ServerProcess(
            [], log_path, args.startup_timeout, cmd=front, extra_cmds=workers, cwd=args.src_dir, env=args.src_env
        )
    print(f"\n== {cfg['name']}: {cfg['label']}", flush=True)
    for c in server.cmds:
        print("   $ " + " ".join(c), flush=True)
    with measurement_lock(args.lock if args.lock_each else ""):
        if server.cwd != REPO:
            build_kernels(server.cwd, server.env)
        wait_for_quiet(args.max_load, args.max_wait)
        load_before = load_str()
        with server, client_cores(cfg):
            warm_up(server.url, tokens)
            background = args.calibrate_background if cfg.get("pinned") else 0
            calibration = calibrate_through(server.url, tokens, background) if args.calibrate else None
            run_since = time.monotonic()
            cpu = TreeCpu(server.pids)
            result = run_benchmark(
                requests,
                server.url,
                tag_concurrency=workload.tag_concurrency(),
                goodput=_slos(args.goodput),
                percentiles=[50, 90, 99],
                ignore_eos=True,
                seed=args.seed,
                progress=True,
                send_until_s=args.chat_duration,
            )
            result["cpu"] = cpu.stop()
            run_until = time.monotonic()
            # the grid again after the run: this shared machine's speed drifts by 5-15% over minutes,
            # and a profile fitted on both sides of the run brackets it
            after = calibrate_through(server.url, tokens, background) if args.calibrate else None
            result["step_traces"] = {
                "paths": traces,
                "clock": "time.monotonic",
                "calibration": calibration,
                "calibration_after": after,
                "run": [run_since, run_until],
            }
        result["load_before"], result["load_after"] = load_before, load_str()
    result.update(
        config=cfg,
        server_cmds=server.cmds,
        dataset_name="mixed",
        source=getattr(args, "source", None),
        **{f"mixed_{k}": v for k, v in dataclasses.asdict(workload).items()},
    )
    path = report.save_json(result, os.path.join(args.out_dir, f"{cfg['name']}.json"))
    print(
        f"   result: {path}  load {result['load_before']} -> {result['load_after']}  others' CPU "
        f"{100 * result['cpu']['others_share_of_machine']:.0f}% of the machine"
    )
    for d in filter(None, [args.out_dir, args.img_dir]):
        for png in save_plots(result, d, prefix=f"interference_{cfg['name']}", title=cfg["label"]):
            print(f"   plot: {png}")
    return result


def calibrate_through(url: str, tokens, background_streams: int = 0) -> dict:
    """The served calibration grid through `url` (the router, for (c)): its [start, end] on the
    step traces' clock and its round-trip probes."""
    import asyncio

    from pdserve.sim.calibrate import drive_grid

    since = time.monotonic()
    probes = asyncio.run(
        drive_grid(url, tokens, log=lambda m: print("   " + m, flush=True), background_streams=background_streams)
    )
    return {"window": [since, time.monotonic()], "rtt_probes": probes, "background_streams": background_streams}


def load_results(out_dir: str, names: list[str]) -> dict[str, dict]:
    """The saved results among `names`, in that order."""
    out = {}
    for n in names:
        path = os.path.join(out_dir, f"{n}.json")
        if os.path.exists(path):
            with open(path) as f:
                out[n] = json.load(f)
    return out


def _sigterm(signum, frame):
    raise KeyboardInterrupt  # so every started server is stopped on the way out


def source_state(src: str) -> dict:
    """Which code was measured: a clean copy of a commit, or this shared tree with its changes named."""

    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()

    if src != "worktree":
        return {"commit": git("rev-parse", src), "dirty": []}
    return {"commit": git("rev-parse", "HEAD"), "dirty": git("status", "--short", "--", "pdserve").splitlines()}


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, _sigterm)
    args = parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        print(f"interference: unknown config(s) {unknown}; known: {list(CONFIGS)}", file=sys.stderr)
        return 2
    os.makedirs(args.out_dir, exist_ok=True)
    if args.table_only:
        print(format_table(load_results(args.out_dir, names + ["vllm"]), _slos(args.goodput)))
        return 0
    workload = workload_from(args)
    # the embedded SmolLM2's 49,152 ids hold the default range; the prompts are token ids
    tokens = TokenSource.from_path(args.model) if args.model else TokenSource()
    requests = datasets.mixed(workload, tokens, seed=args.seed, range_ratio=args.range_ratio)
    configs = {n: resolve_config(n, workload, args.chunk_size) for n in names}
    # one commit for every config, resolved once (others commit while this runs)
    args.source = source_state(args.src)
    args.src_dir, args.src_env = (REPO, None) if args.src == "worktree" else snapshot(args.source["commit"])
    write_workload(os.path.join(args.out_dir, "workload.json"), workload, requests, configs, args)
    print("command: python benchmarks/interference.py " + " ".join(sys.argv[1:] if argv is None else argv))
    print(
        f"workload: {json.dumps(dataclasses.asdict(workload))}, seed {args.seed}, "
        f"goodput SLOs {' '.join(args.goodput)} ms"
    )
    results = {}
    with measurement_lock("" if args.lock_each else args.lock):  # the configs compared under one load
        for name in names:
            try:
                results[name] = run_config(configs[name], requests, workload, args, tokens)
            except (RuntimeError, TimeoutError) as e:
                print(f"   {name} failed: {e}", file=sys.stderr)
    print("\n" + format_table(results, _slos(args.goodput)))
    return 0 if len(results) == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
