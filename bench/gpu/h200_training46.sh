#!/usr/bin/env bash
# Issue 46 on CUDA (training impact):
#   1. bench/training_impact.py --device cuda --model-set standard: every scenario (the decay reorder,
#      cold and again with its baseline cached,
#      at both points for Adam and AdEMAMix — one standard job's four configurations —, a dropped
#      bias correction, eps inside the square root, the first moment weighted by 1-beta2, a
#      reassociated update, a comment-only change)
#      trained through the job's host pool (the worker's default on this machine's cores) against the
#      bundled kernels; the raw runs into
#      $OUT/training_raw.json (the table is made from it where scipy is: --table);
#   2. tests/worker/training/test_loop.py on CUDA: two training runs of one build bit-identical.
# Through the device tool:
#   run(command="bash bench/gpu/h200_training46.sh", carry=[".whl", ".tools"], timeout_s=600)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
LOG="$OUT/training46.txt"
CACHE=/tmp/training-builds
stamp "1. training impact, standard model set, on CUDA" | tee "$LOG"
timeout ${BENCH_LIMIT_S:-470} python3 bench/training_impact.py --device cuda --model-set standard \
  --scenarios "${SCENARIOS:-decay reorder,decay reorder (baseline cached),1-beta2 in first moment,eps inside sqrt,no bias correction,reassociated update,comment-only}" \
  --build-cache "$CACHE" --raw "$OUT/training_raw.json" 2>&1 | tail -40 | tee -a "$LOG"
stamp "2. two training runs of one build are bit-identical on CUDA" | tee -a "$LOG"
OPTDRIFT_BUILD_CACHE="$CACHE" timeout 100 python3 -m pytest -q -rs -p no:cacheprovider \
  tests/worker/training/test_loop.py 2>&1 | tail -8 | tee -a "$LOG"
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
