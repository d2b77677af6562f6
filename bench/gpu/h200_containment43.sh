#!/usr/bin/env bash
# Issue 43 on CUDA, in the worker's bubblewrap box (root, boxes dropping to 65534):
#   1. the sandbox tests: worker.sandbox.boxfiles, the hostile-box harness (a compiler gone bad, a
#      command build, a kernel host swapping its output files), the box itself, the privilege drop;
#   2. the bundled csrc built for sm_90 with the box writing only <staging>/out (its log and manifest
#      beside it), and the CUDA kernel tests over that build;
#   3. `optdrift check --battery quick --device cuda` on the decay-after-update copy of csrc (two
#      builds, the co-run taking its chunk files through boxfiles, attribution reading states):
#      exit 1 expected.
# Through the device tool:
#   run(command="bash bench/gpu/h200_containment43.sh", carry=[".whl", ".tools"], timeout_s=590)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
LOG="$OUT/containment43.txt"
stamp "1. sandbox tests (boxfiles, hostile box, the box, privilege)" | tee "$LOG"
timeout ${TESTS_LIMIT_S:-260} python3 -m pytest -q -rs -p no:cacheprovider tests/worker/sandbox \
  tests/worker/engine/test_host_params_file.py 2>&1 | tail -25 | tee -a "$LOG"
stamp "2. csrc for sm_90 in the box; CUDA kernel tests" | tee -a "$LOG"
python3 - <<'PY' 2>&1 | tee -a "$LOG"
import json, os, time
from pathlib import Path
from worker.build import build_extension
started = time.monotonic()
result = build_extension(Path("csrc"), cache_dir=Path("/tmp/cuda-cache"), cuda_archs=["9.0"])
entry = Path(result.library_path).parents[1] if result.ok else None
print(f"build ok={result.ok} cached={result.cached} {time.monotonic() - started:.1f} s archs={result.cuda_archs}")
print("library:", result.library_path, "| log:", result.log_path, "| error:", (result.error or "")[:300])
if entry is not None:
    print("entry holds:", sorted(p.name for p in entry.iterdir()), "| out owned by uid", os.stat(entry / "out").st_uid)
    print("manifest library_path:", json.loads((entry / "manifest.json").read_text())["library_path"])
PY
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/csrc/test_kernels_bad_input.py tests/csrc/test_kernels_32bit.py \
  -k "cuda or not cpu" 2>&1 | tail -6 | tee -a "$LOG"
stamp "3. check --battery quick --device cuda on the decay reorder" | tee -a "$LOG"
python3 -c "from pathlib import Path; from worker.mutations import copy_tree, decay_after_update; decay_after_update(copy_tree(Path('csrc'), Path('/tmp/decay')))"
OPTDRIFT_BUILD_CACHE=/tmp/check-cache timeout $(( ${FINAL_LIMIT_S:-570} - ($(date +%s) - T0) )) python3 -m service.cli check \
  --source /tmp/decay --baseline csrc --battery quick --device cuda > "$OUT/check_quick.txt" 2>&1
echo "check exit $?" | tee -a "$LOG"; grep -E "^adapter|^attribution|s: builds|optdrift verdict|error|Traceback" "$OUT/check_quick.txt" | cut -c1-300 | tee -a "$LOG"
stamp "done" | tee -a "$LOG"
