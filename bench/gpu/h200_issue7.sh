#!/usr/bin/env bash
# Issue 7 on the H200 in ONE call (about 3.5 minutes): build times (cold, cache hit, one file
# changed; through ccache when the image has it), the floors, the od2/fast-engine GPU tests, and
# the standard battery straightforward vs optimized with every digest compared.
# Through the device tool: run(command="bash bench/gpu/h200_issue7.sh", carry=[".whl"], timeout_s=260).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
if [ -d .whl ]; then  # pure-Python packages the GPU image lacks (pydantic...), carried as wheels
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
{
  nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nproc
} 2>&1 | tee "$OUT/gpu.txt"

export OPTDRIFT_BUILD_CACHE=/tmp/optdrift-builds-issue7
rm -rf "$OPTDRIFT_BUILD_CACHE"
# No pipe around this block: its exports must reach the builds below.
if command -v ccache >/dev/null; then
  export CCACHE_DIR=/tmp/ccache-issue7 CCACHE_BASEDIR=/tmp CCACHE_NOHASHDIR=1 \
         PYTORCH_NVCC="ccache $(command -v nvcc)" CXX="ccache c++"
  rm -rf "$CCACHE_DIR"
  stamp "ccache: $(command -v ccache) ($(ccache --version | head -1)); builds go through it" > "$OUT/build_times.txt"
else
  stamp "ccache: absent on this image (which ccache found nothing); one-file-changed is a full rebuild" > "$OUT/build_times.txt"
fi
cat "$OUT/build_times.txt"
stamp "build times" | tee -a "$OUT/build_times.txt"
timeout 120 python3 bench/build_times.py --archs 9.0 --cache "$OPTDRIFT_BUILD_CACHE" 2>&1 | tee -a "$OUT/build_times.txt"
command -v ccache >/dev/null && ccache -s 2>&1 | tee -a "$OUT/build_times.txt"

stamp "floors" | tee "$OUT/floors.txt"
timeout 60 python3 bench/floors.py 2>&1 | tee -a "$OUT/floors.txt"
FLOOR=$(awk '/graph-replayed/ {for (i = 1; i <= NF; i++) if ($i == "per") print $(i-1)}' "$OUT/floors.txt" | head -1)

stamp "GPU tests (od2 CPU==CUDA, fast engine == run_case on CUDA)" | tee "$OUT/pytest_fast.txt"
timeout 60 python3 -m pytest -q -rs -p no:cacheprovider tests/test_fast_engine.py -k cuda 2>&1 | tee -a "$OUT/pytest_fast.txt"

stamp "battery speed" | tee "$OUT/battery_speed.txt"
timeout 170 python3 bench/battery_speed.py --battery standard --device cuda --straight-budget-s 40 \
  ${FLOOR:+--floor-us "$FLOOR"} --json-out "$OUT/battery_speed.json" 2>&1 | tee -a "$OUT/battery_speed.txt"
stamp "done"
