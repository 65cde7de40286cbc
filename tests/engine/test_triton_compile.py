"""The Triton kernels (attention and the fused elementwise ones) compile for Hopper (sm_90, the H100/H200 the GPU check runs on) without a GPU.

The interpreter tests check what the kernels compute; this checks that the GPU compiler accepts
them, down to a cubin through Triton's own ptxas, with the arguments the real launch wrappers pass,
and that no kernel spills registers to local memory. It runs benchmarks/triton_compile.py in a
process of its own: that script needs TRITON_INTERPRET unset, which the interpreter tests set.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be compiled")

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90_without_spills(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")  # compile for real, not from an earlier run's cache
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "triton_compile.py"), "--arch", "90", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    kernels = json.loads(out.read_text())["kernels"]
    attention = {"write_kv_kernel", "decode_partial_kernel", "decode_reduce_kernel", "prefill_kernel"}
    elementwise = {"rms_norm_kernel", "rope_kernel", "silu_mul_kernel"}  # bf16 only
    assert {k["kernel"] for k in kernels if k["dtype"] == "float32"} == attention
    assert {k["kernel"] for k in kernels if k["dtype"] == "bfloat16"} == attention | elementwise
    assert {(k["shape"], k["dtype"]) for k in kernels} == {
        (s, d) for s in ("llama3-8b", "smollm2-135m") for d in ("bfloat16", "float32")
    }
    for k in kernels:
        assert k["registers"] <= 255, k
        assert k["local_bytes"] == 0, f"{k['kernel']} spills registers: {k}"
        assert k["shared_bytes_triton"] <= 227 * 1024, k  # an sm_90 block's shared memory limit
    # the decode kernels take the split-K sizes at run time: one compile serves every context length
    decode = next(k for k in kernels if k["kernel"] == "decode_partial_kernel" and k["shape"] == "llama3-8b")
    assert decode["constexprs"]["GROUP"] == 4 and "NUM_SPLITS" not in decode["constexprs"]
