"""Issue 17's CI gate: `optdrift sensitivity --battery ci --device cpu` over the whole catalogue, for
real. Every mutant that reaches the CPU build is patched, built (through the session's build cache
and its ccache, tests/conftest.py) and judged by the ci battery against the unmutated build; the
CUDA-only ones are reported not applicable. The test fails, naming the mutants, if a defect
escapes, a refactor is flagged or a mutant does not build.

It also checks what the CLI shows (the tables, the not-applicable lines, the JSON on stdout and in
--json-out) and one catch in detail, so tests/worker/sensitivity/test_sensitivity.py need not run the CLI again."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from worker.sensitivity.catalogue import load_catalogue
from worker.sensitivity.results import CaseCatch, MutantOutcome, SensitivityReport

REPO = Path(__file__).resolve().parents[3]
# The CLI run's own limit: 363 s from an empty build cache on an idle 2-core machine (measured:
# docs/perf-log/2026-12-06-engine-history.md, 2026-12-03), with room for the suite's other worker
# beside it and a slower machine.
RUN_TIMEOUT_S = 1800


def gate_problems(report: SensitivityReport) -> list[str]:
    """One line per mutant that fails issue 17's gate, naming it: a build error, an escaped defect
    (with what it should have changed), a refactor flagged (with the cases that flagged it)."""
    problems = [f"{m.id}: did not build: {(m.error or '').strip()[-600:]}" for m in report.mutants
                if m.status == "build_failed"]
    problems += [f"{m.id}: escaped the {report.battery} battery ({m.expect})" for m in report.escaped()]
    problems += [f"{m.id}: refactor flagged by {', '.join(c.case_id for c in m.catches)}"
                 for m in report.false_positives()]
    return problems


def test_the_gate_names_every_mutant_that_fails_it():
    def outcome(mutant_id: str, kind: str, status: str, **extra) -> MutantOutcome:
        return MutantOutcome(id=mutant_id, kind=kind, mutant_class=mutant_id.split("/")[0], expect="a change",
                             reaches=["cpu"], status=status, **extra)

    report = SensitivityReport(catalogue="x", battery="ci", battery_version=1, battery_digest="d", device="cpu",
                               groups=[], case_count=0, mutants=[
                                   outcome("eps/caught", "defect", "caught"),
                                   outcome("eps/missed", "defect", "escaped"),
                                   outcome("refactor/ok", "refactor", "clean"),
                                   outcome("refactor/noisy", "refactor", "flagged",
                                           catches=[CaseCatch(case_id="adam.32bit.n5", verdict="changed", cost=5)]),
                                   outcome("tail/broken", "defect", "build_failed", error="ops.cpp:3: error: x"),
                                   outcome("quant8/cuda_only", "defect", "not_applicable")])
    problems = gate_problems(report)
    assert [line.split(":")[0] for line in problems] == ["tail/broken", "eps/missed", "refactor/noisy"]
    assert "error: x" in problems[0] and "adam.32bit.n5" in problems[2]


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_ci_battery_catches_every_cpu_defect_of_the_catalogue_and_flags_no_refactor(build_cache_dir, tmp_path):
    json_out = tmp_path / "sensitivity_ci.json"
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "sensitivity", "--battery", "ci", "--device", "cpu",
         "--fallback-battery", "none", "--format", "json", "--json-out", str(json_out)],
        cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={**os.environ, "OPTDRIFT_BUILD_CACHE": str(build_cache_dir), "COLUMNS": "200"})
    assert done.stdout.strip(), f"no report (exit {done.returncode}):\n{done.stderr[-4000:]}"
    report = SensitivityReport.model_validate_json(done.stdout)
    outcomes = {m.id: m for m in report.mutants}

    problems = gate_problems(report)
    assert not problems, (f"{len(problems)} mutant(s) fail issue 17's CI gate:\n" + "\n".join(problems)
                          + f"\n(progress:\n{done.stderr[-3000:]})")
    assert done.returncode == 0, done.stderr[-4000:]

    # The whole catalogue was judged: the CPU mutants ran, the CUDA-only ones did not.
    catalogue = load_catalogue()
    assert set(outcomes) == {m.id for m in catalogue}
    for mutant in catalogue:
        expected = ("not_applicable",) if "cpu" not in mutant.reaches else \
            ("caught",) if mutant.kind == "defect" else ("clean",)
        assert outcomes[mutant.id].status in expected, (mutant.id, outcomes[mutant.id].status)
    on_cpu = [m for m in catalogue if "cpu" in m.reaches]
    assert report.catch_rate() == (sum(m.kind == "defect" for m in on_cpu),) * 2
    assert len(on_cpu) >= 68 and any("cpu" not in m.reaches for m in catalogue)  # the catalogue of docs/SENSITIVITY.md

    # A catch in detail: Adam's states swapped on the CPU can only show in Adam 32-bit cases (the
    # 8-bit kernels pass their own states), from a definite step; every catching case is in a group.
    swapped = outcomes["writeback/adam_states_swapped_cpu"]
    assert swapped.catches and all(c.case_id.startswith("adam.32bit.") and c.first_divergent_step
                                   for c in swapped.catches)
    for outcome in report.judged("defect"):
        assert sum(outcome.group_catches) >= len(outcome.catches), outcome.id
    assert not outcomes["refactor/comment_ops"].catches

    # What the CLI shows: the tables and progress on stderr (stdout is the JSON), and the same
    # report in --json-out.
    for text in ("detection matrix", "catch rate per class", "false positives (refactors flagged): none",
                 "quant8/cuda_half_warps: not applicable"):
        assert text in done.stderr, text
    assert SensitivityReport.model_validate_json(json_out.read_text()).mutants == report.mutants
