"""A run's training impact through the API (issue 46, service/api/routes/training.py): GET says how
to get one when there is none; POST queues a job on the broker for two finished runs whose
trajectories differ, answers not_needed for identical ones, refuses a pair that cannot be compared
(another project or environment, an unfinished run, the run itself) with the reason, refuses a
verify token of another project or of runs it did not submit, returns the one job of a pair when asked twice and queues a
failed one again; GET ?curves=false leaves the per-step losses out.

Against the real PostgreSQL (the test's rolled-back transaction) and the test settings' real Redis
broker (tests/service_fixtures.py api_settings). Runs are rows with cases stored as a worker stores
them (tests/service/api/test_environment_attribution.py does the same); a done job's results are
written as worker/jobs/training.py writes them, through service.run_store. The helpers below are
shared with tests/service/cli/test_training_cli.py and tests/service/notify/test_notify_training.py.
"""

from __future__ import annotations

import base64
import json

import redis

from service import run_store
from service.broker.queueing import TRAINING_TASK_NAME, corun_queue_for
from service.core.results import CaseResult, CaseSpec, Trajectory
from service.core.training import (
    ImpactFigures, Interval, LossCurves, ModelImpact, TrainingConfig, impact_sentence,
)
from service.core.verdicts import compare_runs
from service.db.models import DONE, RUNNING, Commit, Project, Run, SourceArchive, Verdict
from service.domain import trajectories
from service.domain.auth import create_token

SOURCE = "c" * 64
HYPER = {"lr": 0.1, "weight_decay": 0.1}


def _case(case_id: str, digests: list[str]) -> CaseResult:
    spec = CaseSpec(case_id=case_id, optimizer="adam", hyper=HYPER, seed=0, size=8, steps=len(digests))
    return CaseResult(case=spec, status="ok", trajectory=Trajectory(
        ref64_max_abs=[1e-7] * len(digests), ref64_max_rel=[1e-7] * len(digests),
        nonfinite_count=[0] * len(digests), digests=[f"od2:{d}" for d in digests]))


def make_project(session, name: str, environments: tuple[str, ...] = ("cpu",)) -> Project:  # noqa: ANN001
    project = Project(name=name, environments=list(environments))
    session.add(project)
    session.flush()
    return project


def add_run(session, project: Project, sha: str, moved: list[str], *, environment: str = "cpu",  # noqa: ANN001
            status: str = DONE) -> Run:
    """A run of commit `sha` as a worker leaves it: two adam cases, the second with digests `moved`."""
    if session.get(SourceArchive, SOURCE) is None:
        session.add(SourceArchive(digest=SOURCE, size_bytes=1, member_count=1))
        session.flush()
    commit = Commit(project_id=project.id, sha=sha, parents=[], source_digest=SOURCE)
    session.add(commit)
    session.flush()
    run = Run(project_id=project.id, commit_id=commit.id, source_digest=SOURCE, battery="quick",
              battery_hash="b" * 64, environment=environment, build_digest=sha[:64].ljust(64, "0"), status=status,
              environment_detail={"battery_version": 1})
    session.add(run)
    session.flush()
    store_cases(session, run.id, moved)
    return run


def store_cases(session, run_id: int, moved: list[str]) -> None:  # noqa: ANN001
    """The run's two adam cases as a worker stores them: `adam-same`, and `adam-moved` with digests `moved`."""
    trajectories.store_case_results(session=session, run_id=run_id,
                                    results=[(0, _case("adam-same", ["a", "b", "c"])), (1, _case("adam-moved", moved))])
    session.flush()


def add_verdict(session, run: Run, baseline: Run) -> Verdict:  # noqa: ANN001
    """The verdict a worker stores for `run` against `baseline` (compared by the service's own rule)."""
    comparison = compare_runs(trajectories.run_result(session=session, run=run),
                              trajectories.run_result(session=session, run=baseline))
    verdict = Verdict(run_id=run.id, baseline_run_id=baseline.id, outcome=comparison.verdict,
                      detail=comparison.model_dump(mode="json"), flagged=comparison.verdict == "changed",
                      changed_cases=comparison.counts.get("changed", 0))
    session.add(verdict)
    session.flush()
    return verdict


def changed_pair(session, project_name: str = "trained") -> tuple[Run, Run]:  # noqa: ANN001
    """(baseline, run): two finished runs of one project whose `adam-moved` case differs from step 1,
    the run's verdict (changed) comparing with the baseline."""
    project = make_project(session, project_name)
    baseline = add_run(session, project, "1" * 40, ["d", "e", "f"])
    run = add_run(session, project, "2" * 40, ["x", "y", "z"])
    add_verdict(session, run, baseline)
    return baseline, run


def model_impact(verdict: str, *, model: str = "mlp", relative_shift: float = 0.0123, seeds: int = 6,
                 steps: int = 4) -> ModelImpact:
    """One model x configuration's result as the worker stores it (worker/training/stats.py's figures)."""
    curves = LossCurves(commit=[[2.0 - 0.1 * step for step in range(steps)]] * seeds,
                        baseline=[[2.0 - 0.09 * step for step in range(steps)]] * seeds,
                        floor=[[2.0 - 0.091 * step for step in range(steps)]] * seeds)
    return ModelImpact(
        model=model, config=TrainingConfig(optimizer="adam", hyper=HYPER),
        figures=ImpactFigures(verdict=verdict, seeds=seeds, window=2, relative_shift=relative_shift,
                              relative_ci=Interval(low=relative_shift / 2, high=relative_shift * 1.5),
                              reason="NaN loss in 2 of 6 commit runs" if verdict == "diverged" else None),
        first_divergent_step=1, floor_first_divergent_step=1, curves=curves, seconds=1.5)


def finish_job(session, job_id: int, results: list[ModelImpact]) -> None:  # noqa: ANN001
    """What worker/jobs/training.py stores at the end of a job."""
    run_store.finish_training_impact(job_id, results=[result.model_dump(mode="json") for result in results],
                                     device="cpu", seconds=12.5, session=session)


def _queued_jobs(settings) -> list[int]:  # noqa: ANN001
    """The training-impact job ids waiting on the cpu co-run queue of the test's Redis broker."""
    messages = redis.Redis.from_url(settings.resolved_broker_url).lrange(corun_queue_for("cpu"), 0, -1)
    found = []
    for message in messages:
        body = json.loads(message)
        assert body["headers"]["task"] == TRAINING_TASK_NAME
        found.append(json.loads(base64.b64decode(body["body"]))[0][0])
    return found


def test_get_without_a_job_says_how_to_get_one(api, db_session) -> None:  # noqa: ANN001
    _, run = changed_pair(db_session)
    answer = api.get(f"/api/v1/runs/{run.id}/training")
    assert answer.status_code == 404
    assert f"POST /api/v1/runs/{run.id}/training" in answer.json()["detail"]
    assert api.get("/api/v1/runs/999999/training").status_code == 404


def test_post_queues_a_job_once_and_get_shows_it(api, db_session, api_settings) -> None:  # noqa: ANN001
    baseline, run = changed_pair(db_session)
    _, token = create_token(session=db_session, name="ci", scope="submit", project="trained")
    first = api.post(f"/api/v1/runs/{run.id}/training", json={}, headers={"Authorization": f"Bearer {token}"})
    assert first.status_code == 202, first.text
    job = first.json()
    # One changed configuration (adam at lr 0.1, wd 0.1) x the quick set's two models x 6 seeds x 3 runs.
    assert (job["status"], job["baseline_run_id"], job["model_set"]) == ("queued", baseline.id, "quick")
    assert job["progress"]["runs_total"] == 1 * 2 * 6 * 3
    assert _queued_jobs(api_settings) == [job["id"]]

    again = api.post(f"/api/v1/runs/{run.id}/training", json={"baseline_run_id": baseline.id})
    assert again.status_code == 202 and again.json()["id"] == job["id"]
    # Still queued: it has its message, asking again sends no second one; the worker's claim
    # (queued -> running) lets one delivery run it.
    assert _queued_jobs(api_settings) == [job["id"]]
    assert run_store.claim_training_impact(job["id"], worker="w1", session=db_session) is True
    assert run_store.claim_training_impact(job["id"], worker="w2", session=db_session) is False
    shown = api.get(f"/api/v1/runs/{run.id}/training")
    assert shown.status_code == 200 and shown.json()["id"] == job["id"]
    assert api.get(f"/api/v1/training/{job['id']}").json()["status"] == "running"
    # Asked while it runs: the same job, not sent again.
    sent = len(_queued_jobs(api_settings))
    assert api.post(f"/api/v1/runs/{run.id}/training", json={}).json()["status"] == "running"
    assert len(_queued_jobs(api_settings)) == sent


def test_identical_runs_need_no_training(api, db_session, api_settings) -> None:  # noqa: ANN001
    project = make_project(db_session, "same")
    baseline = add_run(db_session, project, "1" * 40, ["d", "e", "f"])
    run = add_run(db_session, project, "2" * 40, ["d", "e", "f"])
    answer = api.post(f"/api/v1/runs/{run.id}/training", json={"baseline_run_id": baseline.id})
    assert answer.status_code == 202, answer.text
    body = answer.json()
    assert (body["status"], body["progress"]["runs_total"]) == ("not_needed", 0)
    assert "no trajectory differs" in body["error"]
    assert _queued_jobs(api_settings) == []


def test_pairs_that_cannot_be_compared_are_refused_with_the_reason(api, db_session, api_settings) -> None:  # noqa: ANN001
    baseline, run = changed_pair(db_session)
    other_project = make_project(db_session, "elsewhere")
    foreign = add_run(db_session, other_project, "3" * 40, ["d", "e", "f"])
    project = db_session.get(Project, run.project_id)
    other_environment = add_run(db_session, project, "4" * 40, ["d", "e", "f"], environment="cpu+fma")
    unfinished = add_run(db_session, project, "5" * 40, ["d", "e", "f"], status=RUNNING)
    lone = add_run(db_session, project, "6" * 40, ["d", "e", "f"])  # no verdict, so no baseline of its own

    def refused(run_id: int, baseline_run_id: int | None) -> str:
        answer = api.post(f"/api/v1/runs/{run_id}/training", json={"baseline_run_id": baseline_run_id})
        assert answer.status_code == 422, (run_id, baseline_run_id, answer.text)
        return answer.json()["detail"]

    assert "different projects" in refused(run.id, foreign.id)
    message = refused(run.id, other_environment.id)
    assert "'cpu+fma'" in message and "one environment" in message
    assert f"baseline run {unfinished.id} is running, not done" in refused(run.id, unfinished.id)
    assert f"run {unfinished.id} is running, not done" in refused(unfinished.id, baseline.id)
    assert "not itself" in refused(run.id, run.id)
    assert "name one (baseline_run_id)" in refused(lone.id, None)
    assert api.post(f"/api/v1/runs/{run.id}/training", json={"model_set": "huge"}).status_code == 422
    assert api.post(f"/api/v1/runs/{run.id}/training", json={"baseline_run_id": 999999}).status_code == 404
    assert _queued_jobs(api_settings) == []


def test_a_verify_token_asks_only_about_its_own_runs_against_their_baselines(api, db_session,  # noqa: ANN001
                                                                             api_settings) -> None:
    """A job is minutes of a worker: a contributor's verify token may ask for its own verify runs
    (what its daily quota bounds) against their baselines, never for any pair of the project."""
    from service.db.token_models import TokenRun

    baseline, run = changed_pair(db_session)
    _, other = create_token(session=db_session, name="contributor", scope="verify", project="elsewhere")
    answer = api.post(f"/api/v1/runs/{run.id}/training", json={}, headers={"Authorization": f"Bearer {other}"})
    assert answer.status_code == 403
    assert "'trained'" in answer.json()["detail"]
    row, own = create_token(session=db_session, name="contributor-here", scope="verify", project="trained")
    headers = {"Authorization": f"Bearer {own}"}
    answer = api.post(f"/api/v1/runs/{run.id}/training", json={}, headers=headers)
    assert answer.status_code == 403 and "its own verify runs" in answer.json()["detail"]
    db_session.add(TokenRun(token_id=row.id, run_id=run.id))
    db_session.flush()
    elsewhere = api.post(f"/api/v1/runs/{run.id}/training", json={"baseline_run_id": run.id + 1000}, headers=headers)
    assert elsewhere.status_code == 403 and "own baseline" in elsewhere.json()["detail"]
    assert api.post(f"/api/v1/runs/{run.id}/training", json={"baseline_run_id": baseline.id},
                    headers=headers).status_code == 202
    assert api.post(f"/api/v1/runs/{run.id}/training", json={}, headers=headers).status_code == 202
    assert api.post(f"/api/v1/runs/{run.id}/training", json={},
                    headers={"Authorization": "Bearer nope"}).status_code == 401


def test_a_failed_job_is_queued_again(api, db_session, api_settings) -> None:  # noqa: ANN001
    _, run = changed_pair(db_session)
    job = api.post(f"/api/v1/runs/{run.id}/training", json={}).json()
    assert run_store.claim_training_impact(job["id"], worker="w1", session=db_session)
    run_store.finish_training_impact(job["id"], error="the baseline no longer builds", session=db_session)
    failed = api.get(f"/api/v1/training/{job['id']}").json()
    assert (failed["status"], failed["error"]) == ("failed", "the baseline no longer builds")

    sent = _queued_jobs(api_settings)
    again = api.post(f"/api/v1/runs/{run.id}/training", json={})
    assert again.status_code == 202
    assert (again.json()["id"], again.json()["status"], again.json()["error"]) == (job["id"], "queued", None)
    assert _queued_jobs(api_settings) == [*sent, job["id"]]  # sent again for a worker to take


def test_curves_false_leaves_the_losses_out(api, db_session) -> None:  # noqa: ANN001
    _, run = changed_pair(db_session)
    job = api.post(f"/api/v1/runs/{run.id}/training", json={}).json()
    stored = [model_impact("beyond_noise"), model_impact("within_floor", model="transformer")]
    finish_job(db_session, job["id"], stored)

    full = api.get(f"/api/v1/runs/{run.id}/training").json()
    assert (full["status"], full["device"], full["seconds"]) == ("done", "cpu", 12.5)
    assert [result["curves"]["commit"] for result in full["results"]] == [r.curves.commit for r in stored]
    lean = api.get(f"/api/v1/runs/{run.id}/training", params={"curves": "false"}).json()
    assert [result["curves"] for result in lean["results"]] == [None, None]
    assert [result["figures"] for result in lean["results"]] == [result["figures"] for result in full["results"]]
    by_id = api.get(f"/api/v1/training/{job['id']}", params={"curves": "false"}).json()
    assert by_id == lean
    # What the CLI and the PR comment print from it.
    assert impact_sentence(ModelImpact.model_validate(lean["results"][0])).startswith("beyond seed noise: final loss")
