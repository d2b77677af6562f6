"""`optdrift sensitivity` for real: mutants built through the digest cache and ccache, the battery
through the production pipeline, on the CPU.

The mutants are chosen so each rebuild recompiles one translation unit (a cpu/ file or ops.cpp):
two defects the ci battery must catch, one refactor it must not flag, and one CUDA-only defect
that is not applicable here. Builds share the session's build cache (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.battery import BatterySpec
from worker.sensitivity.engine import SensitivityRun
from worker.sensitivity.report import exit_code
from worker.sensitivity.results import MutantOutcome, SensitivityReport

REPO = Path(__file__).resolve().parents[1]
CAUGHT = ["writeback/adam_states_swapped_cpu", "tail/cpu_8bit_partial_block_dropped"]
REFACTOR = "refactor/comment_ops"
CUDA_ONLY = "quant8/cuda_half_warps"


def test_sensitivity_cli_on_the_ci_battery_shows_the_catches_and_no_false_positive(build_cache_dir):
    only = [arg for mutant_id in [*CAUGHT, REFACTOR, CUDA_ONLY] for arg in ("--only", mutant_id)]
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "sensitivity", "--battery", "ci", "--device", "cpu", *only,
         "--fallback-battery", "none", "--format", "json"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OPTDRIFT_BUILD_CACHE": str(build_cache_dir), "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-4000:]
    report = SensitivityReport.model_validate_json(done.stdout)
    status = {m.id: m for m in report.mutants}
    assert report.battery == "ci"
    for mutant_id in CAUGHT:
        caught = status[mutant_id]
        assert caught.status == "caught" and caught.catches, mutant_id
        assert sum(caught.group_catches) >= len(caught.catches)  # every catching case sits in a group
    # Adam's states swapped: only Adam 32-bit cases can see it (the 8-bit kernels pass their own states).
    swapped = status["writeback/adam_states_swapped_cpu"]
    assert all(c.case_id.startswith("adam.32bit.") and c.first_divergent_step for c in swapped.catches)
    assert status[REFACTOR].status == "clean" and not status[REFACTOR].catches
    assert status[CUDA_ONLY].status == "not_applicable"
    # The tables went to stderr, with the progress lines.
    for text in ("detection matrix", "catch rate per class", "false positives (refactors flagged): none",
                 "quant8/cuda_half_warps: not applicable"):
        assert text in done.stderr, text


def _battery_file(tmp_path: Path, name: str, groups: list[dict]) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(BatterySpec.model_validate({"name": name, "version": 1, "groups": groups}).model_dump_json())
    return str(path)


def test_an_escaped_mutant_gets_the_cheapest_case_of_the_larger_battery_that_catches_it(tmp_path, build_cache_dir):
    """Adam's states swapped escape a momentum-only battery; of three Adam cases in the larger one,
    the cheapest (fewest elements x steps) is named, and the non-catching momentum case is skipped."""
    small = _battery_file(tmp_path, "momentum-only", [{"optimizers": ["momentum"], "sizes": [64], "steps": 2}])
    larger = _battery_file(tmp_path, "larger", [
        {"optimizers": ["momentum"], "sizes": [8], "steps": 1},
        {"optimizers": ["adam"], "sizes": [300, 40], "steps": 3},
        {"optimizers": ["adam"], "sizes": [100], "steps": 1},
    ])
    lines: list[str] = []
    report = SensitivityRun(battery=small, only=["writeback/adam_states_swapped_cpu"], cache_dir=build_cache_dir,
                            fallback_battery=larger, checkpoint=tmp_path / "report.json", progress=lines.append).run()
    [outcome] = report.mutants
    assert outcome.status == "escaped" and not outcome.catches
    assert outcome.cheapest_catch is not None
    assert outcome.cheapest_catch.cost == 100 and ".n100." in outcome.cheapest_catch.case_id
    assert exit_code(report) == 1
    # The checkpoint holds the report; a second run of the same battery resumes from it (no build).
    again = SensitivityRun(battery=small, only=["writeback/adam_states_swapped_cpu"], cache_dir=build_cache_dir,
                           fallback_battery=None, checkpoint=tmp_path / "report.json", progress=lines.append).run()
    assert again.mutants == report.mutants
    assert any("already judged" in line for line in lines)
    assert json.loads((tmp_path / "report.json").read_text())["battery"] == "momentum-only"


def _outcome(mutant_id: str, kind: str, status: str) -> MutantOutcome:
    return MutantOutcome(id=mutant_id, kind=kind, mutant_class=mutant_id.split("/")[0], expect="x", reaches=["cpu"],
                         status=status)


@pytest.mark.parametrize("statuses, code", [
    ({"caught": "defect", "clean": "refactor"}, 0),
    ({"escaped": "defect", "clean": "refactor"}, 1),
    ({"caught": "defect", "flagged": "refactor"}, 1),
    ({"caught": "defect", "build_failed": "defect"}, 3),
])
def test_exit_code_and_catch_rates(statuses, code):
    mutants = [_outcome(f"c{i}/m", kind, status) for i, (status, kind) in enumerate(statuses.items())]
    mutants.append(_outcome("c9/n", "defect", "not_applicable"))
    report = SensitivityReport(catalogue="x", battery="b", battery_version=1, battery_digest="d", device="cpu",
                               groups=[], case_count=0, mutants=mutants)
    assert exit_code(report) == code
    caught = sum(m.status == "caught" for m in mutants)
    judged = sum(m.kind == "defect" and m.status in ("caught", "escaped") for m in mutants)
    assert report.catch_rate() == (caught, judged)  # not-applicable and unbuilt mutants are not judged
