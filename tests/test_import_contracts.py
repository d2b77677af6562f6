"""The import contracts of pyproject.toml's [tool.importlinter], checked by import-linter's own
command: the seams between the API process, the command and the worker are written down once
(issue 35), not rediscovered by each reader. tests/test_layering.py keeps what import-linter cannot
say (what a fresh interpreter actually loads)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _lint_imports() -> subprocess.CompletedProcess:
    command = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if command is None:
        pytest.skip("import-linter is not installed (the test extra has it)")
    return subprocess.run([command, "--no-cache"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept() -> None:
    done = _lint_imports()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "BROKEN" not in done.stdout and "KEPT" in done.stdout
