"""No name is used that is not defined: pyflakes over service/ and worker/, undefined names only (a
moved helper that one module still calls, as `make_console` was after service/cli/common.py took
the commands' shared code, fails here and not in the one command that used it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_no_undefined_names_in_our_packages() -> None:
    pytest.importorskip("pyflakes")
    done = subprocess.run([sys.executable, "-m", "pyflakes", "service", "worker"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=300)
    undefined = [line for line in done.stdout.splitlines() if "undefined name" in line]
    assert undefined == [], "\n".join(undefined)
