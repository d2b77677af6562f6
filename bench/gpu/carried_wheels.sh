# Sourced by the H200 scripts: the Python packages the GPU image lacks travel as wheels in .whl
# (bench/gpu/fetch_wheels.sh makes it here; the device call carries it). Installs them into
# /tmp/site (no index there) and puts them and this tree on PYTHONPATH; without .whl it does
# nothing. Arguments: the wheels to install (default: all of .whl).
install_carried_wheels() {
  [ -d .whl ] || return 0
  if [ "$#" -eq 0 ]; then set -- .whl/*.whl; fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$@" \
    || return 1
  export PYTHONPATH=/tmp/site:$PWD
}
