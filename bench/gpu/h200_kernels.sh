#!/usr/bin/env bash
# Kernel figures on the H200 (issues 2 and 6): build times, the kernel test suite on CUDA, Adam
# bandwidth, per-op accuracy against float64, 8-bit closed-form distances.
# Run from the repository root on a GPU machine; logs go to $OUT (default ./gpu-out).
# Through the device tool: run(command="bash bench/gpu/h200_kernels.sh", carry=[".whl"]).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_BUILD_CACHE=${OPTDRIFT_BUILD_CACHE:-/tmp/optdrift-builds}
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1  # pydantic and the rest the image lacks
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
python3 bench/build_times.py --archs 9.0 --cache "$OPTDRIFT_BUILD_CACHE" 2>&1 | tee "$OUT/build_times.txt"
python3 bench/adam_bandwidth.py 2>&1 | tee "$OUT/adam_bandwidth.txt"
python3 -m pytest -q -rs -p no:cacheprovider tests/csrc/test_kernels_32bit.py tests/csrc/test_kernels_opcheck.py \
  tests/csrc/test_kernels_bad_input.py tests/worker/references/test_quant_map.py tests/csrc/test_kernels_8bit.py \
  tests/csrc/test_kernels_8bit_acceptance.py tests/csrc/test_kernels_discriminate.py tests/worker/engine/test_gradients.py \
  2>&1 | tee "$OUT/pytest_kernels.txt"
python3 bench/kernel_accuracy.py --device cuda 2>&1 | tee "$OUT/kernel_accuracy.txt"
python3 -m worker.references.closed_form_8bit --device all 2>&1 | tee "$OUT/closed_form_8bit.txt"
