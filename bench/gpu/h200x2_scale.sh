#!/usr/bin/env bash
# Issue 19 on two H200s (kind nvidia-h200-x2), in one call, each part printing its JSON line as it
# finishes (so a call cut short still reports what it finished):
#  1. drain N commits (standard battery, warm builds) with one GPU worker (`optdrift worker
#     --gpus 0`), then one per GPU (`--gpus all`); every run must be taken once
#     (bench/scale_drain.py: a `plan` line, one line per configuration, the table);
#  2. `kill -9` of the GPU worker holding a run mid-run: the other GPU's worker finishes it,
#     attempt 2, one verdict, each case once (bench/scale_kill.py: one line, the table).
# Here first: bash bench/gpu/fetch_wheels.sh (and .tools: bubblewrap's .deb, ccache). Through the
# device tool:
#   run(command="bash bench/gpu/h200x2_scale.sh", kind="nvidia-h200-x2", carry=[".whl", ".tools"], timeout_s=600)
#
# How many commits. COMMITS (default 20, the issue's number) is the most. The drain takes the most
# that fit, rounded down to a multiple of 2 (scale_drain.py --budget-s), once its first base (cold
# imports, cold build) and one warm commit alone are in: one GPU costs that warm commit x 1.15
# + 0.5 s (the broker's poll) per commit, unless PER_COMMIT_S fixes it; two GPUs half that; the
# second configuration SETUP_S (40: stop, start, its base and warm commit). The kill test keeps
# KILL_RESERVE_S (100; it needs about 50: API and workers ~10 s, base ~12 s, the victim to its
# first cases ~6 s, re-queue ~4 s, re-run ~12 s, stops) of the CALL_S (590).
# The arithmetic with the 3-4 min of cold imports the last x2 call saw and the 12.07 s warm commit
# of docs/perf-log/2026-12-01-round-3.md: wheels ~20 s, so the drain gets 590 - 100 - 20 = 470 s (455 for
# itself); its base is in after ~210 s of cold imports and a ~35 s cold build, the warm commit
# 12 s later, leaving 455 - 257 = 198 s; per commit 12.07 x 1.15 + 0.5 = 14.4 s:
# (198 - 40) / (14.4 x 1.5) = 7.3 -> 6 commits. If the spare kernel host (worker.engine.host_reserve)
# saves its 4.4 s a commit: (202 - 40) / (9.4 x 1.5) = 11.5 -> 10. 20 commits need
# 20 x 14.4 x 1.5 + 40 = 472 s after the warm commit: more than the whole drain's 455 s, so not in
# one call with the kill test on a cold machine. With KILL_RESERVE_S=0 (the drain alone): 10 (18
# with the spare host). On a machine still warm from an earlier call (its base in ~35 s): 16 (20).
set -uo pipefail
SECONDS=0
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
CALL_S=${CALL_S:-590}
KILL_RESERVE_S=${KILL_RESERVE_S:-100}
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0 OPTDRIFT_SPEED_BUDGET_S=0
stamp() { echo "[t+${SECONDS}s] $*"; }
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels || exit 1
if ls .tools/bubblewrap_*.deb >/dev/null 2>&1; then
  mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root && export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
fi
[ -x .tools/ccache/bin/ccache ] && export OPTDRIFT_CCACHE=$PWD/.tools/ccache/bin/ccache
nvidia-smi --query-gpu=index,name,compute_cap --format=csv,noheader | tee "$OUT/gpus.txt"

budget=$(( CALL_S - KILL_RESERVE_S - SECONDS ))
stamp "drain: at most ${COMMITS:-20} commits, ${budget} s"
# --budget-s leaves 15 s for the last configuration's stop; `timeout` is the hard stop (SIGTERM:
# the drain stops its service and prints a cut_short line).
timeout -s TERM -k 20 "$budget" python3 bench/scale_drain.py --battery standard --commits "${COMMITS:-20}" \
  --budget-s $(( budget - 15 )) ${PER_COMMIT_S:+--per-commit-s "$PER_COMMIT_S"} --setup-s "${SETUP_S:-40}" \
  --config gpus=0 --config gpus=all --logs "$OUT/drain-logs" --json-out "$OUT/scale_drain.json"
stamp "drain exited with $?"

left=$(( CALL_S - SECONDS ))
stamp "kill -9 test: ${left} s"
timeout -s TERM -k 15 "$left" python3 bench/scale_kill.py --config gpus=all --battery standard \
  --timeout-s $(( left > 30 ? left - 20 : 10 )) --logs "$OUT/kill-logs" --json-out "$OUT/scale_kill.json"
stamp "kill test exited with $?"
