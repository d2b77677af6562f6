#!/usr/bin/env bash
# Issue 36 on the H200, one call: the bundled csrc at one commit built four ways (today's
# --fmad=false sm_90 SASS; --fmad=true; 8.0+PTX, JIT-compiled by the driver; --use_fast_math),
# submitted to the service on its embedded default with one GPU worker in the bubblewrap box, each
# variant compared with the plain build, and, for each one that moved, the worker's environment
# attribution (worker/jobs/environment_attribution.py: both builds co-run on the changed cases,
# parameters and state leaves recorded, classified) waited for and tallied
# (bench/gpu/env_variants.py).
# Here first: bash bench/gpu/fetch_wheels.sh; (cd .tools && apt-get download bubblewrap)
# Through the device tool: run(command="bash bench/gpu/h200_env_attribution.sh", carry=[".whl", ".tools"], timeout_s=600)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
stamp "environment variants and their attribution through the service" | tee "$OUT/env_attribution.txt"
# VARIANTS='{"fmad": {"cuda_cflags": ["--fmad=true"]}}' for some of them (OPTDRIFT_BUILD_VARIANTS's JSON)
timeout ${LIMIT_S:-540} python3 bench/gpu/env_variants.py --battery quick --log-dir "$OUT/variants" ${VARIANTS:+--variants "$VARIANTS"} \
  --timeout-s $(( ${LIMIT_S:-540} - 60 )) 2>&1 | tee -a "$OUT/env_attribution.txt"
echo "env_variants exit ${PIPESTATUS[0]}" | tee -a "$OUT/env_attribution.txt"
stamp "done" | tee -a "$OUT/env_attribution.txt"
