#!/usr/bin/env bash
# Issue 45 on CUDA (one optimizer over several tensors):
#   1. the layout-case, multi-tensor-op and group-lifecycle tests on the GPU (reproducible digests,
#      both engines, references equal to torch.optim with param groups single-tensor and foreach,
#      the multi op equal to the CPU op, bitsandbytes' optimizers over param groups);
#   2. bench/multi_tensor_bandwidth.py (the multi-tensor Adam beside the one-tensor op);
#   3. `optdrift check --battery quick --device cuda` on the DeepSpeed 0.19.0 pattern's mirror
#      (shared_state/beta_powers_recomputed_per_tensor): one-tensor cases unchanged, Adam/AdEMAMix
#      layout cases changed from step 3.
# Through the device tool:
#   run(command="bash bench/gpu/h200_layouts45.sh", carry=[".whl", ".tools"], timeout_s=590)
# The catalogue's shared-state defects on CUDA (second call):
#   run(command="BATTERY=quick MUTANTS=pick:shared_state,tail/multi_chunk_end_late,tail/multi_chunk_end_early CUDA_ERROR_TESTS=0 bash bench/gpu/sensitivity_cuda.sh",
#       carry=[".whl", ".tools"], timeout_s=600)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
LOG="$OUT/layouts45.txt"
stamp "1. layout / multi-tensor / group-lifecycle tests on CUDA" | tee "$LOG"
timeout ${TESTS_LIMIT_S:-240} python3 -m pytest -q -rs -p no:cacheprovider tests/worker/engine/test_layout_cases.py \
  tests/worker/adapters/test_bundled_multi_tensor.py tests/csrc/test_kernels_multi_opcheck.py \
  tests/worker/adapters/test_group_lifecycle.py -rf --tb=line 2>&1 | grep -E "^FAILED|^/|passed|failed" | tail -25 | tee -a "$LOG"
stamp "1b. CPU against CUDA, multi and one-tensor ops" | tee -a "$LOG"
timeout 120 python3 bench/gpu/multi_cpu_vs_cuda.py 2>&1 | tail -40 | tee -a "$LOG"
stamp "2. multi-tensor bandwidth" | tee -a "$LOG"
timeout 120 python3 bench/multi_tensor_bandwidth.py 2>&1 | tail -20 | tee -a "$LOG"
stamp "3. check --battery quick --device cuda on the DeepSpeed 0.19.0 pattern's mirror" | tee -a "$LOG"
python3 - <<'PY'
from pathlib import Path
from worker.sensitivity.catalogue import load_catalogue, mutant_tree
(m,) = [m for m in load_catalogue() if m.id == "shared_state/beta_powers_recomputed_per_tensor"]
mutant_tree(m, Path("csrc"), Path("/tmp/ds-pattern"))
PY
OPTDRIFT_BUILD_CACHE_DIR=/tmp/check-cache timeout $(( ${FINAL_LIMIT_S:-570} - ($(date +%s) - T0) )) python3 -m service.cli check \
  --source /tmp/ds-pattern --baseline csrc --battery quick --device cuda --wide > "$OUT/check_ds_pattern.txt" 2>&1
echo "check exit $?" | tee -a "$LOG"; grep -E "^adapter|^attribution|s: builds|optdrift verdict|CHANGED|UNCHANGED|first divergent|tensors changed|error|Traceback" "$OUT/check_ds_pattern.txt" | cut -c1-300 | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
