"""service/domain/baselines.py on the real PostgreSQL (one rolled-back transaction per test): which
run a run is compared with, and which finished runs were waiting for a run to become their baseline.

Commits and runs are written as rows (no archive, no queue): the module reads only commits' first
parents, runs' commit, base commit, battery, environment and status, and verdicts' presence.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from service.db.models import (CANCELLED, DONE, ERROR, FAILED, QUEUED, RUNNING, Commit, Project, Run,
                               SourceArchive, Verdict)
from service.domain import baselines

SOURCE = "0" * 64


class Lineage:
    """Commits of one project by sha, and their runs (cpu, quick unless told)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.project = Project(name="lineage", environments=["cpu", "gpu.sm90"])
        session.add(self.project)
        if session.get(SourceArchive, SOURCE) is None:
            session.add(SourceArchive(digest=SOURCE, size_bytes=1, member_count=1))
        session.flush()
        self.commits: dict[str, Commit] = {}

    def commit(self, sha: str, *parents: str) -> Commit:
        commit = Commit(project_id=self.project.id, sha=sha, parents=list(parents), source_digest=SOURCE)
        self.session.add(commit)
        self.session.flush()
        self.commits[sha] = commit
        return commit

    def run(self, sha: str | None, status: str = DONE, *, environment: str = "cpu", battery: str = "quick",
            base: str | None = None, kind: str = "commit") -> Run:
        run = Run(project_id=self.project.id, kind=kind, commit_id=self.commits[sha].id if sha else None,
                  base_commit_id=self.commits[base].id if base else None, source_digest=SOURCE,
                  battery=battery, environment=environment, status=status)
        self.session.add(run)
        self.session.flush()
        return run

    def judged(self, run: Run) -> Run:
        """Give `run` a verdict (any outcome): it is no longer waiting for a baseline."""
        self.session.add(Verdict(run_id=run.id, outcome="unchanged", flagged=False, detail={}))
        self.session.flush()
        self.session.refresh(run)
        return run


def test_the_first_parents_finished_run_is_the_baseline(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("b", "a")
    line.commit("c", "b")
    line.run("a")
    parent_run = line.run("b")
    run = line.run("c")

    choice = baselines.choose(session=db_session, run=run)

    # The nearest ancestor, not the older one; and the reason names the commit chosen.
    assert (choice.run, choice.pending) == (parent_run, False)
    assert choice.reason == "first parent b"


def test_failed_cancelled_and_error_ancestors_are_walked_past(db_session) -> None:
    line = Lineage(db_session)
    for sha, parent in [("a", None), ("b", "a"), ("c", "b"), ("d", "c"), ("e", "d")]:
        line.commit(sha, *([parent] if parent else []))
    root_run = line.run("a")
    line.run("b", FAILED)  # a broken build says nothing about trajectories
    line.run("c", CANCELLED)
    line.run("d", ERROR)
    run = line.run("e")

    choice = baselines.choose(session=db_session, run=run)

    # Four commits back, and the reason says which nearer ones were passed over and why.
    assert (choice.run, choice.pending, choice.commits_back) == (root_run, False, 4)
    assert choice.reason == (f"a, 4 commits back on the first-parent line (run {root_run.id}): nearer ones "
                             f"passed over (d run {run.id - 1} error; c run {run.id - 2} cancelled; "
                             f"b run {run.id - 3} failed)")


def test_an_unfinished_parent_run_makes_the_verdict_wait(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("b", "a")
    line.commit("c", "b")
    line.run("a")
    waiting_for = line.run("b", RUNNING)
    run = line.run("c")

    choice = baselines.choose(session=db_session, run=run)

    # It waits for the nearest ancestor rather than falling back to the finished grandparent.
    assert (choice.run, choice.pending) == (waiting_for, True)
    assert choice.reason == f"waiting for b (run {waiting_for.id}, 1 commit(s) back)"


def test_a_queued_parent_run_makes_the_verdict_wait_too(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("b", "a")
    queued = line.run("a", QUEUED)
    run = line.run("b")

    choice = baselines.choose(session=db_session, run=run)

    assert (choice.run, choice.pending) == (queued, True)


def test_a_run_in_another_environment_or_battery_is_never_the_baseline(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("b", "a")
    line.commit("c", "b")
    same_class = line.run("a")
    # The parent finished, but only on a GPU class and with another battery on cpu.
    line.run("b", environment="gpu.sm90")
    line.run("b", battery="full")
    run = line.run("c")

    choice = baselines.choose(session=db_session, run=run)

    assert choice.run == same_class and choice.run.environment == "cpu" and choice.run.battery == "quick"

    # And a GPU run of the child compares with the parent's GPU run, never a cpu one.
    gpu_run = line.run("c", environment="gpu.sm90")
    gpu_choice = baselines.choose(session=db_session, run=gpu_run)
    assert gpu_choice.run.environment == "gpu.sm90" and gpu_choice.run.commit_id == line.commits["b"].id


def test_nothing_finished_in_the_environment_means_no_baseline(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("b", "a")
    line.run("a", environment="gpu.sm90")
    line.run("a", FAILED)
    run = line.run("b")

    choice = baselines.choose(session=db_session, run=run)

    assert (choice.run, choice.pending) == (None, False)
    assert choice.reason.startswith("none of the 1 first-parent ancestor(s) sent with commit b has a finished "
                                    "run in cpu with battery quick (a run ")
    assert "--allow-no-baseline" in choice.reason


def test_a_root_commit_has_no_baseline(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    choice = baselines.choose(session=db_session, run=line.run("a"))
    assert (choice.run, choice.pending) == (None, False)


def test_a_parent_never_submitted_ends_the_walk_and_says_so(db_session) -> None:
    line = Lineage(db_session)
    line.commit("b", "never-sent")

    choice = baselines.choose(session=db_session, run=line.run("b"))

    assert choice.run is None and "(never-sent never submitted)" in choice.reason


def test_only_the_first_parent_of_a_merge_is_followed(db_session) -> None:
    line = Lineage(db_session)
    line.commit("root")
    line.commit("main", "root")
    line.commit("topic", "root")
    line.commit("merge", "main", "topic")
    root_run = line.run("root")
    line.run("main", FAILED)
    line.run("topic")  # finished, but the merge's second parent

    choice = baselines.choose(session=db_session, run=line.run("merge"))

    assert choice.run == root_run


def test_a_named_base_commit_wins_over_the_first_parent(db_session) -> None:
    line = Lineage(db_session)
    line.commit("v1")
    line.commit("a", "v1")
    line.commit("b", "a")
    release_run = line.run("v1")
    line.run("a")  # the first parent has a finished run too
    run = line.run("b", base="v1")

    choice = baselines.choose(session=db_session, run=run)

    assert (choice.run, choice.pending, choice.reason) == (release_run, False, "base commit v1")


def test_a_verify_run_compares_with_its_base_commit(db_session) -> None:
    line = Lineage(db_session)
    line.commit("main")
    base_run = line.run("main")
    verify = line.run(None, base="main", kind="verify")

    assert baselines.choose(session=db_session, run=verify).run == base_run
    # Without a base and without a commit there is nothing to walk.
    lone = line.run(None, kind="verify")
    assert baselines.choose(session=db_session, run=lone) == baselines.BaselineChoice(
        None, reason="the run has no commit and no base")


def test_a_named_base_without_a_run_in_the_class_is_no_baseline(db_session) -> None:
    line = Lineage(db_session)
    line.commit("v1")
    line.commit("b", "v1")
    line.run("v1", environment="gpu.sm90")  # the base ran, elsewhere only

    choice = baselines.choose(session=db_session, run=line.run("b", base="v1"))

    assert (choice.run, choice.pending) == (None, False)
    assert choice.reason == "base commit v1 has no run in cpu with battery quick"


def test_a_named_base_that_failed_is_final_and_one_still_running_is_waited_for(db_session) -> None:
    line = Lineage(db_session)
    line.commit("broken")
    line.commit("busy")
    line.commit("b")
    failed = line.run("broken", FAILED)
    running = line.run("busy", RUNNING)

    on_failed = baselines.choose(session=db_session, run=line.run("b", base="broken"))
    # Not the failed run as a baseline to compare with, and no waiting either: it is final.
    assert (on_failed.run, on_failed.pending) == (failed, False)
    assert on_failed.reason == f"base run {failed.id} is failed"

    line.commit("c")
    on_running = baselines.choose(session=db_session, run=line.run("c", base="busy"))
    assert (on_running.run, on_running.pending) == (running, True)
    assert on_running.reason == f"base run {running.id} is running"


def test_dependants_are_the_unjudged_finished_runs_that_would_pick_this_run(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("child", "a")
    line.commit("judged-child", "a")
    line.commit("busy-child", "a")
    line.commit("grandchild", "child")
    line.commit("second-parent-child", "other", "a")
    line.commit("other")
    line.commit("based", "other")
    line.commit("v1")
    run = line.run("a")

    waiting_child = line.run("child")
    line.judged(line.run("judged-child"))  # has its verdict already
    line.run("busy-child", RUNNING)  # judged when it finishes
    line.run("child", environment="gpu.sm90")  # another class
    line.run("child", battery="full")  # another battery
    line.run("grandchild")  # its baseline is child's run, not a's
    line.run("second-parent-child")  # a is not its first parent
    based_on_a = line.run("based", base="a")  # a commit submitted with baseline=a
    verify_on_a = line.run(None, base="a", kind="verify")
    line.run(None, base="v1", kind="verify")

    found = baselines.dependants(session=db_session, run=run)

    assert sorted(r.id for r in found) == sorted([waiting_child.id, based_on_a.id, verify_on_a.id])


def test_a_child_with_a_named_base_elsewhere_is_not_a_dependant(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    line.commit("v1")
    line.commit("child", "a")
    run = line.run("a")
    line.run("child", base="v1")  # its baseline is v1's run, though a is its first parent

    assert baselines.dependants(session=db_session, run=run) == []


def test_a_verify_run_has_no_dependants(db_session) -> None:
    line = Lineage(db_session)
    line.commit("a")
    verify = line.run(None, base="a", kind="verify")
    assert baselines.dependants(session=db_session, run=verify) == []
