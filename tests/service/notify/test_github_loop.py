"""Issue 44's whole loop once, end to end against the GitHub stand-in with a recorded payload:
push to main → a fork's pull request opened (a signed delivery; the contributor holds no token) →
flagged on the pull request → acknowledged by a `maintain` token → merged → main's merge commit
green (the same change, acknowledged automatically), the PR comment in place.

Runs are finished as a worker finishes them (claim, stored trajectories, status done, the verdicts
of the run and of those waiting for it) and notified through service.notify.hooks.notify_run, the
function the worker's result path calls. No worker, no kernel: the loop is the service's.
"""

from __future__ import annotations

from sqlalchemy import select

from service.core.results import CaseResult, CaseSpec, Trajectory as TrajectoryModel
from service.db.models import Run
from service.domain import auth, runs, trajectories, verdict_store
from service.notify.hooks import notify_run
from tests.service.notify.test_fork_pull_requests import (  # noqa: F401  (fixtures, by name)
    BASE, FAST_RETRY, HEAD, MERGE, MERGE_TREE, app_key, deliver, event, github_client, pr_runs, standin, world,
)
from tests.service_fixtures import make_archive

UNMOVED = {"lion-1": ["a1", "a2", "a3"], "adam-1": ["b1", "b2", "b3"]}
MOVED = {"lion-1": ["a1", "x2", "x3"], "adam-1": ["b1", "b2", "b3"]}  # lion changes from step 2
MAIN_MERGE = "f5" * 20  # main's merge commit: the pull request's tree on main's tip


def _finish(session, run: Run, digests: dict[str, list[str]]) -> None:  # noqa: ANN001
    assert runs.claim(session=session, run_id=run.id, worker="w")
    for index, (case_id, case_digests) in enumerate(sorted(digests.items())):
        trajectories.store_case_result(session=session, run_id=run.id, case_index=index, result=CaseResult(
            case=CaseSpec(case_id=case_id, optimizer=case_id.split("-")[0], hyper={"lr": 0.1}, seed=0, size=8,
                          steps=3),
            status="ok", trajectory=TrajectoryModel(ref64_max_abs=[0.0] * 3, ref64_max_rel=[0.0] * 3,
                                                     nonfinite_count=[0] * 3, digests=case_digests)))
    runs.set_status(session=session, run_id=run.id, worker="w", status="done", battery_hash="h")
    session.refresh(run)
    verdict_store.evaluate_with_dependants(session=session, run=run)


def _conclusions(standin, sha: str) -> dict[str, str | None]:  # noqa: ANN001
    """Each check run's latest conclusion on `sha`, by name."""
    latest: dict[str, str | None] = {}
    ids: dict[int, str] = {}
    for call in standin.state.requests:
        if call.operation_id == "checks/create" and call.body.get("head_sha") == sha:
            ids[len(ids) + 1] = call.body["name"]
            latest[call.body["name"]] = call.body.get("conclusion")
        elif call.operation_id == "checks/update" and call.body.get("conclusion") is not None:
            name = call.body.get("name")
            if name in latest:
                latest[name] = call.body["conclusion"]
    return latest


def test_push_fork_pr_flagged_ack_by_maintain_merge_main_green(db_session, api_settings, standin, world,  # noqa: ANN001
                                                                github_client) -> None:
    settings = github_client.settings
    # 1. Push to main: BASE (the world's tip) ends unchanged in both environments.
    base_runs = list(db_session.scalars(select(Run).where(Run.project_id == world.id, Run.kind == "commit")
                                        .order_by(Run.id)))
    for run in base_runs:
        _finish(db_session, run, UNMOVED)
        notify_run(session=db_session, run_id=run.id, settings=settings, retry=FAST_RETRY)

    # 2. A fork opens a pull request: GitHub's signed delivery, no token of the contributor's.
    answer = deliver(github_client, event())
    assert answer.status_code == 202, answer.text
    pr = pr_runs(db_session, world)
    assert len(pr) == 2

    # 3. Its runs change lion from step 2: flagged, the checks fail on the fork's head, one comment.
    for run in pr:
        _finish(db_session, run, MOVED)
        notify_run(session=db_session, run_id=run.id, settings=settings, retry=FAST_RETRY)
    flagged = github_client.get(f"/api/v1/runs/{pr[0].id}").json()["verdict"]
    assert (flagged["outcome"], flagged["flagged"]) == ("changed", True)
    assert set(_conclusions(standin, HEAD).values()) == {"failure"}
    assert list(standin.state.comments) == [8] and len(standin.state.comments[8]) == 1

    # 4. A maintainer (a `maintain` token, not admin) acknowledges the change on the pull request.
    _, maintain = auth.create_token(session=db_session, name="maintainer", scope="maintain", project=world.name)
    for run in pr:
        acked = github_client.post(f"/api/v1/runs/{run.id}/acknowledge", json={"note": "lion clamps first now",
                                                                              "by": "ana"},
                                   headers={"Authorization": f"Bearer {maintain}"})
        assert acked.status_code == 200, acked.text

    # 5. Merged: main's merge commit holds the pull request's tree on BASE; CI submits it.
    _, submit = auth.create_token(session=db_session, name="ci", scope="submit", project=world.name)
    submitted = github_client.post(f"/api/v1/projects/{world.name}/commits",
                                   headers={"Authorization": f"Bearer {submit}"},
                                   data={"sha": MAIN_MERGE, "parents": f"{BASE} {HEAD}"},
                                   files={"archive": ("t.tar.gz", make_archive(MERGE_TREE), "application/gzip")})
    assert submitted.status_code == 201, submitted.text
    main_runs = [db_session.get(Run, r["id"]) for r in submitted.json()["runs"]]
    for run in main_runs:
        _finish(db_session, run, MOVED)
        notify_run(session=db_session, run_id=run.id, settings=settings, retry=FAST_RETRY)

    # 6. Main is green: the same change, acknowledged automatically, linking the pull request's ack.
    for run in main_runs:
        verdict = github_client.get(f"/api/v1/runs/{run.id}").json()["verdict"]
        assert (verdict["acknowledged"], verdict["flagged"]) == (True, False), verdict
        assert verdict["acknowledged_via"]["run_id"] in {r.id for r in pr}
        assert verdict["acknowledged_via"]["acknowledged_by"] == "ana"
    main_checks = _conclusions(standin, MAIN_MERGE)
    assert main_checks and "failure" not in main_checks.values(), main_checks
    # The pull request's comment is still there, one, edited in place.
    assert len(standin.state.comments[8]) == 1
