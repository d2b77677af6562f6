"""Issue 44 through the real API on PostgreSQL (rolled back per test): a baseline is found, never
assumed absent; every result says what it was compared with; an acknowledgement belongs to the
change, not the sha; a `maintain` token acknowledges, a `submit` token cannot.

Commits are submitted over HTTP as CI does (parents, the first-parent ancestry, allow_no_baseline);
their runs are finished as a worker finishes them (claim, stored trajectories, status done, then the
verdicts of the run and of those waiting for it: service/domain/verdict_store.py)."""

from __future__ import annotations

import pytest

from service.core.results import CaseResult, CaseSpec, Trajectory as TrajectoryModel
from service.domain import auth, projects, runs, trajectories, verdict_store
from tests.service_fixtures import make_archive

PROJECT = "kern"


def _case(case_id: str) -> CaseSpec:
    return CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1}, seed=0, size=8, steps=3)


def _finish(session, run_id: int, digests: dict[str, list[str]]) -> dict:  # noqa: ANN001
    """What a worker does at the end of a run: its cases' trajectories, `done`, the verdicts."""
    assert runs.claim(session=session, run_id=run_id, worker="w")
    for index, (case_id, case_digests) in enumerate(sorted(digests.items())):
        trajectories.store_case_result(session=session, run_id=run_id, case_index=index, result=CaseResult(
            case=_case(case_id), status="ok", trajectory=TrajectoryModel(
                ref64_max_abs=[0.0] * 3, ref64_max_rel=[0.0] * 3, nonfinite_count=[0] * 3, digests=case_digests)))
    runs.set_status(session=session, run_id=run_id, worker="w", status="done", battery_hash="h")
    run = runs.get(session=session, run_id=run_id)
    session.refresh(run)  # the status was written by an UPDATE statement
    verdict_store.evaluate_with_dependants(session=session, run=run)


SAME = {"adam-1": ["d1", "d2", "d3"], "adam-2": ["e1", "e2", "e3"]}
MOVED = {"adam-1": ["d1", "x2", "x3"], "adam-2": ["e1", "e2", "e3"]}


@pytest.fixture
def kern(db_session):  # noqa: ANN001
    projects.create(session=db_session, name=PROJECT)
    db_session.flush()
    return PROJECT


def _tree_archive(tree: str) -> bytes:
    """The source folder packed as `optdrift submit` packs it (reproducibly: the same tree, the same
    bytes, the same digest, whichever commit it is filed under)."""
    import tempfile
    from pathlib import Path

    from service.core.archives import pack_directory

    with tempfile.TemporaryDirectory() as folder:
        (Path(folder) / "ops.cpp").write_text(f"// {tree}\n")
        return pack_directory(Path(folder))


def _submit(api, sha: str, *, parents=(), ancestry=(), tree: str = "base", allow: bool = False,  # noqa: ANN001
            headers: dict | None = None):
    data = {"sha": sha, "parents": " ".join(parents)}
    if ancestry:
        data["ancestry"] = " ".join(ancestry)
    if allow:
        data["allow_no_baseline"] = "true"
    response = api.post(f"/api/v1/projects/{PROJECT}/commits", data=data, headers=headers or {},
                        files={"archive": ("s.tar.gz", _tree_archive(tree), "application/gzip")})
    assert response.status_code in (200, 201), response.text
    return response.json()["runs"][0]["id"]


def _run(api, run_id: int) -> dict:  # noqa: ANN001
    response = api.get(f"/api/v1/runs/{run_id}")
    assert response.status_code == 200, response.text
    return response.json()


def _exit_code(run: dict) -> int:
    from service.cli.main import run_exit_code

    return run_exit_code(run)


# ----------------------------------------------------------------------------- the baseline rule
def test_a_pr_on_an_unsubmitted_base_is_compared_with_the_nearest_submitted_ancestor(api, db_session, kern):  # noqa: ANN001
    """main's v was submitted; its children t, u, w never were (pushed together, or the run was
    skipped). A PR's merge commit on t is compared with v, 3 commits back, and every surface says so."""
    base = _submit(api, "v" * 40, allow=True)
    _finish(db_session, base, SAME)
    merge = _submit(api, "m" * 40, parents=["t" * 40, "h" * 40], ancestry=["t" * 40, "u" * 40, "v" * 40], tree="pr")
    _finish(db_session, merge, MOVED)

    run = _run(api, merge)
    verdict = run["verdict"]
    assert verdict["outcome"] == "changed" and verdict["baseline_run_id"] == base
    assert verdict["baseline"] == {"run_id": base, "commit_sha": "v" * 40, "environment": "cpu",
                                   "battery": "quick", "commits_back": 3}
    assert "3 commits back" in verdict["baseline_note"] and "t" * 12 + " never submitted" in verdict["baseline_note"]
    # The CLI's table cell and line, the check run's summary: the commit, the run, the environment, how far.
    from service.cli.report import baseline_lines, compared_with
    from service.domain.dashboard_queries import run_page
    from service.notify.conclusions import conclusion_for
    from service.notify.report import check_output

    assert compared_with(run) == f"{'v' * 12} (run {base}, cpu, 3 commits back)"
    assert baseline_lines([run]) == [f"run {merge}: compared with {'v' * 12} (run {base}, cpu, 3 commits back)"]
    summary = check_output(page=run_page(session=db_session, run_id=merge), conclusion=conclusion_for("changed"),
                           run_url="u")["summary"]
    assert f"Compared with: `{'v' * 12}` (run {base}, cpu, battery quick, 3 commits back)." in summary
    from service.notify.report import CommentRun, pr_comment

    comment = pr_comment(project=PROJECT, sha="m" * 40, runs=[CommentRun(
        page=run_page(session=db_session, run_id=merge), conclusion=conclusion_for("changed"), run_url="u")])
    assert f"| `{'v' * 12}` (run {base}, cpu, battery quick, 3 commits back) |" in comment
    assert _exit_code(run) == 1


def test_a_run_waits_for_a_nearer_ancestor_still_running_and_is_judged_when_it_finishes(api, db_session, kern):  # noqa: ANN001
    old = _submit(api, "a" * 40, allow=True)
    _finish(db_session, old, SAME)
    nearer = _submit(api, "b" * 40, parents=["a" * 40], tree="b")  # queued: not finished yet
    child = _submit(api, "c" * 40, parents=["x" * 40], ancestry=["x" * 40, "b" * 40, "a" * 40], tree="c")
    _finish(db_session, child, MOVED)
    assert _run(api, child)["verdict"] is None  # waits for b, two commits back
    _finish(db_session, nearer, SAME)
    verdict = _run(api, child)["verdict"]
    assert verdict["baseline"]["run_id"] == nearer and verdict["baseline"]["commits_back"] == 2


def test_no_submitted_ancestor_fails_with_the_message_and_passes_neutral_only_when_allowed(api, db_session, kern):  # noqa: ANN001
    from service.notify.conclusions import conclusion_for

    lonely = _submit(api, "m" * 40, parents=["t" * 40, "h" * 40], ancestry=["t" * 40, "u" * 40])
    _finish(db_session, lonely, SAME)
    run = _run(api, lonely)
    verdict = run["verdict"]
    assert verdict["outcome"] == "no-baseline"
    assert _exit_code(run) == 7  # never a silent pass
    assert verdict["no_baseline_allowed"] is False
    assert verdict["baseline"] is None
    assert verdict["baseline_note"].startswith(f"none of the 2 first-parent ancestor(s) sent with commit {'m' * 40} "
                                               "has a finished run in cpu with battery quick")
    assert "--allow-no-baseline" in verdict["baseline_note"]
    assert _exit_code(run) == 7
    assert conclusion_for("no-baseline", **({"no_baseline_allowed": False} if "no_baseline_allowed" in verdict
                                            else {})).conclusion == "failure"
    from service.cli.report import baseline_lines

    assert baseline_lines([run])[0].startswith(f"run {lonely}: no baseline, fails (exit 7): none of the 2")
    from service.notify.action_outputs import outputs

    assert outputs({"runs": [run]}, 6)["verdict"] == "no-baseline"  # the Action's `verdict` output

    first = _submit(api, "f" * 40, tree="first", allow=True)  # a project's first commit, allowed
    _finish(db_session, first, SAME)
    run = _run(api, first)
    assert run["verdict"]["outcome"] == "no-baseline" and run["verdict"]["no_baseline_allowed"] is True
    assert _exit_code(run) == 0
    assert conclusion_for("no-baseline", no_baseline_allowed=True).conclusion == "neutral"


def test_the_ancestry_is_checked_as_attacker_input(api, kern):  # noqa: ANN001
    def refused(ancestry: list[str]) -> str:
        response = api.post(f"/api/v1/projects/{PROJECT}/commits",
                            data={"sha": "z" * 40, "ancestry": " ".join(ancestry)},
                            files={"archive": ("s.tar.gz", make_archive({"ops.cpp": "//\n"}), "application/gzip")})
        assert response.status_code == 422, response.text
        return response.json()["detail"]

    assert "send at most 200" in refused([f"{i:040x}" for i in range(201)])
    assert "ancestry entry 2 ('" in refused(["a" * 40, "b" * 65])
    assert "is the submitted commit" in refused(["z" * 40])
    assert "listed twice" in refused(["a" * 40, "a" * 40])


# ----------------------------------------------------------------------------- the ack rule
def _maintainer(db_session, project: str | None = PROJECT) -> dict:  # noqa: ANN001
    _, token = auth.create_token(session=db_session, name="maintainer", scope="maintain", project=project)
    return {"Authorization": f"Bearer {token}"}


def test_an_ack_on_a_pr_merge_sha_carries_to_mains_merge_commit_of_the_same_tree(api, db_session, kern):  # noqa: ANN001
    """The PR's merge sha (never lands) is acknowledged; main's merge commit holds the same tree
    against the same base: acknowledged automatically, linking the original. A squash commit whose
    tree differs elsewhere but changes the same cases the same way is too; a different change is not."""
    base = _submit(api, "b" * 40, allow=True)
    _finish(db_session, base, SAME)
    pr_merge = _submit(api, "p" * 40, parents=["b" * 40, "h" * 40], tree="pr")
    _finish(db_session, pr_merge, MOVED)
    assert _run(api, pr_merge)["verdict"]["flagged"] is True
    acked = api.post(f"/api/v1/projects/{PROJECT}/commits/{'p' * 40}/acknowledge",
                     json={"note": "new rounding", "by": "ana"})  # as admin (the maintain scope: below)
    assert acked.status_code == 200, acked.text

    main_merge = _submit(api, "M" * 40, parents=["b" * 40, "h" * 40], tree="pr")
    _finish(db_session, main_merge, MOVED)
    run = _run(api, main_merge)
    verdict = run["verdict"]
    assert (verdict["acknowledged"], verdict["flagged"]) == (True, False)
    assert verdict["acknowledged_via"] == {"run_id": pr_merge, "commit_sha": "p" * 40, "acknowledged_by": "ana",
                                           "note": "new rounding"}
    assert verdict["acknowledgement_note"].startswith(
        f"acknowledged automatically: the same source against the same baseline source as run {pr_merge}")
    assert _exit_code(run) == 0
    from service.cli.report import baseline_lines

    assert f"run {main_merge}: acknowledged automatically, the same change as run {pr_merge} ({'p' * 12}) " \
           "acknowledged by ana: new rounding" in baseline_lines([run])

    squash = _submit(api, "S" * 40, parents=["b" * 40], tree="pr, squashed with a new comment")
    _finish(db_session, squash, MOVED)
    assert _run(api, squash)["verdict"]["acknowledged_via"]["run_id"] == pr_merge

    other = _submit(api, "o" * 40, parents=["b" * 40], tree="another change")
    _finish(db_session, other, {"adam-1": SAME["adam-1"], "adam-2": ["e1", "y2", "y3"]})
    other_verdict = _run(api, other)["verdict"]
    assert (other_verdict["flagged"], other_verdict["acknowledged"], other_verdict["acknowledged_via"]) == \
        (True, False, None)


# ----------------------------------------------------------------------------- the maintain scope
def test_a_maintain_token_can_acknowledge_and_a_submit_token_cannot(api, db_session, kern):  # noqa: ANN001
    base = _submit(api, "b" * 40, allow=True)
    _finish(db_session, base, SAME)
    changed = _submit(api, "c" * 40, parents=["b" * 40], tree="c")
    _finish(db_session, changed, MOVED)
    _, submit_token = auth.create_token(session=db_session, name="ci", scope="submit", project=PROJECT)
    body = {"note": "intended"}

    as_submit = api.post(f"/api/v1/runs/{changed}/acknowledge", json=body,
                         headers={"Authorization": f"Bearer {submit_token}"})
    assert as_submit.status_code == 403 and "needs 'maintain' or 'admin'" in as_submit.json()["detail"]
    other_project = api.post(f"/api/v1/runs/{changed}/acknowledge", json=body,
                             headers=_maintainer(db_session, project="elsewhere"))
    assert other_project.status_code == 403
    as_maintainer = api.post(f"/api/v1/runs/{changed}/acknowledge", json=body, headers=_maintainer(db_session))
    assert as_maintainer.status_code == 200 and as_maintainer.json()["acknowledged"] is True
    # and nothing else of admin's: registering a project stays admin's
    assert api.post("/api/v1/projects", json={"name": "x"}, headers=_maintainer(db_session)).status_code == 403


def test_re_running_the_first_commits_job_with_allow_no_baseline_turns_it_neutral(api, db_session, kern):  # noqa: ANN001
    """The first adoption: the job fails with no-baseline (exit 7); the maintainer sets
    allow-no-baseline and re-runs the job, which submits the same commit under the same
    Idempotency-Key: the answer's run now passes."""
    key = {"Idempotency-Key": f"{PROJECT}:{'f' * 40}:"}
    first = _submit(api, "f" * 40, tree="first", headers=key)
    _finish(db_session, first, SAME)
    assert _exit_code(_run(api, first)) == 7
    again = _submit(api, "f" * 40, tree="first", headers=key, allow=True)
    assert again == first
    run = _run(api, first)
    assert run["verdict"]["no_baseline_allowed"] is True and _exit_code(run) == 0
