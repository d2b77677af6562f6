#!/usr/bin/env bash
# One device call for issues 34-36 when the device is scarce, each part time-boxed, the most needed
# first, every build and kernel host in the worker's bubblewrap box:
#   1. the end to end (bench/gpu/h200_e2e.sh: the service, a GPU worker, the bundled kernels and the
#      decay reorder through the REST API, standard battery) — issue 35's "figures within noise";
#   2. bench/gpu/env_variants.py: csrc as today, with --fmad=true and as 8.0+PTX — issue 36;
#   3. `optdrift check --battery standard` on the decay reorder, its phase line — issue 34.
# Here first: bash bench/gpu/fetch_wheels.sh; mkdir -p .tools && (cd .tools && apt-get download bubblewrap)
# Through the device tool: run(command="bash bench/gpu/h200_session.sh", carry=[".whl", ".tools"], timeout_s=600)
# $OUT (8 files): session.txt, env.txt, e2e_table.txt, e2e/{service,worker}.log, e2e/e2e.json, env_variants.txt, check_standard.txt.
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
python3 -c "from worker import sandbox; print('sandbox:', sandbox.status())" 2>&1 | tee "$OUT/session.txt"
stamp "1. end to end" | tee -a "$OUT/session.txt"
E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-240} E2E_DEADLINE_S=${E2E_DEADLINE_S:-205} bash bench/gpu/h200_e2e.sh > /tmp/e2e.txt 2>&1
rc=$?; tail -25 /tmp/e2e.txt; echo "e2e exit $rc" | tee -a "$OUT/session.txt"
stamp "2. environment variants" | tee -a "$OUT/session.txt"
timeout 200 python3 bench/gpu/env_variants.py --battery quick --log-dir /tmp/variants --timeout-s 175 2>&1 \
  | tee "$OUT/env_variants.txt" | tail -40
stamp "3. check --battery standard on the decay reorder" | tee -a "$OUT/session.txt"
python3 -c "from pathlib import Path; from worker.mutations import copy_tree, decay_after_update; decay_after_update(copy_tree(Path('csrc'), Path('/tmp/decay')))"
timeout $(( 585 - ($(date +%s) - T0) )) python3 -m service.cli check --source /tmp/decay --baseline csrc \
  --battery standard --device cuda --json-out /tmp/check_standard.json > "$OUT/check_standard.txt" 2>&1
echo "check exit $?" | tee -a "$OUT/session.txt"; tail -4 "$OUT/check_standard.txt"
stamp "done" | tee -a "$OUT/session.txt"
