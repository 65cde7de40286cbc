#!/usr/bin/env bash
# Fill .gpu-wheels/ with the wheels the GPU device image lacks, so that
# benchmarks/gpu_check.sh can install them there without a network.
#
# The device image has Python 3.12 with torch (CUDA), triton, transformers, tokenizers,
# safetensors, numpy, jinja2, httpx and prometheus-client (and what pip installed them
# with). Everything else pdserve and its tests import comes from this list. The versions
# are the ones the development venv runs, so the device runs the same code.
# tests/test_gpu_check.py checks that this list covers every third-party module pdserve
# imports outside the image, and every requirement of these wheels.
#
# Usage: bash benchmarks/gpu_wheels.sh [DIR]   (default: .gpu-wheels, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.gpu-wheels}"
PYTHON="${PYTHON:-python3}"

WHEELS=(
    # pdserve itself
    gguf==0.19.0
    pydantic==2.14.4
    pydantic-core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    fastapi==0.165.0
    annotated-doc==0.0.7
    opentelemetry-api==1.45.2
    starlette==1.10.0
    uvicorn==0.55.0
    click==8.5.1
    h11==0.16.0
    anyio==4.16.0
    sniffio==1.3.1
    idna==3.20
    pyyaml==6.0.4
    tqdm==4.70.1
    requests==2.34.2  # gguf's (transformers 5 no longer brings it)
    urllib3==2.8.0
    charset-normalizer==3.5.3
    certifi==2026.10.19.post1
    ninja==1.13.2
    # the parity tests (pytest -m gpu)
    pytest==9.2.0
    pluggy==1.7.0
    iniconfig==2.3.1
    pygments==2.21.0
    packaging==26.4
)

# the list alone, for the coverage test: `gpu_wheels.sh --list`
if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${WHEELS[@]}"
    exit 0
fi

mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --dest "$DEST" --only-binary=:all: --no-deps \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    "${WHEELS[@]}"
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
