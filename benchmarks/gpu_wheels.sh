#!/usr/bin/env bash
# Fill .gpu-wheels/ with the wheels the GPU device image lacks, so that
# benchmarks/gpu_check.sh can install them there without a network.
#
# The device image has Python 3.12 with torch (CUDA), triton, transformers, tokenizers,
# safetensors, numpy, jinja2, httpx and prometheus-client (and what pip installed them
# with). Everything else pdserve and its tests import comes from this list, each at the
# version installed where this script runs ($PYTHON: the development venv), so the device
# runs the code the tests here ran, and the list cannot fall behind an upgrade.
# tests/test_gpu_check.py checks that this list covers every third-party module pdserve
# imports outside the image, and every requirement of these wheels.
#
# Usage: bash benchmarks/gpu_wheels.sh [DIR]   (default: .gpu-wheels, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu-wheels}"
PYTHON="${PYTHON:-.venv/bin/python}"

WHEELS=(
    # pdserve itself
    gguf
    pydantic
    pydantic-core
    annotated-types
    typing-inspection
    typing-extensions
    fastapi
    annotated-doc
    opentelemetry-api
    starlette
    uvicorn
    click
    h11
    anyio
    sniffio
    idna
    pyyaml
    tqdm
    requests  # gguf's (transformers 5 no longer brings it)
    urllib3
    charset-normalizer
    certifi
    ninja
    llguidance  # structured outputs (abi3: the same wheel serves Python 3.12)
    # the parity tests (pytest -m gpu)
    pytest
    pluggy
    iniconfig
    pygments
    packaging
)

# name==version of each, from $PYTHON's environment (a wheel it lacks stops the script)
mapfile -t PINS < <("$PYTHON" -c '
import sys, importlib.metadata as md
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        sys.exit(f"{name} is not installed in {sys.prefix}: install it there first")
' "${WHEELS[@]}")
if (( ${#PINS[@]} != ${#WHEELS[@]} )); then
    exit 1
fi

# the pinned list alone, for the coverage test: `gpu_wheels.sh --list`
if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${PINS[@]}"
    exit 0
fi

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --dest "$DEST" --only-binary=:all: --no-deps \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    "${PINS[@]}"
count=$(ls "$DEST"/*.whl | wc -l)
size=$(du -sm "$DEST" | cut -f1)
echo "$count wheels, ${size} MiB in $DEST"
if (( count < ${#WHEELS[@]} )); then
    echo "expected ${#WHEELS[@]} wheels" >&2
    exit 1
fi
if (( size >= 60 )); then
    echo "over the device tool's carry limit (64 MiB in all)" >&2
    exit 1
fi
