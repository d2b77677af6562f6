"""service/domain/trajectories.py on the real PostgreSQL (one rolled-back transaction per test):
storing a run's cases (one row per run x case, however often stored), the per-step series read back
bit for bit after a round trip through the database, and the stored run as a RunResult.
"""

from __future__ import annotations

import math
import struct

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import DONE, Project, Run, SourceArchive, Trajectory
from service.domain import trajectories
from service.core.results import CaseResult, CaseSpec, RepeatCheck, Trajectory as TrajectoryModel

SOURCE = "0" * 64
# Values a rounding or text store would damage: 0.1+0.2 (0.30000000000000004), the smallest
# subnormal, -0.0, inf, nan, the float just above 1, and a value float32 cannot hold.
AWKWARD = [0.1 + 0.2, 5e-324, -0.0, math.inf, math.nan, 1.0000000000000002, 1e-310]


def _bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", value) for value in values]


def _run(session: Session, *, battery: str = "quick", detail: dict | None = None) -> Run:
    project = Project(name=f"traj-{battery}", environments=["cpu"])
    session.add(project)
    if session.get(SourceArchive, SOURCE) is None:
        session.add(SourceArchive(digest=SOURCE, size_bytes=1, member_count=1))
    session.flush()
    run = Run(project_id=project.id, source_digest=SOURCE, battery=battery, environment="cpu", status=DONE,
              battery_hash="b" * 64, build_digest="d" * 64, environment_detail=detail)
    session.add(run)
    session.flush()
    return run


def _result(case_id: str, *, abs_values: list[float] | None = None, counts: list[int] | None = None,
            digest_prefix: str = "x", status: str = "ok", message: str | None = None,
            same_precision: bool = True) -> CaseResult:
    abs_values = AWKWARD if abs_values is None else abs_values
    steps = len(abs_values)
    spec = CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1},
                    seed=0, size=8, steps=steps)
    trajectory = TrajectoryModel(
        ref64_max_abs=abs_values, ref64_max_rel=[float(i) / 3 for i in range(steps)],
        same_precision_max_abs=[1e-9 * (i + 1) for i in range(steps)] if same_precision else None,
        nonfinite_count=counts if counts is not None else [0] * steps,
        digests=[f"od2:{digest_prefix}{i:031x}" for i in range(steps)])
    return CaseResult(case=spec, status=status, message=message, trajectory=trajectory, duration_s=0.25)


def _rows_of(session: Session, run: Run) -> int:
    return session.scalar(select(func.count()).select_from(Trajectory).where(Trajectory.run_id == run.id))


def _read_back(session: Session, run: Run) -> list[CaseResult]:
    """The run's cases as PostgreSQL holds them, not as the session remembers them."""
    session.flush()
    session.expire_all()
    return [trajectories.row_to_case_result(row) for row in trajectories.list_rows(session=session, run_id=run.id)]


def test_a_series_reads_back_bit_for_bit_after_the_database(db_session) -> None:
    run = _run(db_session)
    big_count = 2**40 + 3  # past int32, still exact in int64
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                   result=_result("adam-1", counts=[0, 1, 2, 3, 4, 5, big_count]))

    (back,) = _read_back(db_session, run)

    assert back.trajectory.ref64_max_abs[0] == 0.30000000000000004 != 0.3
    assert _bits(back.trajectory.ref64_max_abs) == _bits(AWKWARD)  # -0.0 and nan's bits included
    assert back.trajectory.ref64_max_rel == [float(i) / 3 for i in range(len(AWKWARD))]
    assert back.trajectory.same_precision_max_abs == [1e-9 * (i + 1) for i in range(len(AWKWARD))]
    assert back.trajectory.nonfinite_count == [0, 1, 2, 3, 4, 5, big_count]
    assert back.trajectory.digests == [f"od2:x{i:031x}" for i in range(len(AWKWARD))]
    assert (back.status, back.duration_s, back.case.case_id) == ("ok", 0.25, "adam-1")


def test_the_stored_bytes_are_little_endian_float64_and_int64_in_series_order(db_session) -> None:
    run = _run(db_session)
    values = [0.1 + 0.2, -2.5]
    row = trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                         result=_result("adam-1", abs_values=values, counts=[7, -1]))
    db_session.expire_all()
    row = db_session.get(Trajectory, row.id)

    assert row.series_layout == [
        {"name": "ref64_max_abs", "dtype": "float64", "length": 2},
        {"name": "ref64_max_rel", "dtype": "float64", "length": 2},
        {"name": "same_precision_max_abs", "dtype": "float64", "length": 2},
        {"name": "nonfinite_count", "dtype": "int64", "length": 2},
    ]
    assert row.series_data == (struct.pack("<2d", *values) + struct.pack("<2d", 0.0, 1 / 3)
                               + struct.pack("<2d", 1e-9, 2e-9) + struct.pack("<2q", 7, -1))
    assert row.steps == 2 and row.digests == "od2:x" + "0" * 31 + "\nod2:x" + "0" * 30 + "1"


def test_a_series_the_case_does_not_have_is_left_out_and_stays_absent(db_session) -> None:
    run = _run(db_session)
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                   result=_result("adam-1", abs_values=[1.0, 2.0], same_precision=False))

    (back,) = _read_back(db_session, run)

    row = trajectories.list_rows(session=db_session, run_id=run.id)[0]
    assert [entry["name"] for entry in row.series_layout] == ["ref64_max_abs", "ref64_max_rel", "nonfinite_count"]
    assert back.trajectory.same_precision_max_abs is None
    assert back.trajectory.ref64_max_abs == [1.0, 2.0] and back.trajectory.nonfinite_count == [0, 0]


def test_storing_the_same_case_again_replaces_its_row(db_session) -> None:
    run = _run(db_session)
    first = trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                           result=_result("adam-1", digest_prefix="a"))
    again = trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                           result=_result("adam-1", abs_values=[0.5, 0.25], digest_prefix="b"))

    assert again.id == first.id and _rows_of(db_session, run) == 1
    (back,) = _read_back(db_session, run)
    # The later result whole, not a mix: its two steps, its digests.
    assert back.trajectory.ref64_max_abs == [0.5, 0.25]
    assert back.trajectory.digests == [f"od2:b{i:031x}" for i in range(2)]


def test_a_batch_stores_each_case_once_and_the_last_of_a_case_wins(db_session) -> None:
    run = _run(db_session)
    trajectories.store_case_results(session=db_session, run_id=run.id, results=[
        (0, _result("adam-1", digest_prefix="a")), (1, _result("lion-2", digest_prefix="a"))])
    # The same batch again (a retried store), with lion-2 twice and a new case.
    trajectories.store_case_results(session=db_session, run_id=run.id, results=[
        (0, _result("adam-1", digest_prefix="a")),
        (1, _result("lion-2", abs_values=[9.0], digest_prefix="b")),
        (1, _result("lion-2", abs_values=[0.1 + 0.2], digest_prefix="c")),
        (2, _result("adam-3", digest_prefix="a"))])

    assert _rows_of(db_session, run) == 3
    cases = _read_back(db_session, run)
    assert [case.case.case_id for case in cases] == ["adam-1", "lion-2", "adam-3"]
    assert _bits(cases[1].trajectory.ref64_max_abs) == _bits([0.1 + 0.2])
    assert cases[1].trajectory.digests == ["od2:c" + "0" * 31]
    assert _bits(cases[0].trajectory.ref64_max_abs) == _bits(AWKWARD)


def test_rows_are_listed_in_case_index_order_not_storage_order(db_session) -> None:
    run = _run(db_session)
    for index in (2, 0, 1):
        trajectories.store_case_result(session=db_session, run_id=run.id, case_index=index,
                                       result=_result(f"case-{index}", abs_values=[float(index)]))
    other = _run(db_session, battery="full")
    trajectories.store_case_result(session=db_session, run_id=other.id, case_index=0, result=_result("case-x"))

    rows = trajectories.list_rows(session=db_session, run_id=run.id)

    assert [(row.case_index, row.case_id) for row in rows] == [(0, "case-0"), (1, "case-1"), (2, "case-2")]


def test_a_broken_case_keeps_its_message_clipped_and_has_no_trajectory(db_session) -> None:
    run = _run(db_session)
    spec = CaseSpec(case_id="adam-1", optimizer="adam", hyper={"lr": 0.1}, seed=0, size=8, steps=3)
    long_message = "kernel crashed: " + "x" * (2 * trajectories.MAX_CASE_ERROR_CHARS) + " at adam.cu:42"
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0, result=CaseResult(
        case=spec, status="broken", message=long_message, trajectory=None, duration_s=1.5))

    (back,) = _read_back(db_session, run)
    row = trajectories.list_rows(session=db_session, run_id=run.id)[0]

    assert back.trajectory is None and back.status == "broken"
    assert (row.steps, row.series_layout, row.series_data, row.digests) == (0, [], b"", "")
    # Its head (what failed) and its tail (where) are kept, the middle is said to be left out.
    assert back.message.startswith("kernel crashed: ") and back.message.endswith(" at adam.cu:42")
    assert "characters not kept" in back.message
    assert len(back.message) < trajectories.MAX_CASE_ERROR_CHARS + 100 < len(long_message)


def test_a_cases_repeat_check_and_spec_come_back(db_session) -> None:
    run = _run(db_session)
    result = _result("adam-1", abs_values=[1.0, 2.0]).model_copy(
        update={"repeat_check": RepeatCheck(runs=3, differing=1, first_divergent_step=2)})
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0, result=result)

    (back,) = _read_back(db_session, run)

    assert back.repeat_check == RepeatCheck(runs=3, differing=1, first_divergent_step=2)
    assert back.case == result.case


def test_the_stored_run_is_the_engines_run_result(db_session) -> None:
    run = _run(db_session, detail={"battery_version": 4, "build_ok": False, "build_error": "nvcc: no"})
    trajectories.store_case_results(session=db_session, run_id=run.id, results=[
        (1, _result("lion-2", abs_values=[2.0])), (0, _result("adam-1", abs_values=[1.0]))])
    db_session.flush()
    db_session.expire_all()

    result = trajectories.run_result(session=db_session, run=db_session.get(Run, run.id))

    assert (result.battery_name, result.battery_version, result.battery_digest, result.build_digest) == (
        "quick", 4, "b" * 64, "d" * 64)
    assert (result.build_ok, result.build_error, result.environment) == (False, "nvcc: no", None)
    assert [case.case.case_id for case in result.cases] == ["adam-1", "lion-2"]
    assert [case.trajectory.ref64_max_abs for case in result.cases] == [[1.0], [2.0]]


def test_a_run_without_detail_built_and_has_no_cases_yet(db_session) -> None:
    run = _run(db_session)
    result = trajectories.run_result(session=db_session, run=run)
    assert (result.build_ok, result.battery_version, result.cases) == (True, 0, [])


def test_the_commit_page_reads_a_case_s_two_reference_distances_from_its_rows(db_session) -> None:
    """dashboard_queries.reference_distances: the run's and its baseline's ref64 series of one case,
    each from its own run (swapped or mixed up, the page's |Δ distance| would still be drawn)."""
    from service.db.models import Verdict
    from service.domain import dashboard_queries

    commit, baseline = _run(db_session, battery="commit-side"), _run(db_session, battery="baseline-side")
    for run, values in ((commit, [1.0, 4.0]), (baseline, [1.0, 2.5])):
        trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0,
                                       result=_result("adam-1", abs_values=values))
    trajectories.store_case_result(session=db_session, run_id=commit.id, case_index=1,
                                   result=_result("adam-only-here", abs_values=[3.0, 3.0]))
    db_session.add(Verdict(run_id=commit.id, baseline_run_id=baseline.id, outcome="changed", flagged=True,
                           changed_cases=1, first_divergent_step=1, detail={}))
    db_session.flush()

    assert dashboard_queries.baseline_run_of(session=db_session, run_id=commit.id) == baseline.id
    assert dashboard_queries.baseline_run_of(session=db_session, run_id=baseline.id) is None
    assert dashboard_queries.reference_distances(session=db_session, run_id=commit.id, baseline_run_id=baseline.id,
                                                 case_id="adam-1") == ([1.0, 4.0], [1.0, 2.5])
    # A case the baseline never ran has no pair to compare.
    assert dashboard_queries.reference_distances(session=db_session, run_id=commit.id, baseline_run_id=baseline.id,
                                                 case_id="adam-only-here") is None
