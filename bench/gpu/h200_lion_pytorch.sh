#!/usr/bin/env bash
# Issue 20's real library on the H200: lion-pytorch 0.2.5 (pure PyTorch, so its CUDA path is torch's)
# through `optdrift check --device cuda`, the history tests/scenarios/test_real_library_lion.py checks on the
# CPU: comment-only vs base (want exit 0, unchanged), decay after the update vs comment (want 1,
# changed from step 1 in the weight-decayed cases), momentum with beta1 vs comment (want 1, changed
# from step 1 in the beta1 != beta2 cases).
#
# lion-pytorch must travel as a wheel (the H200 has no index). Here, once:
#   .venv/bin/pip download --no-deps lion-pytorch==0.2.5 -d .whl     # 10 KB, pure Python
#   bash bench/gpu/fetch_wheels.sh                                  # the service's wheels, if not there
# Then through the device tool: run(command="bash bench/gpu/h200_lion_pytorch.sh", carry=[".whl"]).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_BUILD_CACHE_DIR=${OPTDRIFT_BUILD_CACHE_DIR:-/tmp/optdrift-builds}
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1
ls .whl/lion_pytorch-0.2.5-*.whl >/dev/null 2>&1 || { echo "no lion-pytorch 0.2.5 wheel in .whl (see the header)"; exit 2; }

HISTORY=/tmp/lion-history
rm -rf "$HISTORY"
python3 -c "from pathlib import Path; from tests.lion_project import make_history; make_history(Path('$HISTORY'))" || exit 1
TREES=$HISTORY/trees
status=0
check() {  # name baseline wanted-exit
  python3 -m service.cli check --source "$TREES/$1" --baseline "$TREES/$2" --device cuda \
    --json-out "$OUT/lion_$1.json" > "$OUT/lion_$1.txt" 2>&1
  local code=$?
  tail -4 "$OUT/lion_$1.txt"
  echo "lion $1 vs $2: exit $code (want $3)"
  [ "$code" -eq "$3" ] || status=1
}
check comment base 0
check decay comment 1
check mixup comment 1
exit $status
