#!/usr/bin/env bash
# What offload wants from a lent GPU machine, in stages: one device call each, each ending well
# inside the 600 s a call may run (STAGE_BUDGET_S, default 510 s, shared by its steps through
# `timeout`) and writing 3 files to $OUT (8 come back): setup.log (machine, build, doctor),
# <stage>.log (everything the stage ran) and <stage>.json (its figures, see gpu_figures.py).
#
#   benchmarks/gpu_check.sh prepare   HERE, once (needs network): libaio .debs in .deb/, cffi and
#                                     pycparser wheels for the device's Python in .whl/ (git-ignored)
#   benchmarks/gpu_check.sh suite     THERE: the GPU tests (pytest -m gpu), the sanitizer run left out
#   benchmarks/gpu_check.sh sanitizer THERE: the tests of test_gpu_path.SANITIZED under CUDA's stream
#                                     sanitizer (TORCH_CUDA_SANITIZER=1), each reported on its own
#   benchmarks/gpu_check.sh bench     THERE: offload bench step --device cuda: a step vs its bound,
#                                     and fp32 state vs 8-bit moments + bf16 master side by side
#                                     (PCIe included) and the in-memory batch curve vs plain PyTorch
#   benchmarks/gpu_check.sh largest   THERE: the largest preset the planner accepts on that box, a
#                                     few steps of it: TFLOPS vs the card's bf16 peak, step vs predicted
#
# Through the device tool, one stage per call, in this order:
#     run(command="bash benchmarks/gpu_check.sh suite", carry=[".deb", ".whl"], timeout_s=600)
# The device image has torch (>= 2.11), nvcc and gcc but no network, cffi or libaio: those travel
# in .deb/ and .whl/. Without CUDA (here) every stage still runs to the end, its GPU steps skipped,
# so `OUT=/tmp/o unshare -n bash benchmarks/gpu_check.sh suite` (or sanitizer) checks the harness
# offline.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-}
PY=${PYTHON:-python3}

case "$STAGE" in
prepare)
    set -e
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    for d in .deb .whl; do grep -qx "/$d/" "$exclude" 2>/dev/null || echo "/$d/" >> "$exclude"; done
    mkdir -p .deb .whl
    (cd .deb && { apt-get download libaio1 libaio-dev 2>/dev/null || apt-get download libaio1t64 libaio-dev; })
    # The device image's python3 is 3.12 (KINDS.md); cffi's wheel is per Python version.
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version "${DEVICE_PYTHON:-3.12}" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d .whl cffi pycparser
    ls -l .deb .whl
    exit 0 ;;
suite|sanitizer|bench|largest) ;;
*)
    echo "usage: benchmarks/gpu_check.sh {prepare|suite|sanitizer|bench|largest}" >&2
    exit 2 ;;
esac

OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
BUDGET=${STAGE_BUDGET_S:-510}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
NVME=${GPU_CHECK_NVME:-$WORK/nvme}
mkdir -p "$NVME"
LOG="$OUT/$STAGE.log"
SETUP="$OUT/setup.log"
export PYTHONUNBUFFERED=1 CC=gcc
trap 'rm -rf "$WORK"' EXIT

# Seconds left for a step, keeping `keep` seconds for what comes after it (at least 10).
left() { local keep=${1:-20} n; n=$((BUDGET - SECONDS - keep)); echo $((n > 10 ? n : 10)); }
say() { echo "[$STAGE ${SECONDS}s] $*" | tee -a "$LOG"; }

# libaio unpacked beside the system, not into it; gcc and the loader find it through these.
if [ ! -f /usr/include/libaio.h ] && compgen -G ".deb/*.deb" >/dev/null; then
    for f in .deb/*.deb; do dpkg -x "$f" "$WORK/libaio"; done
    lib=$WORK/libaio/usr/lib/x86_64-linux-gnu
    [ -e "$lib/libaio.so" ] || ln -sf "$(ls "$lib"/libaio.so.1* | head -1)" "$lib/libaio.so"
    export C_INCLUDE_PATH=$WORK/libaio/usr/include LIBRARY_PATH=$lib LD_LIBRARY_PATH=$lib:${LD_LIBRARY_PATH:-}
fi
# cffi from the carried wheels only where the Python has none (they are built for the device's).
if ! $PY -c "import cffi" 2>/dev/null && compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl
    export PYTHONPATH=$WORK/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

{
    echo "== machine"; nvidia-smi 2>&1 | head -20; nproc; free -g; df -h "$NVME"
    $PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')"
} > "$SETUP" 2>&1
if ! $PY -c "import sys, torch; v = tuple(int(x) for x in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(v < (2, 11))" 2>>"$SETUP"; then
    echo "torch >= 2.11 is needed; this machine has: $($PY -c 'import torch; print(torch.__version__)' 2>&1)" | tee -a "$SETUP"
    exit 2
fi
echo "== build" >> "$SETUP"
# Built in place where the tree has no native module for this Python (the device machine); a
# development checkout keeps the one its editable install built (a second one would shadow it).
if $PY -c "import offload._native" 2>/dev/null; then
    echo "native module present: $($PY -c 'import offload._native as n; print(n.__file__)')" >> "$SETUP"
elif ! $PY offload/_build_native.py >> "$SETUP" 2>&1; then
    echo "native build failed:"; tail -20 "$SETUP"; exit 1
fi
echo "== doctor" >> "$SETUP"
$PY -m offload doctor --path "$NVME" >> "$SETUP" 2>&1
CUDA=$($PY -c "import torch; print(int(torch.cuda.is_available()))")
say "setup done (CUDA: $CUDA)"

rc=0
case "$STAGE" in
suite)
    # The sanitizer run is a stage of its own: under CSAN its tests take minutes.
    say "pytest -m gpu"
    timeout "$(left 30)" $PY -m pytest -q -m gpu -p no:cacheprovider -rs --tb=short --durations=15 --junitxml "$WORK/suite.xml" \
        --deselect tests/gpu/test_gpu_path.py::test_sanitizer_run tests >> "$LOG" 2>&1 || rc=1
    $PY benchmarks/gpu_figures.py suite "$OUT/suite.json" "$WORK/suite.xml" >> "$LOG" 2>&1 || rc=1
    ;;
sanitizer)
    # Straight under the sanitizer rather than through test_sanitizer_run: no -x, so every test
    # reports (a race's full report is in the log); at the deadline SIGINT stops pytest, which
    # still writes the JUnit XML of the tests that ran.
    tests=$($PY -c "from tests.gpu.test_gpu_path import SANITIZED; print(*SANITIZED)") || { rc=1; tests=""; }
    say "pytest under TORCH_CUDA_SANITIZER=1: $tests"
    if [ -n "$tests" ]; then
        TORCH_CUDA_SANITIZER=1 timeout -s INT -k 20 "$(left 40)" $PY -m pytest -q -m gpu -p no:cacheprovider -rs \
            --tb=short --durations=0 --junitxml "$WORK/sanitizer.xml" $tests >> "$LOG" 2>&1 || rc=1
    fi
    $PY benchmarks/gpu_figures.py sanitizer "$OUT/sanitizer.json" "$WORK/sanitizer.xml" "$LOG" >> "$LOG" 2>&1 || rc=1
    ;;
bench)
    if [ "$CUDA" = 1 ]; then
        say "offload bench step --device cuda"
        timeout "$(left 110)" $PY -m offload bench step --device cuda --path "$NVME" --preset small --steps 6 \
            --batch-curve 512,2048,8192,16384 --json "$WORK/bench-step.json" >> "$LOG" 2>&1 || rc=1
        # Issue 29 where compute leaves the CPU: fp32 state against 8-bit moments + a bf16 master.
        say "offload bench step --device cuda --state fp32,8bit --master fp32,bf16"
        timeout "$(left 20)" $PY -m offload bench step --device cuda --path "$NVME" --preset small --steps 6 \
            --state fp32,8bit --master fp32,bf16 --json "$WORK/bench-precision.json" >> "$LOG" 2>&1 || rc=1
    else
        say "no CUDA device: the step benchmarks are skipped"
    fi
    # Issue 29's kernel target where the host's cores share its memory (a 2-core VM leaves the
    # 8-bit kernel bound by its arithmetic): its share of the memory roofline on this host's CPU.
    say "offload bench adam --state 8bit"
    timeout "$(left 10)" $PY -m offload bench adam --state 8bit --params 200M --repeats 3 \
        --json "$OUT/bench-adam8.json" >> "$LOG" 2>&1 || rc=1
    $PY benchmarks/gpu_figures.py bench "$OUT/bench.json" "$WORK/bench-step.json" "$WORK/bench-precision.json" \
        >> "$LOG" 2>&1 || rc=1
    ;;
largest)
    # The planner's verdict for each preset, largest first, until one fits; then a few steps of it.
    chosen=""
    for preset in 100b 70b 13b 7b 1b small; do
        say "plan $preset"
        timeout "$(left 300)" $PY -m offload plan --model "$preset" --nvme-path "$NVME" \
            --json "$WORK/plan-$preset.json" >> "$LOG" 2>&1
        if $PY -c "import json, sys; sys.exit(0 if json.load(open('$WORK/plan-$preset.json'))['fits'] else 1)" 2>/dev/null; then
            chosen=$preset
            break
        fi
    done
    if [ -z "$chosen" ]; then
        say "no preset fits this box"; rc=1
    elif [ "$CUDA" = 1 ]; then
        say "peak bf16 matmul"
        timeout 60 $PY benchmarks/gpu_figures.py matmul-peak "$WORK/peak.json" >> "$LOG" 2>&1
        say "finetune --preset $chosen"
        timeout "$(left 20)" $PY scripts/finetune_100b.py --preset "$chosen" --nvme-path "$NVME" --steps 3 \
            --batch-tokens 8192 --seq-len 2048 --json-log "$WORK/steps.jsonl" >> "$LOG" 2>&1 || rc=1
    else
        say "no CUDA device: the run of $chosen is skipped"
    fi
    $PY benchmarks/gpu_figures.py largest "$OUT/largest.json" "$WORK" "$chosen" >> "$LOG" 2>&1 || rc=1
    ;;
esac
say "stage $STAGE done in ${SECONDS} s (rc $rc); files in \$OUT: $(ls "$OUT" | wc -l)"
tail -25 "$LOG"
exit $rc
