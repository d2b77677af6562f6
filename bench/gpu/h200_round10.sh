#!/usr/bin/env bash
# Issue 18, round 10 on the H200, in one device call: the warm battery as the worker runs it
# (bench/gpu/h200_warm_profile.sh without its split, op-cost and test parts), the kernels-only
# pass by layout (bench/kernels_only_layout.py), the CUDA tests of what round 10 changed, and the
# end-to-end latencies (bench/gpu/h200_e2e.sh). Here first: bash bench/gpu/fetch_wheels.sh;
# bash bench/gpu/h200_builds.sh --fetch; (cd .tools && apt-get download bubblewrap). Then:
#   run(command="bash bench/gpu/h200_round10.sh", carry=[".whl", ".tools"], timeout_s=600)
# PARTS picks what runs (default "warm tests e2e layout", most needed first; "opcost" adds
# bench/op_call_cost.py). Everything lands in one archive,
# $OUT/round10.tgz (the device tool brings back at most 8 files).
set -uo pipefail
cd "$(dirname "$0")/../.."
FINAL_OUT=${OUT:-gpu-out}; mkdir -p "$FINAL_OUT"
export OUT=/tmp/round10-out; rm -rf "$OUT"; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0 MAX_JOBS=16
source bench/gpu/carried_wheels.sh
install_carried_wheels || exit 1
[ -x .tools/ccache/bin/ccache ] && export OPTDRIFT_CCACHE=$PWD/.tools/ccache/bin/ccache
if ls .tools/bubblewrap_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root && export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
fi
PARTS=${PARTS:-warm tests e2e layout}
status=0
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
# The device call is killed at its limit with nothing brought back, so the parts share a deadline
# (DEADLINE_S, default 540 s) and the archive is remade after each part.
DEADLINE_S=${DEADLINE_S:-540}
left() { local want=$1 rest=$(( DEADLINE_S - ($(date +%s) - T0) - 10 )); echo $(( rest < 1 ? 1 : (rest < want ? rest : want) )); }
pack() { tar czf "$FINAL_OUT/round10.tgz" -C "$OUT" .; }
if [[ " $PARTS " == *" warm "* ]]; then
  stamp warm
  TESTS=0 OPCOST=0 SPLIT= TOP=${TOP:-15} SPARE_IDLE_S=${SPARE_IDLE_S:-10} timeout "$(left $(( 240 + 15 * (${PREPARED_REPEATS:-1} + ${UNREADY_REPEATS:-0}) )))" bash bench/gpu/h200_warm_profile.sh \
    > "$OUT/warm_profile_log.txt" 2>&1 || status=1
  tail -60 "$OUT/warm_profile.txt"; pack
fi
if [[ " $PARTS " == *" tests "* ]]; then
  stamp tests
  # shellcheck disable=SC2086
  timeout "$(left 200)" python3 -m pytest -q -rs -p no:cacheprovider ${CUDA_TESTS:-tests/worker/engine/test_corun_fast.py tests/worker/engine/test_step_inputs.py tests/worker/engine/test_reference_cache.py} -k cuda 2>&1 \
    | tee "$OUT/pytest_cuda.txt" | tail -3 || status=1
  pack
fi
if [[ " $PARTS " == *" opcost "* ]]; then
  stamp opcost
  timeout "$(left 120)" python3 bench/op_call_cost.py --device cuda 2>&1 | tee "$OUT/op_call_cost.txt" || status=1
  pack
fi
if [[ " $PARTS " == *" e2e "* ]]; then
  stamp e2e
  OUT=$OUT/e2e_out E2E_DEADLINE_S=$(left ${E2E_DEADLINE_S:-200}) E2E_TIMEOUT_S=$(left ${E2E_TIMEOUT_S:-240}) \
    bash bench/gpu/h200_e2e.sh > "$OUT/e2e_log.txt" 2>&1 || status=1
  tail -25 "$OUT/e2e_log.txt"; pack
fi
if [[ " $PARTS " == *" layout "* ]]; then
  stamp layout
  timeout "$(left 150)" python3 bench/kernels_only_layout.py --battery standard --device cuda --repeats "${REPEATS:-3}" \
    --json-out "$OUT/kernels_only_layout.json" 2>&1 | tee "$OUT/kernels_only_layout.txt" || status=1
fi
stamp done
pack
exit $status
