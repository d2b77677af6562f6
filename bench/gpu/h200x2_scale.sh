#!/usr/bin/env bash
# Issue 19 on two H200s (kind nvidia-h200-x2): drain N commits (standard battery, warm builds)
# with one GPU worker (`optdrift worker --gpus 0`), then one per GPU (`--gpus all`), in one call;
# every run must be taken once. bench/scale_drain.py prints a JSON line per configuration as it
# finishes (so a call cut short still reports the first) and the table.
# Here first: bash bench/gpu/fetch_wheels.sh. Through the device tool:
#   run(command="bash bench/gpu/h200x2_scale.sh", kind="nvidia-h200-x2", carry=[".whl", ".tools"], timeout_s=600)
# COMMITS (default 6) commits per configuration.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1
if ls .tools/bubblewrap_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root && export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
fi
[ -x .tools/ccache/bin/ccache ] && export OPTDRIFT_CCACHE=$PWD/.tools/ccache/bin/ccache
nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader | tee "$OUT/gpus.txt"
python3 bench/scale_drain.py --battery standard --commits "${COMMITS:-6}" --config gpus=0 --config gpus=all \
  --logs "$OUT/drain-logs" --json-out "$OUT/scale_drain.json"
