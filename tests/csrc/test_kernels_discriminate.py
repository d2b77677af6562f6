"""Proof that tests/csrc/test_kernels_32bit.py discriminates: on a copy of csrc whose Adam applies the
decay AFTER the update (p = (p - step_size m/denom)(1 - lr wd), the bug of PR 2040) the Adam tests
must fail, while the same command passes on the real csrc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CORRECT_ADAM_LINE = "param = param * decay_factor - step_size * (exp_avg / denom);"
DECAY_AFTER_LINE = "param = (param - step_size * (exp_avg / denom)) * decay_factor;"


def run_adam_tests(csrc: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OPTDRIFT_TEST_CSRC": str(csrc)}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "tests/csrc/test_kernels_32bit.py", "-k", "adam", "-x", "-q",
         "-p", "no:cacheprovider"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800,
    )


@pytest.mark.slow
def test_decay_after_update_fails_the_adam_tests(tmp_path):
    mutant = tmp_path / "csrc"
    shutil.copytree(REPO / "csrc", mutant)
    math_header = mutant / "optimizer_math.h"
    text = math_header.read_text()
    assert text.count(CORRECT_ADAM_LINE) == 1, "Adam's update line moved; update this test"
    math_header.write_text(text.replace(CORRECT_ADAM_LINE, DECAY_AFTER_LINE))

    mutant_run = run_adam_tests(mutant, tmp_path)
    assert mutant_run.returncode == 1, (
        "the Adam tests did not fail on decay-after-update kernels:\n" + mutant_run.stdout[-3000:]
    )
    # Failed on the numbers, not on a build or collection error. (The per-step bound is tight
    # enough that even the typical point fails, on elements whose |p| is small.)
    assert "outside the rounding of the float64 result" in mutant_run.stdout, mutant_run.stdout[-3000:]


@pytest.mark.slow
def test_adam_tests_pass_on_the_real_csrc(tmp_path):
    real_run = run_adam_tests(REPO / "csrc", tmp_path)
    assert real_run.returncode == 0, real_run.stdout[-3000:] + real_run.stderr[-3000:]
