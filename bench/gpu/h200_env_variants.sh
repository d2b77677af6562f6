#!/usr/bin/env bash
# Issue 36 on the H200, one call: (1) bench/gpu/env_variants.py — the bundled csrc as today
# (--fmad=false, sm_90 SASS), with --fmad=true and as 8.0+PTX (driver JIT), through the service;
# (2) `optdrift check --battery standard` on the decay-after-update copy of csrc (issue 34's time,
# co-run share in its closing line).
# Here first: bash bench/gpu/fetch_wheels.sh
# Through the device tool: run(command="bash bench/gpu/h200_env_variants.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/pip.txt" 2>&1 || { cat "$OUT/pip.txt"; exit 2; }
export PYTHONPATH=/tmp/site:$PWD
stamp "environment variants through the service" | tee "$OUT/env_variants.txt"
timeout 330 python3 bench/gpu/env_variants.py --battery quick --log-dir "$OUT/variants" --timeout-s 280 2>&1 \
  | tee -a "$OUT/env_variants.txt"
stamp "check --battery standard on the decay reorder" | tee "$OUT/check_standard.txt"
python3 -c "from pathlib import Path; from worker.mutations import copy_tree, decay_after_update; decay_after_update(copy_tree(Path('csrc'), Path('/tmp/decay')))"
OPTDRIFT_BUILD_CACHE=/tmp/check-cache timeout 220 python3 -m service.cli check --source /tmp/decay --baseline csrc \
  --battery standard --device cuda --json-out "$OUT/check_standard.json" 2>&1 | tail -25 | tee -a "$OUT/check_standard.txt"
stamp "done" | tee -a "$OUT/check_standard.txt"
