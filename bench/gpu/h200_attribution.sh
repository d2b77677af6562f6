#!/usr/bin/env bash
# Issue 17 attribution with the kernels on the H200: the hand-made mutants of
# bench/attribution_table.py (decay, eps, bc1, swap: semantic; ulp, fma: rounding-level) on the
# quick battery, kernel hosts on CUDA, the analysis in float64 on the CPU.
# Through the device tool: run(command="bash bench/gpu/h200_attribution.sh", carry=[".whl"]).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1  # pydantic and the rest the image lacks
python3 bench/attribution_table.py --device cuda --cache /tmp/optdrift-builds 2>&1 | tee "$OUT/attribution_quick_cuda.md"
echo "exit code: ${PIPESTATUS[0]}"
