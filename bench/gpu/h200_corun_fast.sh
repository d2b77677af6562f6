#!/usr/bin/env bash
# Issue 14's co-run target and issue 18's reference cache on the H200, in one call (about 4 minutes):
# bench/corun_and_references.py on the standard battery — the battery on the bundled kernels and on
# the decay-after-update copy, the fast co-run of the changed cases and its ratio to the battery
# (target <= 2x), a one-case co-run sample compared with it, then the battery with an empty, a warm
# reference cache and the commit warm, every series compared bit for bit; then the CUDA identity
# tests: the fast engine, the kernels-only waves against run_params, the cache's two passes.
# Here first: bash bench/gpu/fetch_wheels.sh; optionally mkdir -p .tools && (cd .tools && apt-get download bubblewrap)
# Through the device tool: run(command="bash bench/gpu/h200_corun_fast.sh", carry=[".whl", ".tools"], timeout_s=590).
# Every step prints what it measured even when a later one fails; the summary is in $OUT/corun_and_references.json.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
# One build cache for the bench and the tests: csrc compiles once for both.
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0 OPTDRIFT_BUILD_CACHE=/tmp/optdrift-builds
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
status=0
if ls .tools/bubblewrap_*.deb >/dev/null 2>&1; then  # the sandbox as the worker runs it (round 2 did)
  mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root && export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
fi
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || { echo "installing the carried wheels failed"; exit 1; }
{ nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; nproc; } 2>&1 | tee "$OUT/gpu.txt"
stamp "co-run and reference cache (standard battery)" | tee "$OUT/corun_and_references.txt"
timeout 420 python3 bench/corun_and_references.py --battery standard --device cuda \
  --json-out "$OUT/corun_and_references.json" 2>&1 | tee -a "$OUT/corun_and_references.txt" || status=1
stamp "CUDA identity tests (fast engine, kernels-only waves, the cache's two passes)" | tee "$OUT/pytest_corun.txt"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/engine/test_fast_engine.py tests/worker/engine/test_corun_fast.py \
  tests/worker/engine/test_reference_cache.py -k cuda 2>&1 | tee -a "$OUT/pytest_corun.txt" || status=1
stamp "done (status $status)"
exit $status
