#!/usr/bin/env bash
# The GPU check of issue #20, as one command for a device machine without a network:
#
#   bash benchmarks/gpu_check.sh                      (the device tool, carry [".gpu-wheels"])
#   bash benchmarks/gpu_check.sh --device cpu --small (this flow on a CPU, tiny shapes)
#
# It installs the carried wheels (benchmarks/gpu_wheels.sh fills .gpu-wheels/), runs the
# GPU parity tests, measures the copy bandwidth, builds two random-weight models (the
# shapes of SmolLM2-135M and Llama-3-8B) and measures pdserve and transformers on them.
# Every stage has its own time limit, cut to what is left of GPU_CHECK_BUDGET_S, and
# writes its numbers as soon as it has them: results.json, summary.md and logs.tar.gz (logs/
# and parts/) land in $OUT (default ./gpu-check-out) even when a stage hangs or fails.
# Exit status: 0 when the parity tests passed (skipped in CPU mode), else 1.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"

DEVICE=cuda
SMALL=()
EXTRA=()
while (( $# )); do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --small) SMALL=(--small); shift ;;
        --enforce-eager) EXTRA=(--enforce-eager "$2"); shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done

OUT="${OUT:-$REPO/gpu-check-out}"
mkdir -p "$OUT/logs" "$OUT/parts"
PARTS="$OUT/parts"
BUDGET="${GPU_CHECK_BUDGET_S:-480}"
START=$SECONDS
WORK="$(mktemp -d)"  # models and installed wheels: large, not shipped back
trap 'rm -rf "$WORK"' EXIT
PYTHON="${PYTHON:-python3}"
if [[ "$DEVICE" == cpu ]]; then DTYPE=float32; else DTYPE=bfloat16; fi
COMMON=(--parts "$PARTS" --device "$DEVICE" --dtype "$DTYPE" "${SMALL[@]}")
EXPECT=()

# stage NAME LIMIT_S CMD...: run under min(LIMIT_S, what is left of the budget), log to logs/NAME.log
stage() {
    local name="$1" limit="$2"; shift 2
    local left=$(( BUDGET - (SECONDS - START) ))
    (( left < limit )) && limit=$left
    if (( limit < 5 )); then
        echo "== $name: skipped, the time budget is spent" | tee -a "$OUT/logs/stages.log"
        return 124
    fi
    echo "== $name (limit ${limit}s)" | tee -a "$OUT/logs/stages.log"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1
    local rc=$?
    echo "   $name: exit $rc after $(( SECONDS - t0 ))s" | tee -a "$OUT/logs/stages.log"
    tail -n 3 "$OUT/logs/$name.log"
    return $rc
}

# ---- setup: the carried wheels into a folder of their own, ahead of the image's packages
# (the wheels are built for CPython 3.12, the device image's Python)
PYVER="$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
if [[ -d .gpu-wheels && "$PYVER" == 3.12 ]] && compgen -G ".gpu-wheels/*.whl" >/dev/null; then
    stage setup 90 "$PYTHON" -m pip install --no-index --find-links .gpu-wheels --no-deps --target "$WORK/site" \
        .gpu-wheels/*.whl \
        || stage setup-unzip 60 "$PYTHON" -c "import glob, sys, zipfile
for w in glob.glob('.gpu-wheels/*.whl'): zipfile.ZipFile(w).extractall(sys.argv[1])" "$WORK/site"
    # (a wheel is a zip of its packages: where the image has no pip, unpacking it is the install)
    export PYTHONPATH="$WORK/site:$REPO${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no .gpu-wheels/ for Python $PYVER: using the packages this Python has" | tee -a "$OUT/logs/stages.log"
    export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi
{ command -v nvidia-smi >/dev/null && nvidia-smi; "$PYTHON" -c "import sys, torch; print(sys.version); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"; } \
    >"$OUT/logs/environment.log" 2>&1
stage imports 60 "$PYTHON" -c "import pdserve.server.app, pdserve.engine.llm_engine, fastapi, uvicorn, pydantic, gguf"

# ---- parity tests: the gate of the exit status
if [[ "$DEVICE" == cpu ]]; then
    echo '{"status": "skipped on cpu"}' >"$PARTS/parity.json"
elif [[ ! -d tests/gpu ]]; then
    echo '{"status": "missing (no tests/gpu in this tree)"}' >"$PARTS/parity.json"
else
    # the image's own pytest plugins (xdist, cov, timeout, ...) stay out: the tests need none,
    # and one that does not load with the carried pytest would fail the gate for nothing
    PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 stage parity 150 "$PYTHON" -m pytest -m gpu tests/gpu -q -p no:cacheprovider
    rc=$?
    (( rc == 0 )) || tail -n 60 "$OUT/logs/parity.log"
    case $rc in
        0) status=passed ;;
        5) status="no tests collected" ;;
        124|137) status="timed out" ;;
        *) status=failed ;;
    esac
    printf '{"status": "%s", "rc": %d}\n' "$status" "$rc" >"$PARTS/parity.json"
fi

# ---- measurements
run_py=("$PYTHON" benchmarks/gpu_check.py)
stage bandwidth 60 "${run_py[@]}" bandwidth "${COMMON[@]}"
EXPECT+=(bandwidth)
if (( ${#SMALL[@]} )); then SHAPES=(tiny); else SHAPES=(llama3-8b smollm2-135m); fi
for shape in "${SHAPES[@]}"; do
    dir="$WORK/models/$shape"
    if [[ "$shape" == llama3-8b ]]; then L=(120 200 120); else L=(60 90 60); fi
    EXPECT+=("model-$shape" "pdserve-$shape" "transformers-$shape")
    stage "model-$shape" "${L[0]}" "${run_py[@]}" model "${COMMON[@]}" --shape "$shape" --dir "$dir" || continue
    if ! stage "pdserve-$shape" "${L[1]}" "${run_py[@]}" pdserve "${COMMON[@]}" --model "$dir" "${EXTRA[@]}" \
        && (( ${#EXTRA[@]} == 0 )) && [[ "$DEVICE" != cpu ]]; then
        # the default run captures CUDA graphs; if it failed, the eager engine's figures still come back
        # (the part then says "cuda_graphs": false; logs/pdserve-<shape>.log says why the first failed)
        cp "$OUT/logs/pdserve-$shape.log" "$OUT/logs/pdserve-$shape-graphs-failed.log"
        stage "pdserve-$shape" "${L[1]}" "${run_py[@]}" pdserve "${COMMON[@]}" --model "$dir" --enforce-eager on
    fi
    stage "transformers-$shape" "${L[2]}" "${run_py[@]}" transformers "${COMMON[@]}" --model "$dir"
    rm -rf "$dir"
done

# ---- report (never cut by the budget: it only reads the parts)
IFS=, ; expect="${EXPECT[*]}" ; unset IFS
timeout 60 "$PYTHON" benchmarks/gpu_check.py report --parts "$PARTS" --out "$OUT" --expect "$expect" \
    2>"$OUT/logs/report.log"
rc=$?
cat "$OUT/summary.md" 2>/dev/null
# the device tool brings back at most 8 files: the logs and parts travel as one archive
if tar czf "$OUT/logs.tar.gz" -C "$OUT" logs parts; then
    rm -rf "$OUT/logs" "$OUT/parts"
fi
echo "total $(( SECONDS - START ))s; results in $OUT (results.json, summary.md, logs.tar.gz)"
exit $rc
