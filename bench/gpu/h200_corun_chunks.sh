#!/usr/bin/env bash
# The co-run's kernels phase by chunk size on the H200 (issue 18), and the CUDA kernels-only test:
# bench/corun_chunks.py on the standard battery (the decay-after-update copy's 237 changed cases,
# 2.7 GB of parameters per side), then tests/worker/engine/test_corun_fast.py -k cuda. About 2 minutes.
# Here first: bash bench/gpu/fetch_wheels.sh; bash bench/gpu/h200_builds.sh --fetch (ccache in .tools)
# and (cd .tools && apt-get download bubblewrap). Through the device tool:
#   run(command="bash bench/gpu/h200_corun_chunks.sh", carry=[".whl", ".tools"], timeout_s=400)
# CHUNK_MIB (default "256 1024 4096"). Writes $OUT/corun_chunks.txt.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
if ls .tools/bubblewrap_*.deb >/dev/null 2>&1; then  # the hosts sandboxed, as the worker runs them
  mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root && export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
fi
[ -x .tools/ccache/bin/ccache ] && export OPTDRIFT_CCACHE=$PWD/.tools/ccache/bin/ccache
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels >/dev/null || { echo "installing the carried wheels failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD
# shellcheck disable=SC2086
timeout 300 python3 bench/corun_chunks.py --battery standard --device cuda --chunk-mib ${CHUNK_MIB:-256 1024 4096} \
  2>&1 | tee "$OUT/corun_chunks.txt"
status=${PIPESTATUS[0]}
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/worker/engine/test_corun_fast.py -k cuda 2>&1 | tee -a "$OUT/corun_chunks.txt"
exit $(( status | PIPESTATUS[0] ))
