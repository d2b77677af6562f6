#!/usr/bin/env bash
# Issue 33 on the H200, one call: the box built by the worker's own launcher (bwrap, setpriv and env
# by absolute path; the child's environment applied by `env -i` after the drop) around the CUDA
# kernel host and the nvcc build, as root (the device runs commands as root: the setpriv path).
#   1. tests/worker/sandbox/test_sandbox.py (CUDA kernel host and nvcc build in the box), tests/worker/sandbox/test_sandbox_launcher.py,
#      tests/service/core/test_toml_containment_property.py;
#   2. the end to end (bench/gpu/h200_e2e.sh: the service, a GPU worker, the bundled kernels and the
#      decay reorder through the REST API), every build and kernel host under bubblewrap.
# Here first: bash bench/gpu/fetch_wheels.sh; mkdir -p .tools && (cd .tools && apt-get download bubblewrap)
# Through the device tool: run(command="bash bench/gpu/h200_containment.sh", carry=[".whl", ".tools"], timeout_s=600)
set -uo pipefail
source "$(dirname "$0")/boxed_device.sh" || exit 2
{ stamp "environment"; id; nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "from worker import sandbox; from worker.sandbox import launcher; print('sandbox:', sandbox.status()); print(launcher.launcher())"
} 2>&1 | tee "$OUT/containment.txt"
stamp "sandbox, launcher and property tests" | tee -a "$OUT/containment.txt"
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider tests/worker/sandbox/test_sandbox.py tests/worker/sandbox/test_sandbox_launcher.py \
  tests/service/core/test_toml_containment_property.py 2>&1 | tee -a "$OUT/containment.txt"
stamp "end to end under bubblewrap" | tee -a "$OUT/containment.txt"
E2E_TIMEOUT_S=${E2E_TIMEOUT_S:-300} E2E_DEADLINE_S=${E2E_DEADLINE_S:-260} bash bench/gpu/h200_e2e.sh
rc=$?
grep -m3 -E "sandbox|bubblewrap" "$OUT/e2e/worker.log" 2>/dev/null | tee -a "$OUT/containment.txt"
stamp "done (e2e exit $rc)" | tee -a "$OUT/containment.txt"
exit $rc
