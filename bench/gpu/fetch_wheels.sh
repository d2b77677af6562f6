#!/usr/bin/env bash
# Fetch, HERE (a machine with a package index), the wheels the optdrift service and worker need on
# the H200, whose image (Python 3.12, torch 2.11) lacks them and has no network. They go into the
# git-excluded folder .whl/, which the device call carries (carry=[".whl"]) and
# bench/gpu/h200_e2e.sh installs with `pip install --no-index --no-deps --target /tmp/site`.
#
#   bash bench/gpu/fetch_wheels.sh            # then: du -sh .whl (the carried tree must stay < 64 MiB)
#
# Versions are those of this checkout's .venv (pyproject's server extra minus psycopg, redis,
# plotly and the test-only packages). Small pure-Python packages the image does have (click,
# jinja2, httpx, rich, typer, ...) travel too, pinned: we cannot see the image's versions, and a
# shadowing copy in /tmp/site costs a few hundred KB against a failed device call. What is NOT
# carried and comes from the image: torch, numpy, ninja, idna, certifi, pygments, markdown-it-py,
# mdurl. plotly (~15 MB) is left out: the dashboard only locates its plotly.min.js when a chart page
# asks for it (service/dashboard/routes.py `_plotly_path`), never at import.
#
# Other engineers' wheels already in .whl/ (e.g. bitsandbytes) are left alone; another version of
# a package named here is removed (two versions of one package stop the whole install).
set -euo pipefail
cd "$(dirname "$0")/../.."
WHEELS=.whl
mkdir -p "$WHEELS"
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude

# name==version; compiled ones (pydantic_core, SQLAlchemy, MarkupSafe, wcwidth) come as cp312 /
# abi3 manylinux wheels through the --platform flags below.
PACKAGES=(
  fastapi==0.165.0 fastapi-offline==1.7.7 starlette==1.10.0 uvicorn==0.54.0 python-multipart==0.0.34
  opentelemetry-api==1.45.2 annotated-doc==0.0.7
  SQLAlchemy==2.1.9 alembic==1.20.1 Mako==1.4.3 MarkupSafe==3.0.4 Jinja2==3.1.6
  celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 tzlocal==5.4.5
  python-dateutil==2.9.0.post0 six==1.17.0
  click==8.5.1 click-didyoumean==0.3.1 click-plugins==1.1.1.2 click-repl==0.4.1
  prompt_toolkit==3.0.53 wcwidth==0.9.4
  pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4
  annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
  typer==0.29.2 rich==15.0.0 shellingham==1.5.4
  anyio==4.16.0 httpx==0.28.1 httpcore==1.0.9 h11==0.16.0 prometheus_client==0.26.0
  githubkit==0.16.1 githubkit-schemas==26.10.21 githubkit-schemas-2026-03-10==26.10.21 hishel==1.4.0 anysqlite==0.0.5 msgpack==1.2.4
  PyJWT==2.15.1 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 standardwebhooks==1.3.0
)
# Packages the H200 image has (docs: /work/.library/device/KINDS.md, "Python packages already
# there"), which the requirement check below accepts without a carried wheel.
IMAGE_HAS="torch numpy ninja idna certifi pygments markdown-it-py mdurl packaging pyyaml setuptools"

canon() { tr 'A-Z_.' 'a-z--' <<<"$1"; }
# Remove other versions of the packages named here (and nothing else).
for spec in "${PACKAGES[@]}"; do
  name=$(canon "${spec%%==*}"); version=${spec#*==}
  for wheel in "$WHEELS"/*.whl; do
    [ -e "$wheel" ] || continue
    base=$(basename "$wheel"); wheel_name=$(canon "${base%%-*}"); rest=${base#*-}; wheel_version=${rest%%-*}
    if [ "$wheel_name" = "$name" ] && [ "$wheel_version" != "$version" ]; then
      echo "removing $base (another version than $spec)"; rm -f "$wheel"
    fi
  done
done

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" "${PACKAGES[@]}" \
  2> >(grep -v "^WARNING: Location" >&2)

# Completeness: every Requires-Dist of every carried wheel (markers evaluated for CPython 3.12 on
# Linux, extras skipped) must be met by a carried wheel or a package of the image.
python3 - "$WHEELS" "$IMAGE_HAS" <<'PY'
import re, sys, zipfile
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

folder, image = Path(sys.argv[1]), {canonicalize_name(n) for n in sys.argv[2].split()}
environment = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
               "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
               "implementation_name": "cpython", "platform_python_implementation": "CPython",
               "extra": ""}
carried, problems = {}, []
for wheel in sorted(folder.glob("*.whl")):
    name, version, _build, tags = parse_wheel_filename(wheel.name)
    if name in carried:
        problems.append(f"two versions of {name}: {carried[name]} and {version}")
    carried[name] = version
    if not any(t.interpreter in ("py3", "py2.py3", "cp312") or t.abi == "abi3" for t in tags):
        problems.append(f"{wheel.name}: no tag for CPython 3.12")
for wheel in sorted(folder.glob("*.whl")):
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        lines = archive.read(metadata).decode().splitlines()
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is not None and not requirement.marker.evaluate(environment):
            continue
        needed = canonicalize_name(requirement.name)
        if needed in carried:
            if not requirement.specifier.contains(carried[needed], prereleases=True):
                problems.append(f"{wheel.name} needs {requirement}, carried {carried[needed]}")
        elif needed not in image:
            problems.append(f"{wheel.name} needs {requirement}: neither carried nor on the image")
total = sum(w.stat().st_size for w in folder.glob("*.whl"))
print(f"{len(carried)} wheels in {folder}/, {total / 2**20:.1f} MiB")
if problems:
    print("\n".join(problems))
    sys.exit(1)
print("every Requires-Dist is met by a carried wheel or the image")
PY
