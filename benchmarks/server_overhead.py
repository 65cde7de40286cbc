"""What the HTTP layer costs: output tokens/s through `pdserve serve` vs the offline engine.

Same workload, same engine flags, same process tree: N requests of random
prompts (input_len tokens, output_len tokens each, EOS ignored). The offline
side calls `LLM.generate` on all of them at once; the server side starts
`pdserve serve` as a subprocess and sends them as concurrent streaming
completions (SSE, include_usage) over loopback. Prints both throughputs and
their ratio (target >= 0.9). Load and warm-up are outside the timed parts.

    python benchmarks/server_overhead.py --threads 2
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import httpx
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from pdserve.engine.cli import add_engine_arguments, engine_kwargs  # noqa: E402


def make_prompts(n: int, input_len: int, vocab: int, special: set[int], seed: int = 0) -> list[list[int]]:
    """Random token ids without special tokens, so no prompt shares a cached prefix with another."""
    rng = np.random.default_rng(seed)
    allowed = np.array([i for i in range(vocab) if i not in special])
    return [rng.choice(allowed, input_len).tolist() for _ in range(n)]


def run_offline(args, prompts, llm) -> dict:
    from pdserve import SamplingParams

    llm.generate(prompts[0][:16], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed_s = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats()
    return {"elapsed_s": elapsed_s, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed_s,
            "preemptions": stats["num_preemptions"]}


async def _stream_one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> dict:
    """One streamed completion. The client shares the 2 cores with the server, so it
    parses as little as it can: it times network reads and decodes only the last
    event (the usage chunk), instead of one JSON document per token."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    stamps, tail = [], b""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for data in r.aiter_bytes():
            stamps.append(time.perf_counter())
            tail = (tail + data)[-4096:]
    events = [e for e in tail.split(b"\n\n") if e.startswith(b"data: {")]
    usage = json.loads(events[-1][6:])["usage"]
    return {"ttft_s": stamps[0] - t0 if stamps else None, "completion_tokens": usage["completion_tokens"],
            "read_gaps_s": [b - a for a, b in zip(stamps, stamps[1:])]}


async def _drive(url: str, prompts, output_len: int) -> tuple[float, list[dict]]:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as client:
        await _stream_one(client, prompts[0][:16], 4)  # warm-up, and opens a connection
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream_one(client, p, output_len) for p in prompts))
        return time.perf_counter() - t0, results


def run_server(args, prompts, llm=None) -> dict:
    port = args.port
    flags = []
    for k, v in engine_kwargs(args).items():
        flag = "--" + ("scheduling-policy" if k == "policy" else k.replace("_", "-"))
        if isinstance(v, bool):
            flags.append(flag if v else flag.replace("--", "--no-", 1))
        elif v is not None:
            flags += [flag, str(v)]
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--mode", "collocated", "--port", str(port),
           "--log-level", "warning",
           "--max-waiting-requests", str(len(prompts) * 2), *flags]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc)
        elapsed_s, results = asyncio.run(_drive(url, prompts, args.output_len))
        health = httpx.get(url + "/health").json()
        metrics = httpx.get(url + "/metrics").text
    finally:
        proc.terminate()
        proc.wait(60)
    tokens = sum(r["completion_tokens"] for r in results)
    itl = [x for r in results for x in r["read_gaps_s"]]
    preempt = [line for line in metrics.splitlines() if line.startswith("pdserve:num_preemptions_total")]
    return {"elapsed_s": elapsed_s, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed_s,
            "median_ttft_s": statistics.median(r["ttft_s"] for r in results),
            "median_itl_s": statistics.median(itl) if itl else None,
            "preemptions": float(preempt[0].rsplit(" ", 1)[1]) if preempt else None,
            "idle_free_blocks": health.get("num_free_blocks")}


def _wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("server did not become ready")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_engine_arguments(p)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=18431)
    p.add_argument("--order", choices=["offline-first", "server-first"], default="offline-first")
    p.add_argument("--repeats", type=int, default=1, help="alternate offline and server runs this many times")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()

    from pdserve import LLM

    # loaded first in either order: its tokenizer picks the prompts, and it sits idle while the server runs
    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.tokenizer
    prompts = make_prompts(args.num_requests, args.input_len, tok.vocab_size, set(tok.special_ids))
    runs = [("offline", run_offline), ("server", run_server)]
    if args.order == "server-first":
        runs.reverse()
    result = {"workload": {"num_requests": args.num_requests, "input_len": args.input_len,
                           "output_len": args.output_len}, "engine": engine_kwargs(args), "runs": []}
    # alternate the two sides so that load from anything else on the machine hits both alike
    for rep in range(args.repeats):
        run = {}
        for name, fn in runs:
            run[name] = fn(args, prompts, llm)
            print(f"[{rep + 1}/{args.repeats}] {name:8s} {run[name]['output_tok_per_s']:8.1f} output tok/s "
                  f"({run[name]['output_tokens']} tokens in {run[name]['elapsed_s']:.1f}s)", flush=True)
        run["ratio"] = run["server"]["output_tok_per_s"] / run["offline"]["output_tok_per_s"]
        s = run["server"]
        print(f"[{rep + 1}/{args.repeats}] ratio {run['ratio']:.3f}; server median TTFT {s['median_ttft_s']:.2f}s, "
              f"median gap between reads {s['median_itl_s'] * 1e3:.0f} ms", flush=True)
        result["runs"].append(run)
    best = {side: max(r[side]["output_tok_per_s"] for r in result["runs"]) for side in ("offline", "server")}
    result["ratio_of_best"] = best["server"] / best["offline"]
    result["median_ratio"] = statistics.median(r["ratio"] for r in result["runs"])
    print(f"offline {best['offline']:.1f} tok/s, server {best['server']:.1f} tok/s (best of {args.repeats}); "
          f"ratio server/offline = {result['ratio_of_best']:.3f} (median of runs {result['median_ratio']:.3f}; "
          f"target >= 0.9)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
