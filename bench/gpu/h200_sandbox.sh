#!/usr/bin/env bash
# The sandbox on the H200 in one call (a few minutes): bubblewrap unpacked from the carried Debian
# package, the sandbox tests (CUDA kernel host in the box, nvcc build in the box), then the standard
# battery through the kernel host with and without the box (bench/sandbox_overhead.py).
# Here first: mkdir -p .tools && (cd .tools && apt-get download bubblewrap); bash bench/gpu/fetch_wheels.sh
# Through the device tool: run(command="bash bench/gpu/h200_sandbox.sh", carry=[".whl", ".tools"], timeout_s=580).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root || exit 1
export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
{ nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  python3 -c "import sys, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, sys.executable, sys.prefix)"
  id; command -v setpriv; "$OPTDRIFT_BWRAP" --version; ls -la /dev/nvidia* | head
  python3 -c "from worker import sandbox; print('sandbox:', sandbox.status())"; } 2>&1 | tee "$OUT/gpu.txt"
stamp "sandbox tests" | tee "$OUT/pytest_sandbox.txt"
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/sandbox/test_sandbox.py 2>&1 | tee -a "$OUT/pytest_sandbox.txt"
stamp "standard battery with and without the box" | tee "$OUT/sandbox_overhead.txt"
timeout 300 python3 bench/sandbox_overhead.py --battery standard --device cuda --repeats 3 2>&1 | tee -a "$OUT/sandbox_overhead.txt"
stamp "done"
