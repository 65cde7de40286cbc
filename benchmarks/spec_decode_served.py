"""Speculative decoding as a client sees it: `pdserve serve` (collocated, the embedded model)
with and without `--speculative-config`, measured by `pdserve bench` on chat requests whose
answers copy their prompts (the copy workload of benchmarks/spec_decode.py).

    python benchmarks/spec_decode_served.py [--rounds 3] [--num-prompts 16] [--max-concurrency 4]

Each round starts a server of each kind in turn (the order alternates), runs the same
requests through the OpenAI API, and stops it. Prints the median over the rounds of mean and
P99 TPOT, P99 ITL (one sample per streamed chunk: a chunk of several tokens is one) and
output throughput, with the ratio drafts / no drafts and its spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.spec_decode import COPY  # noqa: E402
from pdserve.config import cpu_description  # noqa: E402
from pdserve.testing.serve import Serve  # noqa: E402

SPEC = '{"method": "ngram", "num_speculative_tokens": 4}'
METRICS = ("mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "output_throughput")


def bench(url: str, dataset: str, out_dir: str, args) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--base-url", url, "--endpoint", "/v1/chat/completions"]
    cmd += ["--dataset-name", "sharegpt", "--dataset-path", dataset, "--num-prompts", str(args.num_prompts)]
    cmd += ["--sharegpt-output-len", str(args.tokens), "--max-concurrency", str(args.max_concurrency)]
    cmd += ["--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,99", "--seed", "0"]
    cmd += ["--save-result", "--result-dir", out_dir, "--result-filename", "r.json"]
    subprocess.run(cmd, check=True, capture_output=True)
    return json.loads(Path(out_dir, "r.json").read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=160)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        dataset = str(Path(tmp, "copy.json"))
        convs = [{"conversations": [{"from": "human", "value": p}, {"from": "gpt", "value": "x " * 100}]} for p in COPY]
        Path(dataset).write_text(json.dumps(convs * 8))
        print(f"CPU: {cpu_description()}; serve --mode collocated, {SPEC}")
        got: dict[str, list[dict]] = {"plain": [], "spec": []}
        for r in range(args.rounds):
            order = ("plain", "spec") if r % 2 == 0 else ("spec", "plain")
            for kind in order:
                flags = ["--mode", "collocated"] + (["--speculative-config", SPEC] if kind == "spec" else [])
                with Serve(flags) as server:
                    got[kind].append(bench_warm(server.url, tmp, dataset, args, f"{kind}-{r}"))
        for m in METRICS:
            a = [x[m] for x in got["plain"]]
            b = [x[m] for x in got["spec"]]
            ratios = [y / x for x, y in zip(a, b)]
            print(
                f"{m:18s} plain {statistics.median(a):8.1f}  spec {statistics.median(b):8.1f}  "
                f"ratio median {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
    return 0


def bench_warm(url: str, tmp: str, dataset: str, args, name: str) -> dict:
    """One measured run after a short warm-up run (kernels, the prefix cache of the prompts)."""
    out = str(Path(tmp, name))
    warm = argparse.Namespace(**{**vars(args), "num_prompts": len(COPY), "tokens": 8})
    bench(url, dataset, out + "-warm", warm)
    return bench(url, dataset, out, args)


if __name__ == "__main__":
    sys.exit(main())
