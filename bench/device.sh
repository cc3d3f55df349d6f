#!/usr/bin/env bash
# The one script for a GPU machine (an H200 without network access; torch,
# triton and cupy preinstalled there, xpkernels not installed):
#
#   bash bench/device.sh OUT_DIR [--dry-run]
#
# 1. makes xpkernels importable from this checkout without installing it (a
#    folder of symbolic links on PYTHONPATH), adding array-api-compat from
#    wheels in $XPK_WHEELS (default: .whl/ in the repository) when the
#    machine lacks it;
# 2. runs the conformance suite on every CUDA target (*-torch-cuda,
#    *-cupy-cuda), in parallel when pytest-xdist is there;
# 3. runs bench/gpu.py (ceilings, norms, softmax, attention, decode);
# and writes into OUT_DIR: device.log (everything printed), conformance.xml
# (JUnit), gpu.json (the figures) and environment.txt. The last screen it
# prints is the summary: each primitive's rate and share of its ceiling, its
# speed-up over PyTorch's op and over torch.compile, and PASS/FAIL against the
# DESIGN section 8 targets.
#
# --dry-run runs the same steps on CPU: conformance is only collected, and the
# benchmarks run on tiny CPU tensors through the Triton interpreter, so the
# script's own bugs show up without a GPU. It measures nothing.
#
# Fails loudly: every step runs, then the exit status is non-zero if any step
# failed or ran out of its time (XPK_CONFORMANCE_TIMEOUT, XPK_BENCH_TIMEOUT,
# seconds). The defaults keep the whole run under 8 minutes.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 || ( $# -eq 2 && "$2" != "--dry-run" ) ]]; then
    echo "usage: bash bench/device.sh OUT_DIR [--dry-run]" >&2
    exit 2
fi
OUT=$1
DRY_RUN=0
if [[ $# -eq 2 ]]; then
    DRY_RUN=1
fi
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
WHEELS=${XPK_WHEELS:-$REPO/.whl}
CONFORMANCE_TIMEOUT=${XPK_CONFORMANCE_TIMEOUT:-270}
BENCH_TIMEOUT=${XPK_BENCH_TIMEOUT:-180}

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

step() { printf '\n=== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

main() {
    step "environment"
    {
        echo "repository: $REPO"
        echo "python: $($PYTHON --version 2>&1) at $(command -v "$PYTHON")"
        echo "dry run: $DRY_RUN"
        if command -v nvidia-smi >/dev/null; then
            nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
        fi
        $PYTHON - <<'PY'
import importlib.util
for name in ("torch", "triton", "cupy", "numpy", "array_api_compat", "array_api_strict", "pytest", "xdist", "hypothesis"):
    spec = importlib.util.find_spec(name)
    if spec is None:
        print(f"{name}: missing")
        continue
    module = __import__(name)
    print(f"{name}: {getattr(module, '__version__', '?')}")
import torch
print("cuda available:", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY
    } | tee "$OUT/environment.txt"

    step "xpkernels from this checkout"
    SITE=$WORK/site
    mkdir -p "$SITE/xpkernels"
    for entry in "$REPO"/src/xpkernels/*; do
        ln -s "$entry" "$SITE/xpkernels/$(basename "$entry")"
    done
    ln -s "$REPO/backends" "$SITE/xpkernels/backends"
    if ! $PYTHON -c "import array_api_compat" 2>/dev/null; then
        if compgen -G "$WHEELS/array_api_compat-*.whl" >/dev/null; then
            $PYTHON -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
        else
            echo "array_api_compat is not installed and no wheel is in $WHEELS:" >&2
            echo "  python3 -m pip download --no-deps --only-binary=:all: -d .whl array-api-compat" >&2
            echo "  (and array-api-strict for its conformance targets), then carry .whl" >&2
            exit 1
        fi
    fi
    export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
    export PYTHONUNBUFFERED=1
    cd "$REPO"
    $PYTHON -c "import xpkernels, xpkernels.backends, array_api_compat; print('xpkernels', xpkernels.__version__, 'from', xpkernels.__file__)"

    status=0

    step "conformance on CUDA targets"
    PYTEST=("$PYTHON" -m pytest conformance -q -p no:cacheprovider -k cuda --junitxml "$OUT/conformance.xml")
    if [[ $DRY_RUN -eq 1 ]]; then
        PYTEST+=(--collect-only -qq)
    elif $PYTHON -c "import xdist" 2>/dev/null; then
        PYTEST+=(-n 8)
    fi
    conformance_rc=0
    timeout "$CONFORMANCE_TIMEOUT" "${PYTEST[@]}" || conformance_rc=$?
    echo "conformance exit status: $conformance_rc"
    if [[ $conformance_rc -ne 0 ]]; then
        status=1
    fi

    step "GPU benchmarks"
    BENCH=("$PYTHON" bench/gpu.py --out "$OUT" --time-budget $((BENCH_TIMEOUT - 40)))
    if [[ $DRY_RUN -eq 1 ]]; then
        BENCH+=(--dry-run)
    fi
    bench_rc=0
    timeout "$BENCH_TIMEOUT" "${BENCH[@]}" || bench_rc=$?
    echo "benchmark exit status: $bench_rc"
    if [[ $bench_rc -ne 0 ]]; then
        status=1
    fi

    step "torch: CUDA-graph capture and replay of a training step"; timeout 150 "$PYTHON" bench/torch_cuda_graph.py --out "$OUT" $([[ $DRY_RUN -eq 1 ]] && echo --dry-run) || status=1
    ls -l "$OUT"
    step "done: conformance $conformance_rc, benchmarks $bench_rc"
    if [[ -f "$OUT/gpu.json" ]]; then
        "$PYTHON" bench/gpu.py --summary "$OUT/gpu.json" || status=1
    fi
    return $status
}

main 2>&1 | tee "$OUT/device.log"
