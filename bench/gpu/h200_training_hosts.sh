#!/usr/bin/env bash
# Issue 46's GPU budget against the host pool's size: the decay reorder's standard job (four
# configurations, 192 runs of 300 steps, the baseline's and the floor's runs cold) trained through
# pools of ${HOSTS:-4 8 12 16} kernel hosts, each from a cold run cache (builds shared in /tmp).
# Through the device tool:
#   run(command="bash bench/gpu/h200_training_hosts.sh", carry=[".whl", ".tools"], timeout_s=600)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
LOG="$OUT/training_hosts.txt"
nproc | sed 's/^/cores: /' | tee "$LOG"
for hosts in ${HOSTS:-4 8 12 16}; do
  stamp "decay reorder, standard set, --hosts $hosts" | tee -a "$LOG"
  timeout ${BENCH_LIMIT_S:-170} python3 bench/training_impact.py --device cuda --model-set standard \
    --scenarios "decay reorder" --build-cache /tmp/training-builds --hosts "$hosts" \
    --raw "$OUT/training_hosts_$hosts.json" 2>&1 | grep -E "runs in|builds:|Error|error" | tee -a "$LOG"
done
stamp "done" | tee -a "$LOG"
