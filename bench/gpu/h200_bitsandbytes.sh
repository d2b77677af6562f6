#!/usr/bin/env bash
# Issue 9 on the H200: bitsandbytes 0.50.2's CUDA kernels through worker.adapters.bitsandbytes.
#   1. bench/bnb_8bit_one_state.py: one 8-bit blockwise RMSprop/Adagrad/Adam step element by
#      element, adapter vs bnb's own optimizer class vs float64 vs two models of the update (is the
#      adapter or bnb's kernel responsible for the 8-bit RMSprop/Adagrad distance?);
#   2. bench/bnb_battery.py: EVERY standard-battery case at the typical (lr 1e-3, wd 1e-2) and
#      discriminating (lr 0.1, wd 0.1) points (fp32, fp16 and bf16; 674 cases on CUDA), sharded over
#      SHARDS processes on the one GPU, each with its own kernel host, merged into one table.
# Through the device tool:
#   run(command="bash bench/gpu/h200_bitsandbytes.sh", carry=[".whl"], timeout_s=420)
# .whl holds bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl and the pure-Python packages the
# image lacks (pydantic, pydantic_core cp312, annotated_types, typing_inspection, typing_extensions,
# pydantic_settings, python_dotenv; docs/BITSANDBYTES.md lists the download commands).
# $OUT gets: bnb_diagnostic.txt, bnb_battery_log.txt, bnb_battery_table.md, bnb_battery_results.json.
# The same script on a CPU (slow: the 1M-element case alone takes a minute there):
#   INSTALL_WHEELS=0 PYTHON=.venv/bin/python DEVICE=cpu SHARDS=2 BUDGET_S=60 bash bench/gpu/h200_bitsandbytes.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ "${INSTALL_WHEELS:-1}" = 1 ]; then  # the carried wheels this script needs, and only those
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/bitsandbytes-0.50.2-*.whl .whl/pydantic-2*.whl .whl/pydantic_core-*cp312*.whl .whl/pydantic_settings-*.whl \
    .whl/annotated_types-*.whl .whl/typing_inspection-*.whl .whl/typing_extensions-*.whl .whl/python_dotenv-*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
SHARDS=${SHARDS:-8}        # processes on the one GPU (16 cores: each shard + its kernel host)
BUDGET_S=${BUDGET_S:-200}  # a shard sends no new request after this many seconds
MODE=${MODE:-one}          # one: a case per request (the plain engine path); many: run_many per dtype
SHARD_LIMIT_S=${SHARD_LIMIT_S:-240}  # hard limit per shard process; what it finished is kept
LOG="$OUT/bnb_battery_log.txt"
started=$(date +%s)

{
  echo "== $(date -u +%FT%TZ) device $DEVICE, $SHARDS shards, mode $MODE, budget ${BUDGET_S} s, limit ${SHARD_LIMIT_S} s"
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv,noheader
  "$PYTHON" -c 'import torch, bitsandbytes, pydantic; print("torch", torch.__version__, "cuda", torch.version.cuda, "| bitsandbytes", bitsandbytes.__version__, bitsandbytes.__file__, "| pydantic", pydantic.VERSION)'
} 2>&1 | tee "$LOG"

# 1. the element-by-element diagnostic (about ten seconds)
timeout 120 "$PYTHON" bench/bnb_8bit_one_state.py --device "$DEVICE" --sizes 256 4097 --show 4 \
  2>&1 | tee "$OUT/bnb_diagnostic.txt"
echo "diagnostic exit: ${PIPESTATUS[0]} after $(( $(date +%s) - started )) s" | tee -a "$LOG"
# the two models' distances on the battery's own fp32 1-step cases (CPU), to set beside the table
"$PYTHON" bench/bnb_8bit_one_state.py --battery-models 2>&1 | grep -v kernels-community | tee -a "$OUT/bnb_diagnostic.txt"

# 2. the whole selection, sharded
"$PYTHON" bench/bnb_battery.py plan --device "$DEVICE" --shards "$SHARDS" 2>&1 | tee -a "$LOG"
SHARD_DIR=$(mktemp -d /tmp/bnb-shards.XXXXXX)
pids=()
for ((shard = 0; shard < SHARDS; shard++)); do
  timeout -k 20 "$SHARD_LIMIT_S" "$PYTHON" bench/bnb_battery.py run --device "$DEVICE" --shard "$shard" \
    --shards "$SHARDS" --mode "$MODE" --budget-s "$BUDGET_S" --out "$SHARD_DIR/shard$shard.jsonl" \
    >"$SHARD_DIR/shard$shard.log" 2>&1 &
  pids+=($!)
done
for ((shard = 0; shard < SHARDS; shard++)); do
  wait "${pids[$shard]}"
  echo "shard $shard exit: $? after $(( $(date +%s) - started )) s" | tee -a "$LOG"
done
for ((shard = 0; shard < SHARDS; shard++)); do
  grep -v "kernels-community" "$SHARD_DIR/shard$shard.log" | tail -n 40 >>"$LOG"
done
"$PYTHON" bench/bnb_battery.py merge --device "$DEVICE" --table "$OUT/bnb_battery_table.md" \
  --json "$OUT/bnb_battery_results.json" "$SHARD_DIR"/shard*.jsonl 2>&1 | tee -a "$LOG"
echo "merge exit: ${PIPESTATUS[0]}; total $(( $(date +%s) - started )) s" | tee -a "$LOG"
