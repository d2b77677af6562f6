"""The project as the Docker images install it: a built wheel, non-editable, in a fresh
environment, away from the source tree. `optdrift migrate` must find its migrations inside the
package (issue 15: `CommandError: Path doesn't exist: .../site-packages/migrations`), and
`optdrift --version` must answer.

The wheel is built offline (--no-deps --no-build-isolation); the fresh venv reaches the test
venv's third-party packages through a .pth line, which adds that folder to sys.path without
running its .pth files, so the editable install of this checkout stays out of it (asserted)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import psycopg
import pytest

from tests.service_fixtures import PG_ADMIN_URL, REPO_ROOT, create_database, drop_database
from worker.adapters.api import API_VERSION

pytestmark = pytest.mark.slow

# What the images' build context holds of the project (docker/*.Dockerfile COPY lines).
PACKAGE_FILES = ("pyproject.toml", "README.md", "service", "worker", "migrations")


def build_wheel(out: Path) -> Path:
    """The project's wheel, built from a copy of what the Dockerfiles copy (no caches)."""
    tree = out / "tree"
    tree.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info")
    for name in PACKAGE_FILES:
        source = REPO_ROOT / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=ignore)
        else:
            shutil.copy2(source, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "--wheel-dir", str(out / "dist"), str(tree)], check=True, cwd=out)
    (wheel,) = (out / "dist").glob("optdrift-*.whl")
    return wheel


def fresh_venv_with_wheel(wheel: Path, venv: Path) -> Path:
    """A new venv with the wheel installed (no deps); returns its `optdrift` script."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    venv_python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(venv_python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    # The venv's own pip, as a user would (data files, the migrations, land in its prefix). Not this
    # interpreter's pip with --prefix: that uninstalls the checkout's editable install first.
    subprocess.run([str(venv_python), "-m", "ensurepip", "--default-pip"], check=True, capture_output=True)
    subprocess.run([str(venv_python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    str(wheel)], check=True)
    # Then the dependencies (fastapi, alembic, psycopg...) from the test venv, appended after the
    # fresh venv's own site-packages (after the install, so its pip never saw the checkout's copy).
    (purelib / "_optdrift_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # The console script pip wrote names this interpreter: make the one the venv's pip would.
    script = venv / "bin" / "optdrift"
    script.write_text(f"#!{venv_python}\nimport sys\nfrom service.cli import app\nsys.exit(app())\n")
    script.chmod(0o755)
    return script


def test_the_wheel_installed_alone_migrates_a_fresh_postgres_database(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "wheel")
    optdrift = fresh_venv_with_wheel(wheel, tmp_path / "venv")
    elsewhere = tmp_path / "elsewhere"  # not the checkout: nothing found relative to the cwd
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("OPTDRIFT_")}
    env.pop("PYTHONPATH", None)
    env["OPTDRIFT_HOME"] = str(tmp_path / "home")

    where = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                            "import service.db.migrate as m; print(m.__file__)"],
                           capture_output=True, text=True, cwd=elsewhere, env=env, check=True).stdout
    assert str(tmp_path / "venv") in where and str(REPO_ROOT) not in where, where

    version = subprocess.run([str(optdrift), "--version"], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert version.returncode == 0, version.stderr
    release = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version.stdout.splitlines() == [f"optdrift {release}", f"adapter API {API_VERSION}"], version.stdout

    name = f"optdrift_wheel_{os.getpid()}"
    env["OPTDRIFT_DATABASE_URL"] = create_database(name)
    try:
        migrated = subprocess.run([str(optdrift), "migrate"], capture_output=True, text=True,
                                  cwd=elsewhere, env=env, timeout=300)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        assert "is up to date" in migrated.stdout
        with psycopg.connect(f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}") as conn:
            tables = {row[0] for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
            head = conn.execute("SELECT version_num FROM alembic_version").fetchone()[0]
        assert {"projects", "commits", "runs", "api_tokens", "worker_presence"} <= tables, tables
        newest = sorted(p.stem for p in (REPO_ROOT / "migrations/versions").glob("0*.py"))[-1]
        assert head == newest, (head, newest)  # every migration ran, up to the newest
    finally:
        drop_database(name)
