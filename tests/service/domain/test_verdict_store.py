"""service/domain/verdict_store.py on the real PostgreSQL (one rolled-back transaction per test): a
finished run's stored verdict against its baseline, runs that waited for their baseline judged when
it finishes, and acknowledgement (only a flagged verdict can be declared intended).

Runs are written as rows with their cases stored by service.domain.trajectories; the comparison
itself is service.core.verdicts (tested on its own), so these tests pin what the store makes of it.
"""

from __future__ import annotations

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import (CANCELLED, DONE, ERROR, FAILED, QUEUED, RUNNING, Commit, Project, Run,
                               SourceArchive, Verdict)
from service.domain import trajectories, verdict_store
from service.domain.errors import ConflictError, NotFoundError
from service.core.results import CaseResult, CaseSpec, RepeatCheck, Trajectory

SOURCE = "0" * 64
SAME = ["s1", "s2", "s3", "s4"]


def _case(case_id: str, digests: list[str], *, distances: list[float] | None = None,
          repeat_check: RepeatCheck | None = None) -> CaseResult:
    spec = CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1},
                    seed=0, size=8, steps=len(digests))
    distances = distances or [1e-6 * (i + 1) for i in range(len(digests))]
    return CaseResult(case=spec, status="ok", repeat_check=repeat_check, trajectory=Trajectory(
        ref64_max_abs=distances, ref64_max_rel=distances, nonfinite_count=[0] * len(digests),
        digests=[f"od2:{d}" for d in digests]))


class Lineage:
    """Commits of one project by sha and their cpu runs, with cases stored like a worker's."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.project = Project(name="verdicts", environments=["cpu"])
        session.add(self.project)
        if session.get(SourceArchive, SOURCE) is None:
            session.add(SourceArchive(digest=SOURCE, size_bytes=1, member_count=1))
        session.flush()

    def run(self, sha: str, *parents: str, status: str = DONE, cases: list[CaseResult] | None = None,
            base: Commit | None = None, error: str | None = None) -> Run:
        commit = Commit(project_id=self.project.id, sha=sha, parents=list(parents), source_digest=SOURCE)
        self.session.add(commit)
        self.session.flush()
        run = Run(project_id=self.project.id, commit_id=commit.id, source_digest=SOURCE, battery="quick",
                  battery_hash="b" * 64, environment="cpu", status=status, error=error,
                  base_commit_id=base.id if base else None)
        self.session.add(run)
        self.session.flush()
        self.store(run, cases if cases is not None else [_case("adam-1", SAME), _case("lion-2", SAME)])
        return run

    def store(self, run: Run, cases: list[CaseResult]) -> None:
        trajectories.store_case_results(session=self.session, run_id=run.id,
                                        results=list(enumerate(cases)))


def _verdicts_of(session: Session, run: Run) -> int:
    return session.scalar(select(func.count()).select_from(Verdict).where(Verdict.run_id == run.id))


# ------------------------------------------------------------------------------------ evaluate
def test_equal_digests_are_unchanged_against_the_first_parent(db_session) -> None:
    line = Lineage(db_session)
    parent = line.run("a")
    run = line.run("b", "a")

    verdict = verdict_store.evaluate(session=db_session, run=run)

    assert (verdict.outcome, verdict.flagged, verdict.baseline_run_id) == ("unchanged", False, parent.id)
    assert (verdict.changed_cases, verdict.first_divergent_step) == (0, None)
    assert verdict.detail["verdict"] == "unchanged" and len(verdict.detail["cases"]) == 2


def test_one_differing_digest_is_a_change_from_the_first_divergent_step(db_session) -> None:
    line = Lineage(db_session)
    parent = line.run("a")
    run = line.run("b", "a", cases=[_case("adam-1", ["s1", "s2", "x3", "x4"]),
                                     _case("lion-2", ["s1", "x2", "x3", "x4"]),
                                     _case("sgd-3", SAME)])

    verdict = verdict_store.evaluate(session=db_session, run=run)

    assert (verdict.outcome, verdict.flagged, verdict.baseline_run_id) == ("changed", True, parent.id)
    # Two cases changed; the run's first divergent step is the earliest of theirs.
    assert (verdict.changed_cases, verdict.first_divergent_step) == (2, 2)
    steps = {case["case_id"]: case["first_divergent_step"] for case in verdict.detail["cases"]}
    assert steps == {"adam-1": 3, "lion-2": 2, "sgd-3": None}
    # Stored, not only returned: read back from PostgreSQL.
    db_session.expire_all()
    stored = db_session.scalar(select(Verdict).where(Verdict.run_id == run.id))
    assert (stored.outcome, stored.flagged, stored.first_divergent_step) == ("changed", True, 2)


def test_a_failed_run_is_broken_and_names_its_error(db_session) -> None:
    line = Lineage(db_session)
    line.run("a")
    run = line.run("b", "a", status=FAILED, error="build failed: nvcc exited 1", cases=[])

    verdict = verdict_store.evaluate(session=db_session, run=run)

    assert (verdict.outcome, verdict.flagged, verdict.baseline_run_id) == ("broken", True, None)
    assert verdict.detail["summary"] == "run failed: build failed: nvcc exited 1"


def test_a_broken_case_makes_a_finished_run_broken(db_session) -> None:
    line = Lineage(db_session)
    line.run("a")
    broken = CaseResult(case=_case("lion-2", SAME).case, status="broken", message="illegal memory access")
    run = line.run("b", "a", cases=[_case("adam-1", SAME), broken])

    verdict = verdict_store.evaluate(session=db_session, run=run)

    assert (verdict.outcome, verdict.flagged, verdict.changed_cases) == ("broken", True, 1)


def test_a_run_that_does_not_reproduce_itself_is_flagged_as_nondeterministic(db_session) -> None:
    line = Lineage(db_session)
    line.run("a")
    unsteady = _case("adam-1", SAME, repeat_check=RepeatCheck(runs=3, differing=1, first_divergent_step=4))
    run = line.run("b", "a", cases=[unsteady])

    verdict = verdict_store.evaluate(session=db_session, run=run)

    assert (verdict.outcome, verdict.flagged, verdict.changed_cases) == ("nondeterministic", True, 0)


def test_a_run_with_nothing_to_compare_with_is_no_baseline_and_not_flagged(db_session) -> None:
    line = Lineage(db_session)
    run = line.run("a")

    verdict = verdict_store.evaluate(session=db_session, run=run)

    assert (verdict.outcome, verdict.flagged, verdict.baseline_run_id) == ("no-baseline", False, None)


def test_a_named_base_is_the_baseline_judged_against(db_session) -> None:
    line = Lineage(db_session)
    release = line.run("v1")
    line.run("a", "v1", cases=[_case("adam-1", ["s1", "y2", "y3", "y4"]), _case("lion-2", SAME)])
    run = line.run("b", "a", base=db_session.get(Commit, release.commit_id))

    verdict = verdict_store.evaluate(session=db_session, run=run)

    # The same bits as the release, though the first parent moved.
    assert (verdict.outcome, verdict.baseline_run_id) == ("unchanged", release.id)


def test_a_verdict_waits_for_an_unfinished_baseline_and_stores_nothing(db_session) -> None:
    line = Lineage(db_session)
    line.run("a", status=RUNNING)
    run = line.run("b", "a")

    assert verdict_store.evaluate(session=db_session, run=run) is None
    assert _verdicts_of(db_session, run) == 0


@pytest.mark.parametrize("status", [QUEUED, RUNNING, CANCELLED, ERROR])
def test_a_run_not_finished_or_not_the_commits_fault_gets_no_verdict(db_session, status) -> None:
    line = Lineage(db_session)
    run = line.run("a", status=status, error="worker lost" if status == ERROR else None)

    assert verdict_store.evaluate(session=db_session, run=run) is None
    assert _verdicts_of(db_session, run) == 0


def test_evaluating_again_keeps_the_stored_verdict(db_session) -> None:
    line = Lineage(db_session)
    line.run("a")
    run = line.run("b", "a")
    first = verdict_store.evaluate(session=db_session, run=run)
    # Even if the stored cases changed since, the verdict given stands.
    line.store(run, [_case("adam-1", ["z1", "z2", "z3", "z4"]), _case("lion-2", SAME)])

    again = verdict_store.evaluate(session=db_session, run=run)

    assert again.id == first.id and again.outcome == "unchanged"
    assert _verdicts_of(db_session, run) == 1


def test_runs_waiting_for_a_baseline_are_judged_when_it_finishes(db_session) -> None:
    line = Lineage(db_session)
    line.run("root")
    parent = line.run("a", "root", status=RUNNING)
    child = line.run("b", "a", cases=[_case("adam-1", ["s1", "s2", "s3", "w4"]), _case("lion-2", SAME)])
    based = line.run("c", "root", base=db_session.get(Commit, parent.commit_id))
    assert verdict_store.evaluate(session=db_session, run=child) is None

    parent.status = DONE
    db_session.flush()
    own = verdict_store.evaluate_with_dependants(session=db_session, run=parent)

    assert (own.run_id, own.outcome) == (parent.id, "unchanged")
    db_session.expire_all()
    by_run = {v.run_id: v for v in db_session.scalars(select(Verdict).where(
        Verdict.run_id.in_([child.id, based.id])))}
    assert (by_run[child.id].outcome, by_run[child.id].baseline_run_id,
            by_run[child.id].first_divergent_step) == ("changed", parent.id, 4)
    assert (by_run[based.id].outcome, by_run[based.id].baseline_run_id) == ("unchanged", parent.id)


# A child that finished while its parent's run was going waits (choose: pending); when that run
# fails or errors, the child is judged against the next ancestor (it used to stay without a verdict).
@pytest.mark.parametrize("parent_end", [FAILED, ERROR])
def test_a_child_waiting_for_a_baseline_that_fails_is_judged_against_the_next_ancestor(
        db_session, parent_end) -> None:
    line = Lineage(db_session)
    root = line.run("root")
    parent = line.run("a", "root", status=RUNNING)
    child = line.run("b", "a")
    assert verdict_store.evaluate(session=db_session, run=child) is None  # waits for a's run

    parent.status = parent_end
    db_session.flush()
    verdict_store.evaluate_with_dependants(session=db_session, run=parent)

    db_session.expire_all()
    verdict = db_session.scalar(select(Verdict).where(Verdict.run_id == child.id))
    assert verdict is not None, "the child that waited for a's run has no verdict after a's run ended"
    assert (verdict.outcome, verdict.baseline_run_id) == ("unchanged", root.id)


# -------------------------------------------------------------------------------- acknowledge
def _judged(line: Lineage, session: Session, sha: str, cases: list[CaseResult] | None = None, **kw) -> Run:
    run = line.run(sha, *kw.pop("parents", ()), cases=cases, **kw)
    verdict_store.evaluate(session=session, run=run)
    return run


def test_a_changed_verdict_acknowledged_no_longer_flags_and_keeps_the_note(db_session) -> None:
    line = Lineage(db_session)
    _judged(line, db_session, "a")
    run = _judged(line, db_session, "b", [_case("adam-1", ["s1", "q2", "q3", "q4"])], parents=("a",))

    verdict = verdict_store.acknowledge(session=db_session, run=run, note="new rounding is intended", by="maint")

    db_session.expire_all()
    stored = db_session.scalar(select(Verdict).where(Verdict.run_id == run.id))
    assert (stored.outcome, stored.acknowledged, stored.flagged) == ("changed", True, False)
    assert (stored.acknowledgement_note, stored.acknowledged_by) == ("new rounding is intended", "maint")
    assert stored.acknowledged_at is not None and verdict.id == stored.id


@pytest.mark.parametrize("kind", ["broken", "nondeterministic"])
def test_broken_and_nondeterministic_verdicts_can_be_acknowledged(db_session, kind) -> None:
    line = Lineage(db_session)
    if kind == "broken":
        run = _judged(line, db_session, "a", [], status=FAILED, error="segfault")
    else:
        run = _judged(line, db_session, "a", [_case("adam-1", SAME, repeat_check=RepeatCheck(
            runs=2, differing=1, first_divergent_step=1))])

    verdict = verdict_store.acknowledge(session=db_session, run=run, note="known", by=None)

    assert (verdict.outcome, verdict.acknowledged, verdict.flagged) == (kind, True, False)


def test_an_unchanged_verdict_has_nothing_to_acknowledge(db_session) -> None:
    line = Lineage(db_session)
    _judged(line, db_session, "a")
    run = _judged(line, db_session, "b", parents=("a",))

    with pytest.raises(ConflictError) as refused:
        verdict_store.acknowledge(session=db_session, run=run, note="looks fine", by="maint")

    assert str(refused.value) == (f"run {run.id} has nothing to acknowledge: its verdict is unchanged; "
                                  "only a changed, broken or nondeterministic verdict can be acknowledged")
    stored = db_session.scalar(select(Verdict).where(Verdict.run_id == run.id))
    assert (stored.acknowledged, stored.acknowledgement_note) == (False, None)


def test_a_no_baseline_verdict_has_nothing_to_acknowledge(db_session) -> None:
    line = Lineage(db_session)
    run = _judged(line, db_session, "a")

    with pytest.raises(ConflictError, match="it has no baseline to change from"):
        verdict_store.acknowledge(session=db_session, run=run, note="first run", by=None)
    assert db_session.scalar(select(Verdict).where(Verdict.run_id == run.id)).acknowledged is False


def test_an_acknowledgement_needs_a_verdict_and_a_note(db_session) -> None:
    line = Lineage(db_session)
    _judged(line, db_session, "a")
    waiting = line.run("b", "a", status=RUNNING)
    with pytest.raises(NotFoundError, match=f"run {waiting.id} has no verdict yet"):
        verdict_store.acknowledge(session=db_session, run=waiting, note="why", by=None)

    changed = _judged(line, db_session, "c", [_case("adam-1", ["q1"] + SAME[1:])], parents=("a",))
    with pytest.raises(ConflictError, match="needs a note"):
        verdict_store.acknowledge(session=db_session, run=changed, note="   ", by=None)
    assert db_session.scalar(select(Verdict).where(Verdict.run_id == changed.id)).flagged is True


def test_a_commits_acknowledgement_takes_only_its_flagging_runs(db_session) -> None:
    line = Lineage(db_session)
    _judged(line, db_session, "a")
    changed = _judged(line, db_session, "b", [_case("adam-1", ["s1", "q2", "q3", "q4"])], parents=("a",))
    unchanged = _judged(line, db_session, "c", parents=("a",))

    acknowledged = verdict_store.acknowledge_runs(session=db_session, runs=[changed, unchanged],
                                                  note="intended", by="maint")

    assert [v.run_id for v in acknowledged] == [changed.id]
    left = db_session.scalar(select(Verdict).where(Verdict.run_id == unchanged.id))
    assert (left.acknowledged, left.acknowledgement_note, left.outcome) == (False, None, "unchanged")


def test_a_commits_acknowledgement_with_nothing_flagging_is_refused_whole(db_session) -> None:
    line = Lineage(db_session)
    root = _judged(line, db_session, "a")
    unchanged = _judged(line, db_session, "b", parents=("a",))

    with pytest.raises(ConflictError) as refused:
        verdict_store.acknowledge_runs(session=db_session, runs=[root, unchanged], note="x", by=None)

    # Each run's reason, in the runs' order.
    assert str(refused.value) == (
        f"{verdict_store.nothing_to_acknowledge(run_id=root.id, verdict=root.verdict)}; "
        f"{verdict_store.nothing_to_acknowledge(run_id=unchanged.id, verdict=unchanged.verdict)}")
    assert "no baseline" in str(refused.value) and "its verdict is unchanged" in str(refused.value)


def test_a_commits_acknowledgement_waits_for_every_runs_verdict(db_session) -> None:
    line = Lineage(db_session)
    _judged(line, db_session, "a")
    changed = _judged(line, db_session, "b", [_case("adam-1", ["q1"] + SAME[1:])], parents=("a",))
    waiting = line.run("c", "a", status=QUEUED)

    with pytest.raises(NotFoundError):
        verdict_store.acknowledge_runs(session=db_session, runs=[changed, waiting], note="x", by=None)
    assert db_session.scalar(select(Verdict).where(Verdict.run_id == changed.id)).acknowledged is False


def test_an_acknowledged_change_is_the_baseline_of_its_children(db_session) -> None:
    line = Lineage(db_session)
    _judged(line, db_session, "a")
    moved = [_case("adam-1", ["s1", "q2", "q3", "q4"]), _case("lion-2", SAME)]
    changed = _judged(line, db_session, "b", moved, parents=("a",))
    verdict_store.acknowledge(session=db_session, run=changed, note="intended", by=None)

    child = _judged(line, db_session, "c", moved, parents=("b",))

    assert (child.verdict.outcome, child.verdict.baseline_run_id) == ("unchanged", changed.id)
