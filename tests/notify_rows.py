"""Rows the notifier tests need (a project, a commit, its runs and their verdicts), written in the
test's rolled-back transaction."""

from __future__ import annotations

import itertools

from service.db.models import Commit, Project, Run, SourceArchive, Trajectory, Verdict

_counter = itertools.count(1)


def make_project(session, name: str | None = None) -> Project:  # noqa: ANN001
    project = Project(name=name or f"notify-{next(_counter)}", environments=["cpu", "gpu.sm90"])
    session.add(project)
    if session.get(SourceArchive, "e" * 64) is None:
        session.add(SourceArchive(digest="e" * 64, size_bytes=1, member_count=1))
    session.flush()
    return project


def make_commit(session, project: Project, sha: str) -> Commit:  # noqa: ANN001
    commit = Commit(project_id=project.id, sha=sha, parents=[], ref="feature", source_digest="e" * 64)
    session.add(commit)
    session.flush()
    return commit


def make_run(session, commit: Commit, *, environment: str = "cpu", status: str = "building") -> Run:  # noqa: ANN001
    run = Run(project_id=commit.project_id, kind="commit", commit_id=commit.id, source_digest="e" * 64,
              battery="quick", environment=environment, status=status, attempt=1)
    session.add(run)
    session.flush()
    return run


def _case(case_id: str, optimizer: str, verdict: str, **extra) -> dict:  # noqa: ANN003
    return {"case_id": case_id, "optimizer": optimizer, "verdict": verdict, **extra}


# Three changed cases in two (optimizer, family) groups, one not applicable, one unchanged.
CHANGED_CASES = [
    _case("adam-wd-a1", "adam", "changed", first_divergent_step=1, direction="farther",
          commit_final_ref64_distance=1e-2, baseline_final_ref64_distance=1e-5),
    _case("adam-wd-b2", "adam", "changed", first_divergent_step=3, direction="same"),
    _case("adam8-c3", "adam", "changed", first_divergent_step=2, direction="closer"),
    _case("lion-na-d4", "lion", "not_applicable", message="no 8-bit Lion on this device"),
    _case("rms-e5", "rmsprop", "unchanged"),
]
FAMILIES = {"adam-wd-a1": "32bit", "adam-wd-b2": "32bit", "adam8-c3": "8bit_blockwise",
            "lion-na-d4": "8bit_blockwise", "rms-e5": "32bit"}


def finish_run(session, run: Run, *, outcome: str, status: str = "done",  # noqa: ANN001
               cases: list[dict] | None = None) -> Verdict | None:
    """The run finished: its status, the cases' specs (their kernel family), and its verdict."""
    run.status = status
    cases = CHANGED_CASES if cases is None else cases
    for index, case in enumerate(cases):
        session.add(Trajectory(
            run_id=run.id, case_id=case["case_id"], case_index=index,
            case={"case_id": case["case_id"], "optimizer": case["optimizer"],
                  "family": FAMILIES.get(case["case_id"], "32bit"), "param_dtype": "float32",
                  "hyper": {"lr": 1e-3, "weight_decay": 1e-2}, "seed": index, "size": 64, "steps": 20},
            status="ok", steps=0, series_layout=[], series_data=b"", digests=""))
    verdict = None
    if status != "error":
        changed = [c for c in cases if c["verdict"] in ("changed", "broken")]
        counts: dict[str, int] = {}
        for case in cases:
            counts[case["verdict"]] = counts.get(case["verdict"], 0) + 1
        verdict = Verdict(run_id=run.id, outcome=outcome, flagged=outcome in ("changed", "broken"),
                          changed_cases=len(changed), first_divergent_step=1 if changed else None,
                          detail={"verdict": outcome, "summary": f"{len(changed)} case(s) changed",
                                  "battery_digest": "b" * 64, "counts": counts, "cases": cases})
        session.add(verdict)
    session.flush()
    session.refresh(run)
    return verdict
