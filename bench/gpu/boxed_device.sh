# Sourced by the H200 scripts that run optdrift in the worker's bubblewrap box: $OUT, unbuffered
# Python, sm_90 builds, `stamp` (seconds since the script began), bwrap from the carried Debian package
# (.tools/), and the carried wheels (.whl/) installed into /tmp/site on PYTHONPATH with this tree.
# Returns non-zero when bwrap or the wheels cannot be set up.
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OPTDRIFT_CUDA_ARCHS=9.0
T0=$(date +%s)
stamp() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p /tmp/bwrap-root && dpkg -x .tools/bubblewrap_*.deb /tmp/bwrap-root || return 1
export OPTDRIFT_BWRAP=/tmp/bwrap-root/usr/bin/bwrap
source "$(dirname "${BASH_SOURCE[0]}")/carried_wheels.sh"
install_carried_wheels > /tmp/pip.txt 2>&1 || { cat /tmp/pip.txt; return 1; }
