#!/usr/bin/env bash
# Issue 20's adapter lifecycle on the H200 (about 2 minutes): the library-owned fixture
# (tests/fixtures/ownedopt) through both engines on CUDA — the fast engine's CUDA graph digesting
# state the library owns, copied after each step — and the fast engine's CUDA identity tests
# (bundled, handed-over states) on the lifecycle's arena setup.
# Through the device tool: run(command="bash bench/gpu/h200_adapter_lifecycle.sh", carry=[".whl"], timeout_s=400).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
source "$(dirname "$0")/carried_wheels.sh"
install_carried_wheels .whl/pydantic*.whl .whl/annotated_types*.whl .whl/typing_inspection*.whl \
  .whl/typing_extensions*.whl .whl/python_dotenv*.whl || exit 1
status=0
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/adapters/test_adapter_lifecycle.py -k cuda 2>&1 \
  | tee "$OUT/pytest_adapter_lifecycle.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
timeout 200 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/engine/test_fast_engine.py -k cuda 2>&1 \
  | tee "$OUT/pytest_fast_cuda.txt"; [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
grep -q "skipped" "$OUT/pytest_adapter_lifecycle.txt" && { echo "the CUDA test skipped: no GPU seen"; status=1; }
exit $status
