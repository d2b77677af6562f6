"""The batteries against the recorded catalogue run (worker/sensitivity/recorded/cpu_pool.json: every
mutant that reaches the CPU build, run on the candidate pool battery, which holds the quick battery's
cases and the ci battery's candidates): which defects each battery's cases catch.

Re-record after changing the kernels, the catalogue or the pool:
    optdrift sensitivity --battery worker/sensitivity/batteries/pool.json --fallback-battery none \
        --json-out worker/sensitivity/recorded/cpu_pool.json
"""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.battery import BUILTIN_BATTERIES, BatterySpec, battery_from_file
from worker.sensitivity.catalogue import load_catalogue
from worker.sensitivity.ci_selection import (CUDA_ONLY_NEEDS, POOL, RECORDED_POOL, bias_correction_steps, catch_sets,
                                             coverage_rules, select_cases, unmet_rules)
from worker.sensitivity.results import SensitivityReport

REPORT = SensitivityReport.model_validate_json(RECORDED_POOL.read_text())
POOL_BATTERY = battery_from_file(POOL)
CATALOGUE = {m.id: m for m in load_catalogue()}
SETS = catch_sets(REPORT, POOL_BATTERY)  # defect -> pool cases that catch it (CUDA-only: CUDA_ONLY_NEEDS)


def _ids(battery: BatterySpec) -> set[str]:
    return {case.case_id for case in battery.expand()}


def _same_but_steps(case) -> str:  # noqa: ANN001
    layout = case.layout.model_dump_json() if case.layout is not None else ""
    return f"{case.optimizer}|{case.family}|{case.param_dtype}|{sorted(case.hyper.items())}|" \
           f"{case.gradient.model_dump_json()}|{case.seed}|{case.size}|{layout}"


def _caught_by(battery: BatterySpec) -> tuple[int, int]:
    """(defects caught, defects) by `battery`'s cases: a recorded catching case, or the same case run
    for at least as many steps as its first divergent step (the first steps of a trajectory do not
    depend on how many follow); a CUDA-only defect by a case of CUDA_ONLY_NEEDS."""
    cases = battery.expand()
    steps_of: dict[str, int] = {}
    for case in cases:
        key = _same_but_steps(case)
        steps_of[key] = max(steps_of.get(key, 0), case.steps)
    pool = {case.case_id: case for case in POOL_BATTERY.expand()}
    caught = 0
    for outcome in REPORT.judged("defect"):
        caught += any(steps_of.get(_same_but_steps(pool[c.case_id]), 0) >= (c.first_divergent_step or pool[c.case_id].steps)
                      for c in outcome.catches)
    caught += sum(any(needs(case) for case in cases) for needs in CUDA_ONLY_NEEDS.values())
    return caught, len(REPORT.judged("defect")) + len(CUDA_ONLY_NEEDS)


def test_the_recording_is_of_the_current_pool_and_catalogue():
    assert REPORT.battery_digest == POOL_BATTERY.digest
    for outcome in REPORT.mutants:
        assert outcome.patch_sha256 == CATALOGUE[outcome.id].patch_sha256, f"{outcome.id} changed since it was recorded"
    on_cpu = {m.id for m in CATALOGUE.values() if "cpu" in m.reaches}
    recorded = {m.id for m in REPORT.mutants}
    assert on_cpu <= recorded, f"not recorded yet: {sorted(on_cpu - recorded)}"
    assert not [m.id for m in REPORT.mutants if m.status == "build_failed"]


def test_the_pool_catches_every_defect_and_flags_no_refactor():
    assert not REPORT.escaped(), [m.id for m in REPORT.escaped()]
    assert not REPORT.false_positives(), [m.id for m in REPORT.false_positives()]
    assert set(CUDA_ONLY_NEEDS) == {m.id for m in CATALOGUE.values() if m.kind == "defect" and m.reaches == {"cuda"}}


def test_the_ci_battery_catches_every_catalogued_defect_and_is_small():
    ci = BUILTIN_BATTERIES["ci"]()
    ci_ids = _ids(ci)
    assert ci_ids <= _ids(POOL_BATTERY)  # its cases are the recorded ones
    missed = [mutant for mutant, caught in SETS.items() if not caught & ci_ids]
    assert not missed, f"the ci battery misses {missed}"
    # Small enough for a whole `optdrift check` in <= 15 s on 2 cores (measured: docs/SENSITIVITY.md, "A check with the ci battery").
    cases = ci.expand()
    assert len(cases) <= 16 and sum(c.size * c.steps for c in cases) <= 20_000
    # No case can go: each one is the only catch of some defect (the selection's pruning pass), or
    # the only case meeting a coverage rule (issue 37's blind spots).
    rules = coverage_rules()
    for case in cases:
        only_catch = any(caught & ci_ids == {case.case_id} for caught in SETS.values())
        only_rule = any(meets(case) and not any(meets(c) for c in cases if c is not case) for meets in rules.values())
        assert only_catch or only_rule, f"{case.case_id} is redundant"
    assert not unmet_rules(cases)


def test_the_blind_spots_are_covered_by_rule_in_every_builtin_battery():
    # Issue 37: a tail count wrong only at a multiple of the block, and a one-ulp bias correction
    # first visible at step 5, escaped the ci battery of the catalogue they were not in.
    assert bias_correction_steps((0.9, 0.999)) == 5
    for name in ("ci", "quick", "standard"):
        assert unmet_rules(BUILTIN_BATTERIES[name]().expand()) == [], name
    # The version before these rules (ci v1) met none of them.
    v1 = [case for case in BUILTIN_BATTERIES["ci"]().expand() if case.steps == 4 and case.size in (1, 257)]
    assert set(unmet_rules(v1)) == set(coverage_rules())
    # Both defects are in the catalogue, and the pool recording says which cases catch them.
    block_multiple = SETS["tail/cpu_8bit_count_block_multiple"]
    bias_correction = SETS["precision/ademamix_inv_bc1_float"]
    pool = {case.case_id: case for case in POOL_BATTERY.expand()}
    assert block_multiple and all(pool[c].size % 256 == 0 for c in block_multiple)
    assert bias_correction and all(pool[c].steps >= 5 for c in bias_correction)
    first_steps = {c.first_divergent_step for o in REPORT.judged("defect") if o.id == "precision/ademamix_inv_bc1_float"
                   for c in o.catches}
    assert first_steps == {5}


def test_quick_catches_95_percent_and_standard_all():
    caught, total = _caught_by(BUILTIN_BATTERIES["quick"]())
    assert caught / total >= 0.95, f"quick catches {caught} of {total}"
    caught, total = _caught_by(BUILTIN_BATTERIES["standard"]())
    assert caught == total, f"standard catches {caught} of {total}"
    assert _caught_by(BUILTIN_BATTERIES["ci"]()) == (total, total)


@pytest.mark.parametrize("sets, costs, expected", [
    # the cheap case that catches two beats the dear one that catches three, then a third covers the rest
    ({"a": {"x", "big"}, "b": {"x", "big"}, "c": {"big", "z"}}, {"x": 1, "big": 100, "z": 2}, ["x", "z"]),
    # one case catching everything is dearer than two cheap ones
    ({"a": {"all", "p"}, "b": {"all", "q"}}, {"all": 50, "p": 1, "q": 1}, ["p", "q"]),
    # a defect no case catches does not stop the selection
    ({"a": {"p"}, "b": set()}, {"p": 3}, ["p"]),
])
def test_select_cases_is_cheap_and_complete(sets, costs, expected):
    assert select_cases(sets, costs) == expected


def test_ci_selection_refuses_a_recording_of_another_pool(tmp_path):
    from worker.sensitivity.ci_selection import ci_groups

    other = tmp_path / "pool.json"
    spec = POOL_BATTERY.model_copy(update={"version": POOL_BATTERY.version + 1})
    other.write_text(spec.model_dump_json())
    with pytest.raises(ValueError, match="recorded on another version"):
        ci_groups(Path(RECORDED_POOL), other)


@pytest.mark.parametrize("battery", ["ci", "quick"])
def test_the_recorded_real_runs_caught_every_defect(battery):
    """`optdrift sensitivity --battery <ci|quick> --json-out worker/sensitivity/recorded/cpu_<battery>.json`:
    the battery itself run on every mutant (not inferred from the pool), as the battery is now."""
    real = SensitivityReport.model_validate_json((RECORDED_POOL.parent / f"cpu_{battery}.json").read_text())
    assert real.battery_digest == BUILTIN_BATTERIES[battery]().digest
    assert real.catch_rate() == (len(REPORT.judged("defect")), len(REPORT.judged("defect")))
    assert not real.escaped() and not real.false_positives()
    assert {m.id for m in real.judged("refactor")} == {m.id for m in REPORT.judged("refactor")}
