#!/usr/bin/env bash
# The fast engine on the H200 in one call (about 3 minutes): the CUDA identity tests (od2 CPU ==
# CUDA; fast engine == run_case on CUDA, with and without graphs, 16-bit cases included) and the
# standard battery straightforward vs optimized, every sampled case compared bit for bit.
# Through the device tool: run(command="bash bench/gpu/h200_fast.sh", carry=[".whl"], timeout_s=400).
# STRAIGHT_S (default 60): seconds of the straightforward sample.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
source "$(dirname "$0")/carried_wheels.sh"
# only what it needs: pydantic and its needs (not the service's or bitsandbytes' wheels)
install_carried_wheels .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl \
  .whl/typing_extensions*.whl .whl/python_dotenv*.whl || exit 1
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; nproc; } 2>&1 | tee "$OUT/gpu.txt"
stamp "GPU tests" | tee "$OUT/pytest_fast.txt"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/engine/test_fast_engine.py -k cuda 2>&1 | tee -a "$OUT/pytest_fast.txt"
stamp "battery speed" | tee "$OUT/battery_speed.txt"
timeout 300 python3 bench/battery_speed.py --battery standard --device cuda --straight-budget-s "${STRAIGHT_S:-60}" \
  --floor-us 1.911 --json-out "$OUT/battery_speed.json" 2>&1 | tee -a "$OUT/battery_speed.txt"
stamp "done"
