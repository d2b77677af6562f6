#!/usr/bin/env bash
# Issue 9 on the H200: bitsandbytes 0.50.2's CUDA kernels through worker.adapters.bitsandbytes, on
# the standard battery's typical (lr=1e-3, wd=1e-2) and discriminating (lr=0.1, wd=0.1) cases;
# prints the distance to the float64 reference (torch.optim / the papers) per optimizer as a table.
# The wheel is carried in .whl/ (see docs/BITSANDBYTES.md for the pip download command).
# Through the device tool: run(command="bash bench/gpu/h200_bitsandbytes.sh", carry=[".whl"], timeout_s=300).
# Subset, and why: the whole standard battery (1083 cases x 100 steps) does not fit in 4 minutes
# with the straightforward engine, so this runs the typical and discriminating points only
# (float32 first, then float16, then bfloat16; all sizes, both gradient kinds, 1-step and 100-step
# cases) until BUDGET_S seconds have passed, and says how many it ran. Same script on a CPU:
#   INSTALL_WHEELS=0 PYTHON=.venv/bin/python DEVICE=cpu BUDGET_S=120 bash bench/gpu/h200_bitsandbytes.sh
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ] && [ "${INSTALL_WHEELS:-1}" = 1 ]; then  # pure-Python packages and the bitsandbytes wheel, carried
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda} BUDGET_S=${BUDGET_S:-200} OUT="$OUT" timeout 280 "$PYTHON" - <<'PY' 2>&1 | tee "$OUT/bitsandbytes_${DEVICE:-cuda}.txt"
import json, os, time
from collections import defaultdict

from worker.adapters.bitsandbytes import supported_cases
from worker.battery import load_battery
from worker.kernel_host import KernelHost

device, budget, out = os.environ["DEVICE"], float(os.environ["BUDGET_S"]), os.environ["OUT"]
POINTS = {(1e-3, 1e-2): "typical", (0.1, 0.1): "discriminating"}
cases = [c for c in load_battery("standard").expand()
         if (c.hyper["lr"], c.hyper["weight_decay"]) in POINTS
         and c.hyper["gnorm_scale"] == 1.0 and not c.hyper.get("skip_zeros", False)]
order = {"float32": 0, "float16": 1, "bfloat16": 2}
cases.sort(key=lambda c: (order[c.param_dtype], c.steps != 1, c.size, c.case_id))
cases, dropped = supported_cases(cases, device)
print(f"{len(cases)} cases selected from the standard battery ({len(dropped)} not in bnb's {device} library: "
      f"{sorted({d[0].optimizer + ' ' + d[0].param_dtype for d in dropped})})")

results, started = [], time.monotonic()
with KernelHost("installed", device=device, adapter="bitsandbytes", case_timeout_s=120) as host:
    for case in cases:
        if time.monotonic() - started > budget:
            break
        results.append(host.run(case))
    env = host.environment
print(f"ran {len(results)} of {len(cases)} cases in {time.monotonic() - started:.0f} s on "
      f"{env.device_name if env else '?'} (torch {env.torch_version if env else '?'}, cuda {env.cuda_version if env else '-'})")
broken = [r for r in results if r.status != "ok"]
for r in broken[:10]:
    print("broken:", r.case.case_id, (r.message or "").splitlines()[0])

# Per optimizer x family x dtype x point x length: the largest final distance to float64 over the
# cases (sizes, gradient kinds, seeds), absolute and relative.
table = defaultdict(lambda: [0, 0.0, 0.0])
for r in results:
    if r.status != "ok":
        continue
    c = r.case
    key = (c.optimizer, c.family, c.param_dtype, POINTS[(c.hyper["lr"], c.hyper["weight_decay"])], c.steps)
    row = table[key]
    row[0] += 1
    row[1] = max(row[1], r.trajectory.ref64_max_abs[-1])
    row[2] = max(row[2], r.trajectory.ref64_max_rel[-1])
header = f"{'optimizer':9} {'family':15} {'dtype':9} {'point':15} {'steps':>5} {'cases':>5} {'max|p-ref64|':>13} {'max rel':>11}"
print(header)
print("-" * len(header))
for key in sorted(table, key=lambda k: (k[1], k[0], order[k[2]], k[3], k[4])):
    n, dist, rel = table[key]
    print(f"{key[0]:9} {key[1]:15} {key[2]:9} {key[3]:15} {key[4]:>5} {n:>5} {dist:13.3e} {rel:11.3e}")
with open(os.path.join(out, f"bitsandbytes_{device}.json"), "w") as handle:
    json.dump([r.model_dump(mode="json") for r in results], handle)
PY
echo "exit: ${PIPESTATUS[0]}"
