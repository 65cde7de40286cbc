"""`pdserve serve` in disaggregated mode: a router plus N prefill and M decode workers on this host.

Each part is the same process an operator would start by hand (`pdserve
router`, `pdserve worker`); this launcher only starts them, spreads the
workers over the cores, forwards SIGTERM, and stops everything together.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

ENGINE_FLAGS = ("dtype", "device", "block_size", "num_gpu_blocks", "kv_cache_memory_bytes",
                "max_num_batched_tokens", "max_num_seqs", "max_model_len", "long_prefill_token_threshold")


def _engine_args(args) -> list[str]:
    out = []
    for name in ENGINE_FLAGS:
        v = getattr(args, name, None)
        if v is not None:
            out += [f"--{name.replace('_', '-')}", str(v)]
    if not args.enable_chunked_prefill:
        out.append("--no-enable-chunked-prefill")
    if not args.enable_prefix_caching:
        out.append("--no-enable-prefix-caching")
    if getattr(args, "int8_activations", False):
        out.append("--int8-activations")
    if getattr(args, "policy", "fcfs") != "fcfs":
        out += ["--scheduling-policy", args.policy]
    return out + (["--model", args.model] if args.model else [])


def _admission_args(args) -> list[str]:
    """The router's flags that were set: early rejection (each off unless given), the KV
    bandwidth for its TTFT model, and its timeouts (the router's defaults otherwise)."""
    out = []
    for flag in ("slo_ttft_ms", "slo_tpot_ms", "kv_watermark", "kv_bandwidth_gbps", "worker_timeout_s",
                 "kv_timeout_s"):
        v = getattr(args, flag, None)
        if v is not None:
            out += ["--" + flag.replace("_", "-"), str(v)]
    return out


def launch(args) -> int:
    py = [sys.executable, "-m", "pdserve.cli"]
    router_url = f"http://{args.host}:{args.port}"
    router = py + ["router", "--host", args.host, "--port", str(args.port), "--policy", args.router_policy,
                   "--kv-mode", args.kv_mode, "--log-level", args.log_level, *_admission_args(args)]
    if args.model:
        router += ["--model", args.model]
    if args.api_key:
        router += ["--api-key", args.api_key]
    if args.served_model_name:
        router += ["--served-model-name", *args.served_model_name]
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    procs = [subprocess.Popen(router)]
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode
    for i, role in enumerate(roles):
        cmd = py + ["worker", "--role", role, "--router", router_url, "--host", args.host,
                    "--worker-id", f"{role}-{i}", "--log-level", args.log_level, *_engine_args(args)]
        # one core each while cores last; the threads flag still wins if given
        threads = args.threads or max(1, len(cores) // len(roles))
        cmd += ["--threads", str(threads)]
        if len(roles) <= len(cores) and not args.no_pin:
            cmd += ["--cpu-cores", ",".join(str(c) for c in cores[i * threads:(i + 1) * threads])]
        if not args.kv_layerwise:
            cmd.append("--no-kv-layerwise")
        cmd += ["--kv-wire", args.kv_wire, "--kv-transport", args.kv_transport]
        if getattr(args, "step_trace", None):
            cmd += ["--step-trace", f"{args.step_trace}.{role}-{i}.jsonl"]
        procs.append(subprocess.Popen(cmd))
    return _supervise(procs)


def _supervise(procs: list[subprocess.Popen]) -> int:
    stopping = False

    def stop(sig, frame):
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while procs[0].poll() is None and not stopping:
            time.sleep(0.2)
    finally:
        stop(None, None)
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
    return 0 if stopping else (procs[0].returncode or 1)
