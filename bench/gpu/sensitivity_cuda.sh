#!/usr/bin/env bash
# Issue 17 on the H200: `optdrift sensitivity --device cuda` over the catalogue's mutants of the CUDA
# sources (csrc/cuda/: the defects that cannot run on a CPU, and the CUDA refactors), against the
# `ci` battery by default. Each mutant recompiles one CUDA translation unit through ccache (the CPU
# units and the other .cu files are hits); about 14 builds of ~20-40 s with MAX_JOBS=16.
#
# On the H200, through the device tool (the wheels the image lacks travel in .whl, as for
# h200_check_quick.sh):
#     run(command="bash bench/gpu/sensitivity_cuda.sh", carry=[".whl"], timeout_s=600)
# With a carried ccache (`bash bench/gpu/h200_builds.sh --fetch` here first, then
# carry=[".whl", ".tools"]) each mutant recompiles only its own unit; without one, where the image
# has no ccache, every mutant is a whole CUDA build and BUDGET_S ends the run after a few.
# Options (environment): BATTERY=ci|quick|standard|<file>; MUTANTS=cuda (default: the mutants of
# csrc/cuda/) or all (every mutant that reaches the CUDA build: ~70 builds, needs several calls, which
# resume from $OUT/... only within one warm machine); BUDGET_S (default 500) stops the run in time to
# write what it has: the JSON report is rewritten after every mutant.
# Writes under $OUT: sensitivity_cuda_<battery>.txt (progress and the tables) and .json (the report).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
BATTERY=${BATTERY:-ci}
MUTANTS=${MUTANTS:-cuda}
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} OPTDRIFT_CUDA_ARCHS=${OPTDRIFT_CUDA_ARCHS:-9.0}
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

ONLY=$(python3 - "$MUTANTS" <<'EOF'
import sys
from worker.sensitivity.catalogue import load_catalogue
wanted = sys.argv[1]
chosen = [m.id for m in load_catalogue()
          if "cuda" in m.reaches and (wanted == "all" or any(p.startswith("cuda/") for p in m.touched_files))]
print(" ".join(f"--only {mutant_id}" for mutant_id in chosen))
EOF
) || fail "reading the catalogue failed"
echo "mutants: $ONLY" | tee -a "$LOG"

# shellcheck disable=SC2086  # $ONLY is a list of options
timeout --signal=INT "${BUDGET_S:-500}" python3 -m service.cli sensitivity --device cuda --battery "$BATTERY" $ONLY \
  --fallback-battery none --json-out "$OUT/sensitivity_cuda_$TAG.json" 2>&1 | tee -a "$LOG"
echo "exit code: ${PIPESTATUS[0]} (0: every defect caught and no refactor flagged; 1: an escape or a false positive; 124: out of time)" | tee -a "$LOG"
