"""The deployment files checked by the tools their formats have (Docker itself cannot run here):
docker-compose.yml against the Compose specification's JSON schema (the copy check-jsonschema
vendors), the Dockerfiles through hadolint, and a .dockerignore that keeps the local
environment, the repository and caches out of the build context."""

from __future__ import annotations

import fnmatch
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO_ROOT / "docker").glob("*Dockerfile"))
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if found is None:
        # The [test] extra installs it: its absence is a broken setup, not a reason to skip.
        pytest.fail(f"{name} is not installed (pip install -e '.[test]' brings it)")
    return found


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    checked = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                              str(REPO_ROOT / "docker-compose.yml")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_schema_check_refuses_a_broken_compose_file(tmp_path: Path) -> None:
    """The check above can fail: a misspelt key is refused."""
    broken = (REPO_ROOT / "docker-compose.yml").read_text().replace("depends_on:", "depend_on:", 1)
    (tmp_path / "docker-compose.yml").write_text(broken)
    checked = subprocess.run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec",
                              str(tmp_path / "docker-compose.yml")], capture_output=True, text=True)
    assert checked.returncode != 0 and "depend_on" in checked.stdout + checked.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda path: path.name)
def test_dockerfile_passes_hadolint(dockerfile: Path) -> None:
    linted = subprocess.run([_tool("hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert linted.returncode == 0, linted.stdout + linted.stderr


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's reading of .dockerignore, enough for these patterns: a pattern matches the path or
    one of its leading folders; `**/` matches any depth."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    for pattern in patterns:
        tail = pattern[3:] if pattern.startswith("**/") else None
        for prefix in prefixes:
            if fnmatch.fnmatch(prefix, pattern) or (tail and fnmatch.fnmatch(prefix.split("/")[-1], tail)):
                return True
    return False


def test_dockerignore_keeps_local_state_out_and_what_the_images_copy_in() -> None:
    patterns = [line.strip() for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for local in (".venv/bin/python", ".git/HEAD", ".optdrift/test-build-cache/x", "optdrift.egg-info/PKG-INFO",
                  "service/__pycache__/cli.cpython-311.pyc", "worker/engine/x.so", ".pytest_cache/v"):
        assert _ignored(local, patterns), f"{local} would go into the build context"
    copied = {word for dockerfile in DOCKERFILES for line in dockerfile.read_text().splitlines()
              if line.startswith("COPY ") for word in line.split()[1:-1]}
    assert {"service", "pyproject.toml", "README.md"} <= copied
    for needed in copied:
        assert not _ignored(needed, patterns), f"{needed} is copied by a Dockerfile but ignored"
        assert (REPO_ROOT / needed).exists(), f"a Dockerfile copies {needed}, which does not exist"
    for needed in ("migrations/env.py", "service/api/docs.py", "worker/__init__.py"):
        assert not _ignored(needed, patterns), needed
