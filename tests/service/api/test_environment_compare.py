"""One commit in two environments (service/domain/environment_compare.py, GET
/api/v1/projects/{p}/environment-comparison, `optdrift compare`): B judged against A case by
case, what differs between the fingerprints named, bad requests answered with what to do.

Runs are rows with cases stored as a worker stores them (service.domain.trajectories), on the
real PostgreSQL in the test's rolled-back transaction."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from service.cli import app as cli_app
from service.core.results import CaseResult, CaseSpec, EnvironmentFingerprint, Trajectory
from service.db.models import DONE, RUNNING, Commit, Project, Run, SourceArchive
from service.domain import trajectories

SOURCE = "e" * 64
SHA = "c" * 40


def _fingerprint(**changes) -> dict:  # noqa: ANN003
    base = dict(device_kind="cpu", device_name="x86_64", cpu_capability="AVX2", torch_version="2.13.0",
                python_version="3.11.2", platform="Linux", class_key="cpu-avx2")
    return EnvironmentFingerprint(**{**base, **changes}).model_dump(mode="json")


def _case(case_id: str, digests: list[str], distances: list[float]) -> CaseResult:
    spec = CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1}, seed=0, size=8,
                    steps=len(digests))
    return CaseResult(case=spec, status="ok", trajectory=Trajectory(
        ref64_max_abs=distances, ref64_max_rel=distances, nonfinite_count=[0] * len(digests),
        digests=[f"od2:{d}" for d in digests]))


def _project_with_runs(session, *, b_status: str = DONE, release: str | None = None) -> Project:  # noqa: ANN001
    project = Project(name="envs", environments=["cpu", "cpu-clang", "gpu.sm90"])
    session.add(project)
    if session.get(SourceArchive, SOURCE) is None:
        session.add(SourceArchive(digest=SOURCE, size_bytes=1, member_count=1))
    session.flush()
    commit = Commit(project_id=project.id, sha=SHA, parents=[], source_digest=SOURCE, release_tag=release)
    session.add(commit)
    session.flush()
    sides = {
        # A: the reference build. B: another toolchain; the same first case, the second moved from
        # step 2 and farther from float64 at every step after it.
        "cpu": ([_case("adam-same", ["a", "b", "c"], [1e-7, 2e-7, 3e-7]),
                 _case("adam-moved", ["d", "e", "f"], [1e-7, 2e-7, 3e-7])], _fingerprint(), "d" * 64),
        "cpu-clang": ([_case("adam-same", ["a", "b", "c"], [1e-7, 2e-7, 3e-7]),
                       _case("adam-moved", ["d", "x", "y"], [1e-7, 9e-7, 2e-6])],
                      _fingerprint(torch_version="2.14.0"), "f" * 64),
    }
    for environment, (cases, fingerprint, build) in sides.items():
        run = Run(project_id=project.id, commit_id=commit.id, source_digest=SOURCE, battery="quick",
                  battery_hash="b" * 64, environment=environment, build_digest=build,
                  status=DONE if environment == "cpu" else b_status,
                  environment_detail={"fingerprint": fingerprint, "battery_version": 1})
        session.add(run)
        session.flush()
        trajectories.store_case_results(session=session, run_id=run.id, results=list(enumerate(cases)))
    session.flush()
    return project


def test_b_is_judged_against_a_case_by_case_with_what_differs_named(api, db_session) -> None:  # noqa: ANN001
    _project_with_runs(db_session)
    answer = api.get("/api/v1/projects/envs/environment-comparison",
                     params={"commit": SHA[:10], "a": "cpu", "b": "cpu-clang"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert (body["a"]["environment"], body["b"]["environment"], body["battery"]) == ("cpu", "cpu-clang", "quick")
    assert body["fingerprint_changes"] == [{"field": "torch_version", "a": "2.13.0", "b": "2.14.0"}]
    assert body["same_build"] is False
    cases = {case["case_id"]: case for case in body["comparison"]["cases"]}
    assert body["comparison"]["verdict"] == "changed"
    assert cases["adam-same"]["verdict"] == "unchanged"
    moved = cases["adam-moved"]
    assert (moved["verdict"], moved["first_divergent_step"], moved["direction"]) == ("changed", 2, "farther")
    # The other way round the same change reads closer: A is judged against B.
    reverse = api.get("/api/v1/projects/envs/environment-comparison",
                      params={"commit": SHA, "a": "cpu-clang", "b": "cpu"}).json()
    assert {c["case_id"]: c["direction"] for c in reverse["comparison"]["cases"]}["adam-moved"] == "closer"


def test_requests_that_cannot_be_answered_say_what_to_do(api, db_session) -> None:  # noqa: ANN001
    _project_with_runs(db_session, b_status=RUNNING)
    url = "/api/v1/projects/envs/environment-comparison"
    not_done = api.get(url, params={"commit": SHA, "a": "cpu", "b": "cpu-clang"})
    assert not_done.status_code == 409 and "compare once it is done" in not_done.text
    no_run = api.get(url, params={"commit": SHA, "a": "cpu", "b": "gpu.sm90"})
    assert no_run.status_code == 404 and "optdrift submit --environment gpu.sm90" in no_run.text
    unregistered = api.get(url, params={"commit": SHA, "a": "cpu", "b": "tpu"})
    assert unregistered.status_code == 422 and "use one of cpu, cpu-clang, gpu.sm90" in unregistered.text
    same = api.get(url, params={"commit": SHA, "a": "cpu", "b": "cpu"})
    assert same.status_code == 422 and "two different environments" in same.text
    unknown = api.get(url, params={"commit": "f" * 40, "a": "cpu", "b": "cpu-clang"})
    assert unknown.status_code == 404


def test_the_compare_command_prints_and_exits_like_submit(live_api, db_session) -> None:  # noqa: ANN001
    _project_with_runs(db_session)
    runner = CliRunner()
    args = ["compare", "--project", "envs", "--commit", SHA, "--env", "cpu", "--env", "cpu-clang", "--url", live_api]
    text = runner.invoke(cli_app, args)
    assert text.exit_code == 1, text.output  # changed, as submit's exit code says
    assert "environments differ in: torch_version 2.13.0 → 2.14.0" in text.output
    assert "adam-moved" in text.output and "adam-same" not in text.output
    as_json = runner.invoke(cli_app, [*args, "--format", "json"])
    assert as_json.exit_code == 1 and json.loads(as_json.output)["comparison"]["verdict"] == "changed"
    one = runner.invoke(cli_app, ["compare", "--project", "envs", "--commit", SHA, "--env", "cpu", "--url", live_api])
    assert one.exit_code == 2 and "give exactly two environments" in one.output


def test_the_environment_matrix_shows_each_release_against_the_reference(api, db_session) -> None:  # noqa: ANN001
    _project_with_runs(db_session, release="v1.0")
    matrix = api.get("/api/v1/projects/envs/environment-matrix").json()
    assert (matrix["reference"], matrix["environments"]) == ("cpu", ["cpu-clang", "gpu.sm90"])
    (row,) = matrix["rows"]
    cells = {cell["environment"]: cell for cell in row["cells"]}
    assert row["release"] == "v1.0"
    assert {k: cells["cpu-clang"][k] for k in ("state", "changed", "first_step", "farther", "closer", "same",
                                                "not_judged")} == {
        "state": "changed", "changed": 1, "first_step": 2, "farther": 1, "closer": 0, "same": 0, "not_judged": 0}
    assert cells["gpu.sm90"]["state"] == "missing" and "no run in environment 'gpu.sm90'" in cells["gpu.sm90"]["note"]
    # Judged against another reference, the same change reads closer.
    other = api.get("/api/v1/projects/envs/environment-matrix", params={"reference": "cpu-clang"}).json()
    assert {c["environment"]: c["closer"] for c in other["rows"][0]["cells"]}["cpu"] == 1
    page = api.get("/projects/envs/environments").text
    assert 'data-environment="cpu-clang" data-state="changed"' in page and "from step 2" in page
    # The four counts add up to the changed cases (issue 47).
    assert "1 farther · 0 closer · 0 same · 0 not judged" in page and 'data-state="missing"' in page
    assert api.get("/api/v1/projects/envs/environment-matrix", params={"reference": "tpu"}).status_code == 422
