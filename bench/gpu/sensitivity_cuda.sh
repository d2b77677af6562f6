#!/usr/bin/env bash
# Issue 17 on the H200: `optdrift sensitivity --device cuda` over the catalogue's mutants that reach
# the CUDA build, against a battery (default `ci`). Each mutant recompiles, through ccache, only the
# translation units its patch reaches; BUILD_JOBS mutants build at once while the current one runs
# its battery (`--build-jobs`, worker/sensitivity/build_ahead.py), each build with MAX_JOBS compiles.
#
# HERE first, once: `bash bench/gpu/h200_builds.sh --fetch` (a ccache binary and the wheels
# worker.build needs, into the git-excluded .tools/).
#
# The CUDA mutants on the ci battery (14 mutants of csrc/cuda/, one call; 469 s with one build at a
# time on 2026-12-01, docs/perf-log/2026-12-06-engine-history.md):
#     run(command="bash bench/gpu/sensitivity_cuda.sh", carry=[".whl", ".tools"], timeout_s=600)
#
# EVERY mutant reaching the CUDA build (72: 58 of the shared headers, 14 of csrc/cuda/) on the
# standard battery, in as few 600 s calls as it takes: 2-3 by estimate, not measured yet. A header
# mutant recompiles up to 4 .cpp and 3 .cu units (~80 core-s; 58 of them), a csrc/cuda/ one a single .cu
# (22-29 s, one core): ~5000 core-s, ~320 s on 16 cores with 4 builds at once. The batteries run
# one after another in the main process: ~6 s cold for standard, plus the host start and the repeat
# of every changed case, ~8-15 s a mutant, ~600-1000 s for 72, so they, not the builds, set the
# number of calls. Call 1:
#     run(command="BATTERY=standard MUTANTS=all bash bench/gpu/sensitivity_cuda.sh",
#         carry=[".whl", ".tools"], timeout_s=600, kind="nvidia-h200")
# It ends by itself before the call's limit (BUDGET_S) and leaves the report judged so far in
# $OUT/sensitivity_cuda_standard.json. Then, while the log's last line says "exit code: 124" (out of
# time, mutants left), copy that report into the git-excluded .device/ and call again with it:
#     mkdir -p .device && cp <files_at>/sensitivity_cuda_standard.json .device/
#     run(command="BATTERY=standard MUTANTS=all RESUME=.device/sensitivity_cuda_standard.json bash bench/gpu/sensitivity_cuda.sh",
#         carry=[".whl", ".tools", ".device/sensitivity_cuda_standard.json"], timeout_s=600, kind="nvidia-h200")
# Each call judges only the mutants the report lacks (same battery digest, same patches) and writes
# the whole report, old and new, to $OUT again; the unmutated build's battery runs once per call.
# "exit code: 0" (every defect caught, no refactor flagged) or 1 ends it; the log
# sensitivity_cuda_standard.txt has the tables of the whole report.
#
# The attribution table on the H200 (issue 17): the 29 defects whose attribution the catalogue
# states (MUTANTS=attributed; a variant or rounding-level), each caught defect's changed cases
# sampled 6 at a time, on the quick battery. Measured 2026-12-01 (docs/perf-log/2026-12-06-engine-history.md): 28 mutants in a
# first call of 505 s (exit 124), the last one with RESUME as above (sensitivity_cuda_quick.json):
#     run(command="BATTERY=quick MUTANTS=attributed ATTRIBUTE=6 bash bench/gpu/sensitivity_cuda.sh",
#         carry=[".whl", ".tools"], timeout_s=600, kind="nvidia-h200")
#
# Options (environment): BATTERY=ci|quick|standard|<file>; ATTRIBUTE=N (attribute up to N changed
# cases of each caught defect, `--attribute`; default 0: off); MUTANTS=attributed (the defects with a stated attribution),
# MUTANTS=pick:<class or id>,... (e.g. pick:shared_state,tail/multi_chunk_end_late), MUTANTS=cuda (default: the mutants of
# csrc/cuda/) or all; RESUME=<a report of an earlier call>; BUILD_JOBS (default 4: builds at once
# ahead of the battery); MAX_JOBS (default 8: compiles per build; 4 x 8 on 16 cores, since nvcc
# spends part of each compile in single-threaded host passes); BUDGET_S (default 560: the whole
# script's time, setup included; the run stops GRACE_S (default 60) before it so that the builds in
# flight finish and the call ends well inside 600 s). The JSON report is rewritten after every mutant.
# Writes under $OUT: sensitivity_cuda_<battery>.txt (progress and the tables) and .json (the report).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BATTERY=${BATTERY:-ci}
MUTANTS=${MUTANTS:-cuda}
BUILD_JOBS=${BUILD_JOBS:-4}
BUDGET_S=${BUDGET_S:-560}
GRACE_S=${GRACE_S:-60}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-8} OPTDRIFT_CUDA_ARCHS=${OPTDRIFT_CUDA_ARCHS:-9.0}
export OPTDRIFT_BUILD_CACHE=${OPTDRIFT_BUILD_CACHE:-/tmp/optdrift-sensitivity-builds}
TAG=$(basename "$BATTERY" .json)
LOG="$OUT/sensitivity_cuda_$TAG.txt"
fail() { echo "FATAL: $*" | tee -a "$LOG"; exit 2; }

if [ -d .tools/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .tools/whl/*.whl \
    || fail "installing the carried wheels failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  source bench/gpu/carried_wheels.sh
  install_carried_wheels || fail "installing the carried wheels (.whl) failed"
fi
[ -x .tools/ccache/bin/ccache ] && export OPTDRIFT_CCACHE=$PWD/.tools/ccache/bin/ccache
command -v patch >/dev/null || command -v git >/dev/null || fail "neither patch nor git is installed: the catalogue cannot be applied"
{ nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader; nproc; echo "ccache: ${OPTDRIFT_CCACHE:-$(command -v ccache || echo none)}"; } | tee "$LOG"

# A refused CUDA launch must break its case without restarting the kernel host (a mutant that
# launches zero blocks would otherwise cost a host start per case): checked here first.
# CUDA_ERROR_TESTS=0 skips them (a resumed call, once they have passed in the first).
if [ "${CUDA_ERROR_TESTS:-1}" != 0 ]; then
  echo "tests/worker/engine/test_cuda_errors.py:" | tee -a "$LOG"
  timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/engine/test_cuda_errors.py 2>&1 | tail -n 8 | tee -a "$LOG"
fi

ONLY=$(python3 - "$MUTANTS" <<'EOF'
import sys
from worker.sensitivity.catalogue import load_catalogue
wanted = sys.argv[1]
def wanted_here(m):
    if wanted.startswith("pick:"):  # classes and ids, e.g. pick:shared_state,tail/multi_chunk_end_late
        picked = wanted[len("pick:"):].split(",")
        return m.mutant_class in picked or m.id in picked
    if wanted == "attributed":  # the defects whose attribution the catalogue states
        return m.attribution not in (None, "none")
    return wanted == "all" or any(p.startswith("cuda/") for p in m.touched_files)
chosen = [m.id for m in load_catalogue() if "cuda" in m.reaches and wanted_here(m)]
print(" ".join(f"--only {mutant_id}" for mutant_id in chosen))
EOF
) || fail "reading the catalogue failed"
echo "mutants: $ONLY" | tee -a "$LOG"
REPORT="$OUT/sensitivity_cuda_$TAG.json"
if [ -n "${RESUME:-}" ]; then
  [ -f "$RESUME" ] || fail "RESUME=$RESUME is not a file here: carry it (see the header)"
  cp "$RESUME" "$REPORT"  # --json-out resumes from the report it is given
  echo "resuming from $RESUME" | tee -a "$LOG"
fi
LEFT=$(( BUDGET_S - SECONDS - GRACE_S ))
[ "$LEFT" -gt 30 ] || fail "no time left for the run after the setup ($SECONDS s of BUDGET_S=$BUDGET_S)"
echo "build jobs: $BUILD_JOBS x MAX_JOBS=$MAX_JOBS; run budget: $LEFT s" | tee -a "$LOG"

# SIGINT at the budget: the run stops between mutants' work, waits for its builds in flight and has
# written the report of every judged mutant; SIGKILL GRACE_S later if it has not ended.
# shellcheck disable=SC2086  # $ONLY is a list of options
timeout --signal=INT --kill-after="$GRACE_S" "$LEFT" python3 -m service.cli sensitivity --device cuda --battery "$BATTERY" $ONLY \
  --build-jobs "$BUILD_JOBS" --attribute "${ATTRIBUTE:-0}" --fallback-battery none --json-out "$REPORT" 2>&1 | tee -a "$LOG"
echo "exit code: ${PIPESTATUS[0]} (0: every defect caught and no refactor flagged; 1: an escape or a false positive; 124: out of time, call again with RESUME)" | tee -a "$LOG"
