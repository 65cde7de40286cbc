"""Compile pdserve's Triton kernels (attention, fused elementwise) for an NVIDIA GPU on a machine that has none.

Triton's CPU interpreter (what the kernel tests run) accepts code the GPU compiler rejects, and it
says nothing about registers, spills or shared memory. This script drives the real launch wrappers
of ``triton_attention`` and ``triton_elementwise`` with CPU tensors, records each kernel launch they make
(arguments, dtypes, compile-time constants) instead of running it, and compiles that exact kernel
for the target architecture down to a cubin (Triton ships its own ``ptxas``). No GPU, driver or
CUDA toolkit is needed.

    python benchmarks/triton_compile.py                 # sm_90 (H100/H200), the model shapes below
    python benchmarks/triton_compile.py --arch 80 --json out.json

Each line: kernel, shape, dtype, registers per thread, spilled bytes, shared memory, compile time.
Exit status 1 if any kernel fails to compile. Must run with TRITON_INTERPRET unset (the
interpreter replaces the kernels with Python functions).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, query heads, KV heads, head dim, hidden, intermediate): the models the GPU check measures
SHAPES = [("llama3-8b", 32, 8, 128, 4096, 14336), ("smollm2-135m", 9, 3, 64, 576, 1536)]
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192


def triton_type(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        names = {
            torch.float32: "fp32",
            torch.bfloat16: "bf16",
            torch.float16: "fp16",
            torch.int64: "i64",
            torch.int32: "i32",
        }
        return "*" + names[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"cannot type a kernel argument of {type(value).__name__}")


class Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **constexprs)`` records the call."""

    def __init__(self, fn, calls: list):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.calls.append((self.fn, args, constexprs))

        return launch


def record_launches(n_heads: int, n_kv: int, head_dim: int, hidden: int, inter: int, dtype) -> list:
    """The launches a layer makes at this shape: the KV write, decode and prefill attention,
    and (in bf16) the fused norms, RoPE and SiLU * up."""
    import torch

    from pdserve.engine import triton_attention as ta
    from pdserve.engine import triton_elementwise as te

    calls: list = []
    kernels = {
        ta: ("_write_kv_kernel", "_decode_partial_kernel", "_decode_reduce_kernel", "_prefill_kernel"),
        te: ("_rms_norm_kernel", "_rope_kernel", "_silu_mul_kernel"),
    }
    saved = {(mod, name): getattr(mod, name) for mod, names in kernels.items() for name in names}
    try:
        for (mod, name), fn in saved.items():
            setattr(mod, name, Recorder(fn, calls))
        blocks = 8
        k_cache = torch.zeros(blocks, BLOCK_SIZE, n_kv, head_dim, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        tokens = 4
        k = torch.zeros(tokens, n_kv, head_dim, dtype=dtype)
        ta.write_kv_triton(k_cache, v_cache, k, k.clone(), torch.zeros(tokens, dtype=torch.long))
        # decode: block tables as wide as the longest context the engine allows (what the
        # runner and its CUDA graphs pass), so the split-K partition count is the real one
        width = MAX_MODEL_LEN // BLOCK_SIZE
        q = torch.zeros(2, n_heads, head_dim, dtype=dtype)
        tables = torch.zeros(2, width, dtype=torch.long)
        lens = torch.ones(2, dtype=torch.long)
        ta.decode_attention_triton(torch.empty_like(q), q, k_cache, v_cache, tables, lens, head_dim**-0.5)
        q = torch.zeros(tokens, n_heads, head_dim, dtype=dtype)
        spans = torch.tensor([[0, tokens, tokens]], dtype=torch.long)
        ta.prefill_attention_triton(
            torch.empty_like(q), q, k_cache, v_cache, spans, torch.zeros(1, 1, dtype=torch.long), 0.1, tokens
        )
        if dtype == torch.bfloat16:  # the elementwise kernels run in bf16 only
            ew = te.TritonElementwise()
            x, w = torch.zeros(tokens, hidden, dtype=dtype), torch.ones(hidden, dtype=dtype)
            ew.rms_norm(x, w, 1e-5)
            ew.add_rms_norm(x, x.clone(), w, 1e-5)
            table = torch.zeros(MAX_MODEL_LEN, head_dim)
            qkv = torch.zeros(tokens, (n_heads + 2 * n_kv) * head_dim, dtype=dtype)
            ew.rope_qkv(qkv, table, table, torch.zeros(tokens, dtype=torch.long), n_heads, n_kv, head_dim)
            ew.silu_and_mul(torch.zeros(tokens, 2 * inter, dtype=dtype))
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    return calls


def resource_usage(cubin: bytes, cuobjdump: str | None) -> dict:
    """Registers, spills and shared memory from ``cuobjdump --dump-resource-usage``."""
    if cuobjdump is None:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    usage = {}
    for key, pattern in (
        ("registers", r"REG:(\d+)"),
        ("stack_bytes", r"STACK:(\d+)"),
        ("shared_bytes", r"SHARED:(\d+)"),
        ("local_bytes", r"LOCAL:(\d+)"),
    ):
        m = re.search(pattern, text)
        if m:
            usage[key] = int(m.group(1))
    return usage


def find_cuobjdump() -> str | None:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(path) if path.exists() else None


def compile_all(arch: int) -> list[dict]:
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    cuobjdump = find_cuobjdump()
    results = []
    for shape, *dims in SHAPES:
        for dtype in (torch.bfloat16, torch.float32):
            for fn, args, constexprs in record_launches(*dims, dtype):
                # launch options ride along with the constants: num_warps is the one the wrappers set
                options = {k: constexprs.pop(k) for k in ("num_warps", "num_stages") if k in constexprs}
                names = fn.arg_names
                signature = {name: triton_type(value) for name, value in zip(names, args)}
                signature.update({name: "constexpr" for name in constexprs})
                row = {
                    "kernel": fn.fn.__name__.lstrip("_"),
                    "shape": shape,
                    "dtype": str(dtype).removeprefix("torch."),
                    "constexprs": constexprs,
                }
                t0 = time.perf_counter()
                try:
                    compiled = triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)
                except Exception as e:  # the point of this script: say which kernel and why
                    row["error"] = f"{type(e).__name__}: {e}"
                else:
                    row["shared_bytes_triton"] = compiled.metadata.shared
                    row["num_warps"] = compiled.metadata.num_warps
                    row.update(resource_usage(compiled.asm["cubin"], cuobjdump))
                row["compile_s"] = round(time.perf_counter() - t0, 2)
                results.append(row)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200, 80: A100)")
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the kernels it would compile")
    results = compile_all(a.arch)
    for r in results:
        what = f"{r['kernel']:<22} {r['shape']:<13} {r['dtype']:<9}"
        if "error" in r:
            print(f"{what} FAILED: {r['error']}")
        else:
            print(
                f"{what} regs {r.get('registers', '?'):>3}  spill {r.get('local_bytes', '?'):>4} B  "
                f"shared {r['shared_bytes_triton']:>6} B  warps {r['num_warps']}  {r['compile_s']:.1f}s"
            )
    if a.json:
        Path(a.json).write_text(json.dumps({"arch": a.arch, "kernels": results}, indent=1))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
