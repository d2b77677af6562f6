#!/usr/bin/env bash
# Issue 18 on the H200: where the warm-reference standard battery's time goes
# (bench/warm_battery_profile.py: phases through the kernel host, the host's half in-process, the
# protocol alone, and cProfile's heaviest functions). Here first: bash bench/gpu/fetch_wheels.sh and
# bash bench/gpu/h200_builds.sh --fetch (ccache). Through the device tool:
#   run(command="bash bench/gpu/h200_warm_profile.sh", carry=[".whl", ".tools"], timeout_s=600)
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
# The fused od2 observation's CUDA tests first (TESTS=0 skips them): op == digest.py's torch ops
# on every dtype, fast engine with it == run_case.
if [ "${TESTS:-1}" != 0 ]; then
  # shellcheck disable=SC2086
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider ${CUDA_TESTS:-tests/worker/engine/test_od2_op.py tests/worker/engine/test_call_loop.py tests/worker/engine/test_fast_engine.py tests/worker/engine/test_step_inputs.py} -k cuda 2>&1 \
    | tee "$OUT/pytest_od2.txt"
fi
# What one kernel call costs the host, by layer (OPCOST=0 skips it).
if [ "${OPCOST:-1}" != 0 ]; then
  timeout 120 python3 bench/op_call_cost.py --device cuda 2>&1 | tee "$OUT/op_call_cost.txt"
fi
# SPLIT: the host counts of the split runs (default "2 3 4"; SPLIT= skips them).
# shellcheck disable=SC2086
python3 bench/warm_battery_profile.py --battery "${BATTERY:-standard}" --device cuda --top "${TOP:-30}" --split ${SPLIT-2 3 4} \
  --spare-idle-s "${SPARE_IDLE_S:-20}" --prepared-repeats "${PREPARED_REPEATS:-1}" --unready-repeats "${UNREADY_REPEATS:-0}" --json-out "$OUT/warm_profile.json" 2>&1 | tee "$OUT/warm_profile.txt"
