#!/usr/bin/env bash
# Everything offload wants from a lent GPU machine, in one call: build the package there, run the
# GPU suite (pytest -m gpu, with and without CUDA's stream sanitizer), then `offload bench step
# --device cuda` with its batch-size curve, and a few steps of the largest LLaMA preset the planner
# accepts on that box. Every log and JSON lands in $OUT.
#
# The device image has torch, nvcc and a C compiler but no network and no cffi or libaio, so they
# travel with the working tree. Once, on the development box (network), from the repo root:
#     benchmarks/gpu_check.sh --prepare      # .deb/ (libaio) and .whl/ (cffi, pycparser), git-ignored
# then through the device tool:
#     run(command="bash benchmarks/gpu_check.sh", carry=[".deb", ".whl"], timeout_s=600)
# A full run takes about 8 minutes on an H100; GPU_CHECK_STEPS=suite|bench|largest runs one part.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    set -e
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    for d in .deb .whl; do grep -qx "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"; done
    mkdir -p .deb .whl
    (cd .deb && apt-get download libaio1 libaio-dev 2>/dev/null || apt-get download libaio1t64 libaio-dev)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl cffi pycparser
    ls -l .deb .whl
    exit 0
fi

OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEPS=${GPU_CHECK_STEPS:-suite bench largest}
PY=python3
NVME=${GPU_CHECK_NVME:-/tmp/offload-nvme}
mkdir -p "$NVME"

# libaio unpacked beside the system, not into it; gcc and the loader find it through these.
if compgen -G ".deb/*.deb" >/dev/null; then
    for f in .deb/*.deb; do dpkg -x "$f" /tmp/libaio-root; done
    lib=/tmp/libaio-root/usr/lib/x86_64-linux-gnu
    [ -e "$lib/libaio.so" ] || ln -sf "$(ls "$lib"/libaio.so.1* | head -1)" "$lib/libaio.so"
    export C_INCLUDE_PATH=/tmp/libaio-root/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}

{ nvidia-smi; $PY -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"; nproc; free -g; df -h /tmp; } \
    > "$OUT/machine.txt" 2>&1
$PY offload/_build_native.py > "$OUT/build.log" 2>&1 || { echo "native build failed"; tail -20 "$OUT/build.log"; exit 1; }
$PY -m offload doctor --path "$NVME" > "$OUT/doctor.txt" 2>&1
tail -3 "$OUT/build.log"; cat "$OUT/doctor.txt"

rc=0
if [[ " $STEPS " == *" suite "* ]]; then
    # The sanitizer run is one of the suite's tests (test_sanitizer_run).
    timeout 300 $PY -m pytest -q -m gpu -p no:cacheprovider -rs tests > "$OUT/gpu-suite.log" 2>&1 || rc=1
    tail -25 "$OUT/gpu-suite.log"
fi
if [[ " $STEPS " == *" bench "* ]]; then
    timeout 200 $PY -m offload bench step --device cuda --path "$NVME" --preset small --steps 6 \
        --batch-curve 512,2048,8192,16384 --json "$OUT/bench-step.json" > "$OUT/bench-step.txt" 2>&1 || rc=1
    cat "$OUT/bench-step.txt" | grep -v "^\[bench step\]"
fi
if [[ " $STEPS " == *" largest "* ]]; then
    # The largest preset the planner accepts here (RAM, this disk), then a few steps of it with the
    # planner's predicted step time beside the measured one.
    for preset in 100b 70b 13b 7b 1b small; do
        if $PY scripts/finetune_100b.py --preset "$preset" --nvme-path "$NVME" --dry-run > "$OUT/plan-$preset.txt" 2>&1; then
            echo "largest preset accepted: $preset"; cat "$OUT/plan-$preset.txt"
            timeout 240 $PY scripts/finetune_100b.py --preset "$preset" --nvme-path "$NVME" --steps 4 \
                --batch-tokens 8192 --seq-len 2048 --json-log "$OUT/largest.jsonl" > "$OUT/largest.txt" 2>&1 || rc=1
            tail -15 "$OUT/largest.txt"
            break
        fi
    done
fi
rm -rf "$NVME"
exit $rc
