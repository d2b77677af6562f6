#!/usr/bin/env bash
# The session's last device call: today's tree on CUDA after the day's engine changes (reference
# digests in the kernel host, state families, the compile cache handed to every host), in the
# worker's bubblewrap box:
#   1. the sandbox tests (the CUDA kernel host and the nvcc build in the box) and the CUDA engine tests;
#   2. `optdrift check --battery quick --device cuda` on the decay-after-update copy of csrc
#      (two builds, co-run, attribution; exit 1 expected).
# Through the device tool: run(command="bash bench/gpu/h200_final.sh", carry=[".whl", ".tools"], timeout_s=540)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
stamp "1. sandbox and CUDA engine tests" | tee "$OUT/final.txt"
timeout ${TESTS_LIMIT_S:-270} python3 -m pytest -q -rs -p no:cacheprovider tests/worker/sandbox tests/worker/engine/test_fast_engine.py \
  tests/worker/engine/test_od2_op.py tests/worker/engine/test_cuda_errors.py tests/worker/engine/test_reference_cache.py \
  tests/worker/engine/test_step_inputs.py tests/worker/engine/test_quant_series.py tests/csrc/test_kernels_bad_input.py 2>&1 | tail -40 | tee -a "$OUT/final.txt"
stamp "2. check --battery quick on the decay reorder" | tee -a "$OUT/final.txt"
python3 -c "from pathlib import Path; from worker.mutations import copy_tree, decay_after_update; decay_after_update(copy_tree(Path('csrc'), Path('/tmp/decay')))"
OPTDRIFT_BUILD_CACHE=/tmp/check-cache timeout $(( ${FINAL_LIMIT_S:-520} - ($(date +%s) - T0) )) python3 -m service.cli check \
  --source /tmp/decay --baseline csrc --battery quick --device cuda > "$OUT/check_quick.txt" 2>&1
echo "check exit $?" | tee -a "$OUT/final.txt"; grep -E "^adapter|^attribution|s: builds|optdrift verdict|error" "$OUT/check_quick.txt" | cut -c1-300 | tee -a "$OUT/final.txt"
stamp "done" | tee -a "$OUT/final.txt"
