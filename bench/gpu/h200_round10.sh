#!/usr/bin/env bash
# Issue 18, round 10 on the H200: the kernels-only pass by layout and kernel-call threads
# (bench/kernel_threads.py), the CUDA tests of the call loop and the engines, then the warm
# battery as the worker runs it (bench/gpu/h200_warm_profile.sh without its split, op-cost and
# test parts). Here first: bash bench/gpu/fetch_wheels.sh; bash bench/gpu/h200_builds.sh --fetch;
# (cd .tools && apt-get download bubblewrap). Through the device tool:
#   run(command="bash bench/gpu/h200_round10.sh", carry=[".whl", ".tools"], timeout_s=600)
# PARTS picks what runs (default "tests threads warm").
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0 MAX_JOBS=16
source bench/gpu/carried_wheels.sh
install_carried_wheels || exit 1
[ -x .tools/ccache/bin/ccache ] && export OPTDRIFT_CCACHE=$PWD/.tools/ccache/bin/ccache
if ls .tools/bubblewrap_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root && export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
fi
PARTS=${PARTS:-tests threads warm}
status=0
if [[ " $PARTS " == *" tests "* ]]; then
  # shellcheck disable=SC2086
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider ${CUDA_TESTS:-tests/test_call_loop.py tests/test_fast_engine.py tests/test_corun_fast.py tests/test_step_inputs.py tests/test_od2_op.py} -k cuda 2>&1 \
    | tee "$OUT/pytest_cuda.txt" || status=1
fi
if [[ " $PARTS " == *" threads "* ]]; then
  # shellcheck disable=SC2086
  timeout 300 python3 bench/kernel_threads.py --battery standard --device cuda --repeats ${REPEATS:-3} \
    --threads ${THREADS:-1 2 3 4} --merge ${MERGE:-0.75 0.0} --json-out "$OUT/kernel_threads.json" 2>&1 \
    | tee "$OUT/kernel_threads.txt" || status=1
fi
if [[ " $PARTS " == *" warm "* ]]; then
  TESTS=0 OPCOST=0 SPLIT= TOP=${TOP:-15} SPARE_IDLE_S=${SPARE_IDLE_S:-15} bash bench/gpu/h200_warm_profile.sh || status=1
fi
exit $status
