"""The GGUF block kernels against each other and against dense fp32, same run.

For each weight shape and row count: GMAC/s of `gguf_matmul` with the per-row
kernel (blocks decoded in registers, scale applied per activation row), with
the expanded kernel (weight rows expanded to fp32 in L1, 2x4 register tiles),
with the opt-in int8-activation kernel (`q8_matmul` on `q8_repack`ed weights),
and of `x @ W.T` on the dequantized weights; the ratios are against dense.
`gguf_matmul` switches from the first to the second at 8 rows (kExpandFromRows).
The weights are small enough to stay in cache between calls: this measures the
arithmetic, not the memory traffic of a whole model.

`--model-linears` measures that traffic instead: all 121 linears of the embedded
model at batch 1 (96 MB of blocks, from DRAM), fp32 and int8-activation kernels,
for each weight-prefetch distance (`set_prefetch_bytes`; 0 = off), best of 6.

    flock /tmp/pdserve-measure.lock .venv/bin/python benchmarks/gguf_kernels.py --threads 1
    flock /tmp/pdserve-measure.lock .venv/bin/python benchmarks/gguf_kernels.py --threads 2 --model-linears
"""

from __future__ import annotations

import argparse
import sys
import time

import gguf
import numpy as np
import torch

from pdserve.engine import cpu_kernels
from pdserve.engine.gguf_dequant import dequantize

SHAPES = ((3072, 576), (576, 1536))  # SmolLM2-135M's gate/up and down projections
ROWS = (1, 2, 4, 6, 8, 16, 32, 64)


def best_s(fn, reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def model_linears(threads: int) -> None:
    from pdserve import LLM

    distances = (0, 1024, 2048, 4096, 8192)
    for int8 in (False, True):
        llm = LLM(threads=threads, int8_activations=int8)
        model = llm.engine.runner.model
        lins = [
            lin for layer in model.layers for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
        ] + [model.lm_head]
        xs = [torch.randn(1, lin.in_features) for lin in lins]
        mb = sum(lin.qweight.numel() for lin in lins) / 1e6
        k = model.lm_head.kernel
        old = k.set_prefetch_bytes(0)
        best = {d: float("inf") for d in distances}
        for _ in range(6):  # distances interleaved, so the machine's drift hits them alike
            for d in distances:
                k.set_prefetch_bytes(d if d else 1 << 40)
                t = time.perf_counter()
                for lin, x in zip(lins, xs):
                    lin(x)
                best[d] = min(best[d], time.perf_counter() - t)
        k.set_prefetch_bytes(old)
        row = "  ".join(
            f"{d // 1024 if d else 'off'}{'K' if d else ''} {v * 1e3:5.2f} ms ({best[0] / v:4.2f}x)"
            for d, v in best.items()
        )
        print(f"{'int8' if int8 else 'fp32'}: 121 linears, batch 1, {mb:.1f} MB, {threads} thread(s): {row}")
        del llm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--qtype", default="Q4_1", choices=["Q4_0", "Q4_1", "Q8_0"])
    p.add_argument("--reps", type=int, default=50)
    p.add_argument(
        "--model-linears",
        action="store_true",
        help="time the embedded model's linears at batch 1 by prefetch distance instead",
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.model_linears:
        model_linears(args.threads)
        return 0
    k = cpu_kernels.load()
    if k is None:
        print("C++ kernels unavailable here; nothing to compare")
        return 1
    t = gguf.GGMLQuantizationType[args.qtype]
    print(f"{args.qtype}, {args.threads} thread(s); GMAC/s (ratio to dense fp32)")
    for n, kk in SHAPES:
        w = np.random.default_rng(0).standard_normal((n, kk)).astype(np.float32)
        raw = torch.from_numpy(gguf.quants.quantize(w, t))
        dense = dequantize(raw.reshape(-1), args.qtype, n * kk).view(n, kk).contiguous()
        packed = k.q8_repack(raw, int(t), kk)
        print(f"W {n} x {kk}")
        for m in ROWS:
            x = torch.randn(m, kk)
            macs = n * kk * m
            old = k.set_gguf_expand_rows(1 << 30)
            per_row = best_s(lambda: k.gguf_matmul(x, raw, int(t), kk), args.reps)
            k.set_gguf_expand_rows(1)
            expanded = best_s(lambda: k.gguf_matmul(x, raw, int(t), kk), args.reps)
            k.set_gguf_expand_rows(old)
            int8 = best_s(lambda: k.q8_matmul(x, packed, int(t), kk), args.reps)
            fp32 = best_s(lambda: x @ dense.T, args.reps)
            print(
                f"  rows {m:3d}  per-row {macs / per_row / 1e9:5.1f} ({fp32 / per_row:4.2f}x)  "
                f"expanded {macs / expanded / 1e9:5.1f} ({fp32 / expanded:4.2f}x)  "
                f"int8-act {macs / int8 / 1e9:5.1f} ({fp32 / int8:4.2f}x)  dense {macs / fp32 / 1e9:5.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
