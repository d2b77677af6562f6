#!/usr/bin/env bash
# The kernels' own speed on the H200 in one call (about 5 minutes; the first CUDA build of csrc is
# most of it on a fresh machine): the CUDA timing test, then bench/kernel_speed.py — every bundled
# kernel (6 optimizers x 32-bit/8-bit x fp32/bf16) at 2^20 and 2^26 elements with its median,
# spread and bandwidth as a fraction of a same-bytes device-to-device copy; 20 no-change reruns in
# fresh processes, none of which may be flagged; the adam/32bit mutant with an extra pass over 35 %
# of the parameter (+10 % of its fp32 traffic), which must be flagged.
# Through the device tool: run(command="bash bench/gpu/h200_kernel_speed.sh", carry=[".whl"], timeout_s=600).
# RERUNS (default 20) no-change reruns; MAX_S (default 420) stops starting reruns after that.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
source "$(dirname "$0")/carried_wheels.sh"
# only what it needs: pydantic and its needs (numpy and torch come with the image)
install_carried_wheels .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl \
  .whl/typing_extensions*.whl .whl/python_dotenv*.whl .whl/pydantic_settings*.whl || exit 1
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
{ nvidia-smi --query-gpu=name,compute_cap,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; nproc; } 2>&1 | tee "$OUT/gpu.txt"
stamp "CUDA timing test" | tee "$OUT/pytest_kernel_speed.txt"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/speed/test_kernel_speed_cuda.py 2>&1 | tee -a "$OUT/pytest_kernel_speed.txt"
stamp "kernel speed" | tee "$OUT/kernel_speed.txt"
timeout 540 python3 bench/kernel_speed.py --device cuda --sizes 1048576 67108864 --repeats 50 \
  --reruns "${RERUNS:-20}" --max-s "${MAX_S:-420}" --mutant adam/32bit --mutant-fraction 0.35 \
  --json-out "$OUT/kernel_speed.json" 2>&1 | tee -a "$OUT/kernel_speed.txt"
stamp "done"
