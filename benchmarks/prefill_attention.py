"""The C++ flash prefill kernel (bf16 caches) vs torch's SDPA, per layer, SmolLM2-135M shapes.

One fresh prompt of L tokens (9 query heads, 3 KV heads, head_dim 64): torch runs
`F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)` on the
contiguous bf16 K/V, the kernel reads the same K/V from a paged cache of 16-token
blocks. The two alternate, round by round (the machine is shared: only paired
figures mean anything); printed per L: median ms with min-max, and GFLOP/s of
causal work (4 * D * H * L^2 / 2 flops).

    .venv/bin/python benchmarks/prefill_attention.py --threads 2 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.engine import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def case(n: int):
    """(kernel call, torch call, flops) on random bf16 numbers for one n-token prompt."""
    kernels = cpu_kernels.load()
    # its loops on OpenMP's team, as the engine runs them in a prefill step (beside torch's ops)
    kernels.set_parallel_mode("omp")
    q = torch.randn(n, HEADS, HEAD_DIM).bfloat16()
    k = torch.randn(n, KV_HEADS, HEAD_DIM).bfloat16()
    v = torch.randn(n, KV_HEADS, HEAD_DIM).bfloat16()
    blocks = (n + BLOCK - 1) // BLOCK
    kc = torch.zeros(blocks * BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    kc[:n], vc[:n] = k, v
    kc, vc = kc.view(blocks, BLOCK, KV_HEADS, HEAD_DIM), vc.view(blocks, BLOCK, KV_HEADS, HEAD_DIM)
    spans, tables = torch.tensor([[0, n, n]]), torch.arange(blocks).view(1, -1)
    out = torch.empty_like(q)
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))

    def ours():
        kernels.prefill_attention(out, q, kc, vc, spans, tables, HEAD_DIM**-0.5)

    def sdpa():
        F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True)

    return ours, sdpa, 4 * HEAD_DIM * HEADS * n * n / 2


def timed(fn, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_kernels.load() is None or not hasattr(cpu_kernels.load(), "prefill_attention"):
        raise SystemExit("the C++ kernels are not available here")
    for n in args.lengths:
        ours, sdpa, flops = case(n)
        reps = max(1, int(2e9 / flops))  # ~a few tenths of a second per timing
        times = {"kernel": [], "torch sdpa": []}
        ours(), sdpa()  # warm up
        for _ in range(args.rounds):
            times["kernel"].append(timed(ours, reps))
            times["torch sdpa"].append(timed(sdpa, reps))
        for name, ts in times.items():
            med = statistics.median(ts)
            print(
                f"L={n:5d} {name:10s} {med * 1e3:7.2f} ms ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f})"
                f"  {flops / med / 1e9:5.0f} GFLOP/s"
            )
        ratios = [b / a for a, b in zip(times["kernel"], times["torch sdpa"])]
        print(
            f"L={n:5d} speed-up, median of paired rounds: {statistics.median(ratios):.2f}x "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )


if __name__ == "__main__":
    main()
