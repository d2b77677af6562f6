#!/usr/bin/env bash
# Round 2 on the H200 in one call: bubblewrap from the carried Debian package, the co-run against the
# battery's own time (bench/corun_speed.py, standard battery), then the service end to end on the
# embedded default with the sandboxed worker (bench/gpu/h200_e2e.sh, which installs the wheels).
# Here first: mkdir -p .tools && (cd .tools && apt-get download bubblewrap); bash bench/gpu/fetch_wheels.sh
# Through the device tool: run(command="bash bench/gpu/h200_round2.sh", carry=[".whl", ".tools"], timeout_s=590).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root || exit 1
export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1
stamp "co-run speed" | tee "$OUT/corun_speed.txt"
timeout 240 python3 bench/corun_speed.py --battery standard --device cuda 2>&1 | tee -a "$OUT/corun_speed.txt"
stamp "end to end (sandboxed worker)"
E2E_DEADLINE_S=260 E2E_TIMEOUT_S=300 bash "$(dirname "$0")/h200_e2e.sh"
stamp "done"
