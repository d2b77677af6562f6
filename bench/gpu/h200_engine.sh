#!/usr/bin/env bash
# Engine figures on the H200 (issue 3): `optdrift check` of the decay-after-update copy against the
# bundled csrc on the standard battery, plus the CPU/GPU gradient-stream identity tests.
# Through the device tool: run(command="bash bench/gpu/h200_engine.sh", carry=[".whl"]).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_BUILD_CACHE=${OPTDRIFT_BUILD_CACHE:-/tmp/optdrift-builds}
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1  # pydantic and the rest the image lacks
MUTANT=/tmp/csrc-decay-after-update
rm -rf "$MUTANT"
python3 -c "from pathlib import Path; from worker.mutations import copy_tree, decay_after_update; decay_after_update(copy_tree(Path('csrc'), Path('$MUTANT')))"
python3 -c "
import sys, time
from pathlib import Path
from service.cli.check import run_check
started = time.monotonic()
code = run_check(Path('$MUTANT'), Path('csrc'), 'standard', device='cuda', json_out=Path('$OUT/check_standard.json'))
print(f'exit code {code}, {time.monotonic() - started:.1f} s wall')
" 2>&1 | tee "$OUT/check_standard.txt"
