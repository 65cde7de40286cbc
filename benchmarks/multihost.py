"""One host vs three hosts, by hand vs on Ray: the same workload, side by side, in one run.

Hosts are network namespaces on one bridge (pdserve.testing.netns), so "three
hosts" adds what a network hop costs in the kernel (veth, bridge, TCP over a
real interface instead of one stack), not what a physical NIC and switch add.
The deployments, all up at once, idle while another runs:

- `one-host`: router, prefill and decode worker on one host, KV by TCP;
- `one-host-shm`: the same, KV by shared memory (what `auto` picks there);
- `three-hosts`: router, prefill, decode on three hosts, started by hand, KV by TCP;
- `ray`: `pdserve serve --ray --placement spread` on a three-node Ray cluster
  (head with the router on the first host, prefill and decode on the others).

Each round sends the workload to every deployment in turn (a fresh order each
round); reported: per deployment the median over rounds of mean TTFT, mean TPOT
and output throughput, and the median of the per-round ratios to `one-host`
with their range. The network hop's added latency is three-hosts' TTFT minus
one-host's, as the median of paired rounds.

    .venv/bin/python benchmarks/multihost.py [--rounds 3] [--num-prompts 16] [--out results/multihost.json]

Needs root (namespaces) and Ray (`pip install 'pdserve[ray]'`). Results in docs/deploy.md.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pdserve.bench import datasets
from pdserve.bench.runner import run_benchmark
from pdserve.bench.tokens import TokenSource
from pdserve.engine.loader import default_model_path
from pdserve.testing.multihost import HostDeployment, RayDeployment
from pdserve.testing.netns import Hosts
from pdserve.testing.ray_cluster import RayCluster

TCP = ["--kv-transport", "tcp", "--kv-shm-dir", ""]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="GGUF or HF dir (default: the embedded SmolLM2-135M)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--max-concurrency", type=int, default=4)
    p.add_argument("--no-ray", action="store_true", help="skip the Ray deployment")
    p.add_argument("--out", default=None, help="write the raw rounds and the summary as JSON here")
    return p.parse_args()


def measure(url: str, requests) -> dict:
    r = run_benchmark(requests, url, max_concurrency=ARGS.max_concurrency, ignore_eos=True)
    if r["failed"]:
        raise RuntimeError(f"{r['failed']} requests failed at {url}: {r['error_counts']}")
    return {"ttft_ms": r["mean_ttft_ms"], "tpot_ms": r["mean_tpot_ms"], "output_tok_s": r["output_throughput"]}


def summarize(rounds: list[dict]) -> dict:
    names = list(rounds[0])
    out = {}
    for name in names:
        row = {}
        for key in ("ttft_ms", "tpot_ms", "output_tok_s"):
            vals = [r[name][key] for r in rounds]
            ratios = [r[name][key] / r["one-host"][key] for r in rounds]
            row[key] = statistics.median(vals)
            row[key + "_ratio"] = statistics.median(ratios)
            row[key + "_ratio_range"] = [min(ratios), max(ratios)]
        out[name] = row
    hop = [r["three-hosts"]["ttft_ms"] - r["one-host"]["ttft_ms"] for r in rounds]
    out["network_hop_added_ttft_ms"] = {"median": statistics.median(hop), "range": [min(hop), max(hop)]}
    return out


def table(summary: dict) -> str:
    """Markdown: each deployment's medians, and its ratio to one-host (median [min-max] of rounds)."""

    def cell(row, key, fmt):
        lo, hi = row[key + "_ratio_range"]
        return f"{row[key]:{fmt}} ({row[key + '_ratio']:.2f}x [{lo:.2f}-{hi:.2f}])"

    lines = ["| deployment | mean TTFT ms | mean TPOT ms | output tok/s |", "|---|---:|---:|---:|"]
    for name, row in summary.items():
        if name.startswith("network_hop"):
            continue
        lines.append(
            f"| {name} | {cell(row, 'ttft_ms', '.0f')} | {cell(row, 'tpot_ms', '.1f')} | "
            f"{cell(row, 'output_tok_s', '.1f')} |"
        )
    hop = summary["network_hop_added_ttft_ms"]
    lines.append(
        f"\nnetwork hop (three-hosts - one-host, paired): {hop['median']:+.1f} ms TTFT "
        f"[{hop['range'][0]:+.1f} to {hop['range'][1]:+.1f}]"
    )
    return "\n".join(lines)


def main() -> int:
    model = ARGS.model or default_model_path()
    tokens = TokenSource.from_path(model)
    requests = datasets.random(ARGS.num_prompts, ARGS.input_len, ARGS.output_len, tokens, seed=1)
    engine = ["--threads", "1", "--num-gpu-blocks", "512"]  # 8 deployments' workers share 24 GiB
    deployments, cluster = {}, None
    with Hosts(6) as hosts:
        try:
            deployments["one-host"] = HostDeployment(hosts[0], [hosts[0]], [hosts[0]], model, worker_args=engine + TCP)
            deployments["one-host-shm"] = HostDeployment(hosts[1], [hosts[1]], [hosts[1]], model, worker_args=engine)
            deployments["three-hosts"] = HostDeployment(
                hosts[2], [hosts[3]], [hosts[4]], model, worker_args=engine + TCP
            )
            if not ARGS.no_ray:
                # its head (and router) on a host of its own; its worker nodes beside the by-hand workers
                cluster = RayCluster([hosts[5], hosts[3], hosts[4]], cpus_per_node=2)
                deployments["ray"] = RayDeployment(cluster, model, serve_args=["--placement", "spread", *engine[2:]])
            for d in deployments.values():  # warm-up, not measured: first requests pay one-time costs
                measure(d.url, requests[:4])
            rounds = []
            rng = random.Random(0)
            for i in range(ARGS.rounds):
                order = list(deployments)
                rng.shuffle(order)
                rounds.append({name: measure(deployments[name].url, requests) for name in order})
                print(json.dumps({"round": i, **rounds[-1]}), flush=True)
        finally:
            for d in deployments.values():
                d.stop()
            if cluster is not None:
                cluster.stop()
    summary = summarize(rounds)
    print(table(summary))
    if ARGS.out:
        with open(ARGS.out, "w") as f:
            json.dump({"args": vars(ARGS), "rounds": rounds, "summary": summary, "time": time.time()}, f, indent=2)
    return 0


if __name__ == "__main__":
    ARGS = parse_args()
    raise SystemExit(main())
