#!/usr/bin/env bash
# Issue 7, deliverable 4, on the H200: the service on its embedded default (SQLite + kombu's
# filesystem broker, everything in a fresh OPTDRIFT_HOME) with `optdrift worker --gpus all`, the
# bundled kernels and the decay-after-update copy submitted through the REST API, and the
# submit-to-verdict latency of each commit with the standard battery (bench/e2e_latency.py).
#
# Here first (the image has no fastapi, sqlalchemy, celery, pydantic...; no network there):
#   bash bench/gpu/fetch_wheels.sh
# Through the device tool:
#   run(command="bash bench/gpu/h200_e2e.sh", carry=[".whl"], timeout_s=570)
#
# Budget: about 5 minutes when the standard battery takes ~60 s (A: cold build ~25 s + battery;
# C: battery; B-build: a second full compile + the quick battery; B: battery). The Python part
# stops itself at E2E_DEADLINE_S (default 420 s; commits that no longer fit are skipped and
# reported) and is killed at E2E_TIMEOUT_S (default 480 s).
# $OUT: env.txt, e2e_table.txt, e2e/service.log, e2e/worker.log, e2e/e2e.json (5 files).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }

if ! ls .whl/*.whl >/dev/null 2>&1; then
  echo "FAILED: no wheels in .whl/: run bench/gpu/fetch_wheels.sh on the development machine and carry .whl" | tee "$OUT/env.txt"
  exit 2
fi
stamp "installing $(ls .whl/*.whl | wc -l) carried wheels into /tmp/site" | tee "$OUT/env.txt"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  2>&1 | tee -a "$OUT/env.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: pip install of .whl" | tee -a "$OUT/env.txt"; exit 2; }
# The project runs from this plain copy of the tree: `python3 -m service.cli` with the repo root on
# PYTHONPATH (no `pip install -e .`: that needs setuptools' build backend and the network).
export PYTHONPATH=/tmp/site:$PWD

{
  stamp "environment"
  nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total --format=csv
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo "cores $(nproc); nvcc $(nvcc --version | tail -1); ninja $(ninja --version 2>/dev/null || echo absent); ccache $(command -v ccache || echo absent)"
  # Fail in seconds, not minutes, when a package is missing: every module the API, the CLI and a
  # Celery worker import (torch is imported only by the kernel host).
  python3 -c "
import fastapi, starlette, uvicorn, sqlalchemy, alembic, celery, kombu, pydantic, pydantic_settings, typer, rich, httpx, multipart, jinja2, prometheus_client
import service.api.main, service.cli, service.cli.client, service.db.migrate, worker.celery_app, worker.tasks, worker.gpu_workers
print('imports ok: fastapi', fastapi.__version__, 'sqlalchemy', sqlalchemy.__version__, 'celery', celery.__version__, 'pydantic', pydantic.VERSION)
"
} 2>&1 | tee -a "$OUT/env.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "FAILED: the environment check above" | tee -a "$OUT/env.txt"; exit 2; }

stamp "end to end: bench/e2e_latency.py --battery standard --gpus all" | tee "$OUT/e2e_table.txt"
# SIGTERM at the limit: the script stops the service and the workers and prints the rows so far.
timeout --kill-after=60 "${E2E_TIMEOUT_S:-480}" python3 bench/e2e_latency.py --battery standard --gpus all \
  --log-dir "$OUT/e2e" --deadline-s "${E2E_DEADLINE_S:-420}" --run-timeout-s 300 2>&1 | tee -a "$OUT/e2e_table.txt"
rc=${PIPESTATUS[0]}
case $rc in
  0) verdict="all checks passed" ;;
  1) verdict="a check FAILED (see the table's check column and FAILED lines)" ;;
  2) verdict="the service or worker could not run to the end (see $OUT/e2e/service.log, worker.log)" ;;
  124|137) verdict="KILLED at the ${E2E_TIMEOUT_S:-480} s limit" ;;
  *) verdict="exit $rc" ;;
esac
stamp "e2e_latency.py exit $rc: $verdict" | tee -a "$OUT/e2e_table.txt"
# What the worker log says went wrong, if anything (tracebacks, failed runs).
grep -nE "Traceback|ERROR|failed|raised" "$OUT/e2e/worker.log" 2>/dev/null | head -20 | tee -a "$OUT/e2e_table.txt"
# Each kernel host's start (worker.engine.host: phases on the host's clock; a spare host taken by
# a run shows "build received", worker.engine.host_reserve).
grep -oE "kernel host for .* started in .*" "$OUT/e2e/worker.log" 2>/dev/null | sed -E 's/for [^ ]+ /for <build> /' \
  | head -20 | tee -a "$OUT/e2e_table.txt"
exit "$rc"
