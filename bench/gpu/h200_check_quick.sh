#!/usr/bin/env bash
# Issue 3 acceptance on the H200: the quick battery on CUDA, decay-after-update copy vs csrc, and
# the same source twice. Through the device tool: run(command="bash bench/gpu/h200_check_quick.sh", carry=[".whl"]).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_BUILD_CACHE=${OPTDRIFT_BUILD_CACHE:-/tmp/optdrift-builds}
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1  # pydantic and the rest the image lacks
MUTANT=/tmp/csrc-decay-after-update
rm -rf "$MUTANT"
python3 -c "from pathlib import Path; from worker.mutations import copy_tree, decay_after_update; decay_after_update(copy_tree(Path('csrc'), Path('$MUTANT')))"
python3 -m service.cli check --source "$MUTANT" --baseline csrc --battery quick --json-out "$OUT/check_quick_mutant.json" 2>&1 | tee "$OUT/check_quick_mutant.txt"
echo "exit code (want 1: changed): ${PIPESTATUS[0]}"
python3 -m service.cli check --source csrc --baseline csrc --battery quick 2>&1 | tee "$OUT/check_quick_same.txt"
echo "exit code (want 0: unchanged): ${PIPESTATUS[0]}"
