"""`optdrift adapter-check --source TREE`: the tree built as a run builds it, its optdrift.toml's
adapter and battery used, and a check that says so when only one engine could be compared (a
family with fast_engine = False: the fast engine hands its cases to the one-case engine)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from tests.lion_project import FIXTURE as LION_FIXTURE
from tests.lion_project import copy_library

pytestmark = pytest.mark.slow


def _invoke(*args: str):  # noqa: ANN202
    return CliRunner().invoke(app, ["adapter-check", *args])


def _invoke_in_own_process(*args: str) -> tuple[int, str]:
    """adapter-check imports the tree's library in the process that runs it and refuses a copy
    imported from elsewhere before: a test process another test imported lion_pytorch into (xdist
    puts files together in one worker) is not a fresh one, as the command's own process is."""
    done = subprocess.run([sys.executable, "-m", "service.cli", "adapter-check", *args], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[3], timeout=600,
                          env={**os.environ, "COLUMNS": "400"})
    return done.returncode, done.stdout + done.stderr


def test_a_tree_is_built_and_checked_with_its_own_adapter_and_battery(tmp_path: Path) -> None:
    tree = tmp_path / "lion"
    tree.mkdir()
    copy_library(tree)
    for name in ("optdrift.toml", "battery.json"):
        shutil.copyfile(LION_FIXTURE / name, tree / name)
    code, output = _invoke_in_own_process("--source", str(tree), "--max-cases", "4")
    assert code == 0, output
    assert f"building {tree} as its optdrift.toml says (command)" in output
    # lion_pytorch's family declares fast_engine = False: said, not passed off as two engines agreeing.
    assert "only ONE engine could be checked: its family 32bit declare" in output
    assert "both engines agree" not in output


def test_the_bundled_kernels_compare_two_engines(tmp_path: Path) -> None:
    tree = tmp_path / "bundled"
    shutil.copytree(Path(__file__).resolve().parents[3] / "csrc", tree)
    done = _invoke("--source", str(tree), "--max-cases", "4")
    assert done.exit_code == 0, done.output
    # No optdrift.toml: the bundled adapter and the quick battery, as a run would take them.
    assert "both engines agree on all 4 cases" in done.output and "ONE engine" not in done.output


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    neither = _invoke("--adapter", "bundled")
    assert neither.exit_code == 2 and "give --source (the project's tree, built here) or both --adapter and" \
        in neither.output
    missing = _invoke("--source", str(tmp_path / "nowhere"))
    assert missing.exit_code == 2 and "is not a folder" in missing.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "optdrift.toml").write_text('[build]\nkind = "command"\n')
    refused = _invoke("--source", str(broken))
    assert refused.exit_code == 2 and "needs build.commands" in refused.output and "Traceback" not in refused.output
