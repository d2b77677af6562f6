"""The verdict's detail, typed (service/core/verdict_detail.py): a detail stored by the previous code
(tests/fixtures/verdict_details/stored_at_8bf4ca1.json: the exact text PostgreSQL held after a run
was judged, its co-run stored diffs, the attribution, a give-up, a nondeterminism finding, and one
as an older release wrote it) loads and is written back as the same JSON text, and each change
gives the JSON the untyped dict code gave (written out below as it was)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.core.verdict_detail import CaseNotReproduced, CorunFinding, CorunRecord, CorunWindow, VerdictDetail
from service.core.verdicts import compare_runs
from service.core.results import CaseResult, CaseSpec, RunResult, Trajectory

STORED = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "verdict_details"
                     / "stored_at_8bf4ca1.json").read_text())
BUILD_CHANGE = {"flags_added": ["-O2"], "flags_removed": [], "compilers": None}


def _text(detail: dict) -> str:
    """What SQLAlchemy writes into the JSON column (json.dumps), compared as text: order included."""
    return json.dumps(detail)


def _loaded(name: str) -> VerdictDetail:
    return VerdictDetail.model_validate(json.loads(STORED[name]))


@pytest.mark.parametrize("name", sorted(STORED))
def test_a_stored_detail_loads_and_is_written_back_as_the_same_text(name: str) -> None:
    detail = _loaded(name)
    assert _text(detail.stored()) == STORED[name]


def test_the_stored_details_are_read_typed() -> None:
    attributed = _loaded("attributed")
    assert attributed.verdict == "changed" and attributed.cases[1].max_abs_diff_per_step == [0.0, 0.0, 1e-07]
    assert attributed.corun_window == CorunWindow(worker="node-1:42", started_at="2026-12-06T15:00:00+00:00",
                                                  finished_at="2026-12-06T15:00:01.250000+00:00")
    assert attributed.awaiting_diffs() == set() and not attributed.corun_final
    assert _loaded("judged").awaiting_diffs() == {"c1"}
    assert _loaded("given_up").corun == CorunFinding(state="given_up", reason="the co-run failed: boom")
    finding = _loaded("not_reproducible").corun
    assert finding.not_reproduced == 1 and finding.cases["c1"]["commit"] == CaseNotReproduced(
        first_differing_step=3, stored_digest="9", rerun_digest="7", rerun_status="ok")
    assert _loaded("given_up").corun_final and _loaded("not_reproducible").corun_final
    older = _loaded("older_release")
    assert older.figures is None and older.cases[0].family is None
    assert older.model_extra == {"corun_note": "a key of another release"}


# The untyped code each change replaced (service/run_store.py and service/domain/verdict_store.py at 8bf4ca1).
def _old_build_change(detail: dict, change: dict | None) -> dict:
    detail = {key: value for key, value in detail.items() if key != "build_change"}
    return {**detail, "build_change": change} if change else detail


@pytest.mark.parametrize("name", sorted(STORED))
def test_each_change_writes_what_the_dict_code_wrote(name: str) -> None:
    stored, detail = json.loads(STORED[name]), _loaded(name)
    reason = "no per-step diffs: the baseline no longer builds"
    given_up = {**stored, "corun": {"state": "given_up", "reason": reason}}
    assert _text(detail.given_up(reason).stored()) == _text(given_up)
    attribution = {"c1": {"class": "semantic", "variant": "adam_decoupled", "peak_ulps": 1e9}}
    assert _text(detail.with_attribution(attribution).stored()) == _text({**stored, "attribution": attribution})
    for change in (BUILD_CHANGE, None, {}):
        assert _text(detail.with_build_change(change).stored()) == _text(_old_build_change(stored, change))
    # A change of a changed detail reads as a dict update of the first change's result.
    twice = detail.with_build_change(BUILD_CHANGE).with_attribution(attribution)
    assert _text(twice.stored()) == _text({**_old_build_change(stored, BUILD_CHANGE), "attribution": attribution})


def _result(c1_digests: list[str]) -> RunResult:
    def case(case_id: str, digests: list[str]) -> CaseResult:
        return CaseResult(case=CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1}, seed=0, size=8, steps=3),
                          status="ok", trajectory=Trajectory(ref64_max_abs=[0.1, 0.2, 0.3], ref64_max_rel=[0.0, 1.0, 2.0],
                                                             nonfinite_count=[0, 0, 0], digests=digests))
    return RunResult(battery_name="quick", battery_version=1, battery_digest="h",
                     cases=[case("c0", ["1", "2", "3"]), case("c1", c1_digests)])


def test_a_comparison_with_the_coruns_record_and_finding_writes_what_the_dict_code_wrote() -> None:
    comparison = compare_runs(_result(["1", "2", "9"]), _result(["1", "2", "3"]), {"c1": [0.0, float("inf"), 0.5]})
    window = {"worker": "w", "started_at": "2026-12-06T15:00:00+00:00", "finished_at": "2026-12-06T15:00:02+00:00"}
    extra = {"corun_seconds": 2.5, "corun_window": window, "corun_phases": {"load": 0.25},
             "corun_kernels": {"chunks": 3, "commit_s": 0.75}, "training_impact": "off"}
    record = CorunRecord(corun_seconds=2.5, corun_window=CorunWindow(**window), corun_phases={"load": 0.25},
                         corun_kernels={"chunks": 3, "commit_s": 0.75}, training_impact="off")
    assert _text(record.stored()) == _text(extra)
    # store_corun_diffs: the comparison's JSON, the co-run's time after it.
    assert _text(VerdictDetail.of(comparison, record).stored()) == _text({**comparison.model_dump(mode="json"), **extra})
    assert _text(VerdictDetail.of(comparison).stored()) == _text(comparison.model_dump(mode="json"))
    # rejudge: the co-run's record without the kernels' split, then its finding.
    finding = {"state": "not_reproducible", "not_reproduced": 2,
               "cases": {"c1": {"commit": {"first_differing_step": 3, "stored_digest": "9", "rerun_digest": None,
                                           "rerun_status": "timeout"}}}}
    short = {key: extra[key] for key in ("corun_seconds", "corun_window", "corun_phases")}
    short_record = CorunRecord(corun_seconds=2.5, corun_window=CorunWindow(**window), corun_phases={"load": 0.25})
    assert _text(VerdictDetail.of(comparison, short_record, CorunFinding.model_validate(finding)).stored()) == _text(
        {**comparison.model_dump(mode="json"), **short, "corun": finding})
