"""`optdrift sensitivity` for real on one mutant (the cheapest-case search, resuming from the
report), the exit codes, and the build-ahead pool. The whole catalogue on the ci battery, through
the CLI, is tests/worker/sensitivity/test_sensitivity_ci_catalogue.py. Builds share the session's build cache
(tests/conftest.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from worker.battery import BatterySpec
from worker.sensitivity.build_ahead import BuildAhead
from worker.sensitivity.catalogue import CatalogueError, Mutant
from worker.sensitivity.engine import SensitivityRun
from worker.sensitivity.report import exit_code
from worker.sensitivity.results import MutantOutcome, SensitivityReport

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


def _mutants(count: int) -> list[Mutant]:
    return [Mutant(id=f"c/m{i}", kind="defect", expect="x", patch_path=Path(f"/nonexistent/m{i}.patch"))
            for i in range(count)]


def test_build_ahead_keeps_jobs_builds_running_ahead_of_the_judged_mutant():
    """With jobs=2, the first two builds run at the same time (a barrier both must reach), and taking
    mutant k has started no build past k+2: the look-ahead is bounded, the order kept."""
    mutants = _mutants(6)
    both_running = threading.Barrier(2, timeout=10)
    started: list[str] = []

    def build(mutant: Mutant) -> str:
        started.append(mutant.id)
        if mutant.id in ("c/m0", "c/m1"):
            both_running.wait()  # BrokenBarrierError (a failed take) unless m0 and m1 build together
        return f"built {mutant.id}"

    with BuildAhead(build, mutants, jobs=2) as builds:
        builds.start()
        for index, mutant in enumerate(mutants):
            assert builds.take(mutant) == f"built {mutant.id}"
            assert set(started) <= {m.id for m in mutants[:index + 3]}
    assert started[:2] in (["c/m0", "c/m1"], ["c/m1", "c/m0"]) and sorted(started) == [m.id for m in mutants]


def test_build_ahead_with_no_jobs_builds_each_mutant_when_taken_and_passes_errors_on():
    mutants = _mutants(3)
    started: list[str] = []

    def build(mutant: Mutant) -> str:
        started.append(mutant.id)
        if mutant.id == "c/m2":
            raise CatalogueError("c/m2 does not apply")
        return mutant.id

    with BuildAhead(build, mutants, jobs=0) as builds:
        builds.start()
        assert started == []
        assert builds.take(mutants[1]) == "c/m1" and started == ["c/m1"]
        with pytest.raises(CatalogueError, match="does not apply"):
            builds.take(mutants[2])
    with BuildAhead(build, mutants, jobs=1) as builds:  # from a build thread, the same error
        builds.start()
        builds.take(mutants[0]), builds.take(mutants[1])
        with pytest.raises(CatalogueError, match="does not apply"):
            builds.take(mutants[2])
