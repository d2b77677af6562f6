"""A build variant's changed cases, attributed (service/domain/environment_attribution.py): when a
commit's run in `cpu+fma` and in `cpu` are both done and differ, one queued attribution opens for
the pair (none for identical digests, one whichever run finishes last); once the worker stores it,
the environment comparison (API, CLI, dashboard matrix) carries per case max |B − A|, `max_ulps`
and the looks-like label naming the flag.

Runs are rows with cases stored as a worker stores them, and the worker's stored detail is written
as worker/jobs/environment_attribution.py writes it, through service.run_store, on the real
PostgreSQL in the test's rolled-back transaction. The co-run itself (real builds, real worker) is
tests/scenarios/test_environment_attribution.py."""

from __future__ import annotations

from typer.testing import CliRunner

from service import run_store
from service.cli import app as cli_app
from service.core.results import CaseResult, CaseSpec, Trajectory
from service.db.environment_models import EnvironmentAttribution
from service.db.models import DONE, Commit, Project, Run, SourceArchive
from service.domain import environment_attribution, trajectories

SOURCE = "a" * 64
SHA = "d" * 40
URL = "/api/v1/projects/variants/environment-comparison"
GCC = {"cxx": "/usr/bin/g++-12", "cxx_version": "g++ (Debian 12.2.0-14) 12.2.0", "nvcc": None, "nvcc_version": None}


def _case(case_id: str, digests: list[str]) -> CaseResult:
    spec = CaseSpec(case_id=case_id, optimizer="adam", hyper={"lr": 0.1, "weight_decay": 0.1}, seed=0, size=8,
                    steps=len(digests))
    return CaseResult(case=spec, status="ok", trajectory=Trajectory(
        ref64_max_abs=[1e-7] * len(digests), ref64_max_rel=[1e-7] * len(digests),
        nonfinite_count=[0] * len(digests), digests=[f"od2:{d}" for d in digests]))


# cpu+nocontract: the same digests as cpu; cpu+fma: the second case differs from step 1.
DIGESTS = {"cpu": (["a", "b", "c"], ["d", "e", "f"]), "cpu+nocontract": (["a", "b", "c"], ["d", "e", "f"]),
           "cpu+fma": (["a", "b", "c"], ["x", "y", "z"])}
VARIANTS = {"cpu": None, "cpu+nocontract": ["-ffp-contract=off"], "cpu+fma": ["-mfma"]}


def _project(session, environments: list[str]) -> tuple[Project, dict[str, Run]]:  # noqa: ANN001
    """The project and its commit's finished runs in `environments`, in that order."""
    project = Project(name="variants", environments=["cpu", "cpu+nocontract", "cpu+fma"])
    session.add(project)
    if session.get(SourceArchive, SOURCE) is None:
        session.add(SourceArchive(digest=SOURCE, size_bytes=1, member_count=1))
    session.flush()
    commit = Commit(project_id=project.id, sha=SHA, parents=[], source_digest=SOURCE, release_tag="v1")
    session.add(commit)
    session.flush()
    return project, {environment: _add_run(session, project, commit.id, environment) for environment in environments}


def _add_run(session, project: Project, commit_id: int, environment: str) -> Run:  # noqa: ANN001
    """A done run as a worker leaves it: its cases, its toolchain and variant in the environment detail."""
    flags = VARIANTS[environment]
    run = Run(project_id=project.id, commit_id=commit_id, source_digest=SOURCE, battery="quick",
              battery_hash="b" * 64, environment=environment, build_digest=environment.ljust(64, "0")[:64],
              status=DONE, environment_detail={
                  "battery_version": 1, "toolchain": GCC, "build_flags": {"cflags": ["-O3"], "cuda_cflags": []},
                  "build_variant": None if flags is None else {"compiler": None, "cflags": flags,
                                                               "cuda_cflags": [], "cuda_archs": None}})
    session.add(run)
    session.flush()
    first, second = DIGESTS[environment]
    trajectories.store_case_results(session=session, run_id=run.id,
                                    results=[(0, _case("adam-same", first)), (1, _case("adam-moved", second))])
    session.flush()
    return run


def test_identical_digests_open_nothing_and_a_difference_opens_one_pair_whichever_finishes_last(db_session) -> None:  # noqa: ANN001
    project, runs = _project(db_session, ["cpu+nocontract", "cpu+fma"])
    # The variants finish first: no base run yet, nothing to pair with.
    assert environment_attribution.open_for(session=db_session, run=runs["cpu+fma"]) == []
    base = _add_run(db_session, project, runs["cpu+fma"].commit_id, "cpu")
    opened = run_store.open_environment_attributions(base.id, session=db_session)
    (row,) = [db_session.get(EnvironmentAttribution, attribution_id) for attribution_id, _ in opened]
    # The base environment is A whichever finished last; the queue is the variant's.
    assert (row.run_a_id, row.run_b_id, row.status, row.changed_cases) == (base.id, runs["cpu+fma"].id, "queued", 1)
    assert opened == [(row.id, "cpu+fma")]
    # The other run's worker, a moment later, opens nothing more; nor does the identical variant.
    assert run_store.open_environment_attributions(runs["cpu+fma"].id, session=db_session) == []
    assert run_store.open_environment_attributions(runs["cpu+nocontract"].id, session=db_session) == []
    assert run_store.claim_environment_attribution(row.id, worker="w1", session=db_session) is True
    assert run_store.claim_environment_attribution(row.id, worker="w2", session=db_session) is False
    # w1 died: once the row has been running longer than the broker's visibility timeout, the
    # redelivered task may claim it again; before that it may not.
    assert run_store.claim_environment_attribution(row.id, worker="w2", stale_after_s=3600, session=db_session) is False
    assert run_store.claim_environment_attribution(row.id, worker="w2", stale_after_s=0, session=db_session) is True
    db_session.refresh(row)
    assert (row.status, row.worker) == ("running", "w2")


STORED = {  # what worker/jobs/environment_attribution.py stores for the moved case
    "cases": {"adam-moved": {
        "first_divergent_step": 1, "max_abs_diff_per_step": [5.9e-8, 1.2e-7, 1.8e-7],
        "attribution": {"class": "rounding-level", "variant": None, "first_divergent_step": 1,
                        "first_step_ulps": 1.0, "peak_ulps": 3.0, "ulps_per_step": [1.0, 2.0, 3.0]}}},
    "attribution_error": None, "worker": "w1", "phases": {}, "kernels": {}, "seconds": 1.0}


def test_the_comparison_carries_max_ulps_and_the_label_once_stored(api, db_session) -> None:  # noqa: ANN001
    _, runs = _project(db_session, ["cpu", "cpu+nocontract", "cpu+fma"])
    params = {"commit": SHA, "a": "cpu", "b": "cpu+fma"}
    before = api.get(URL, params=params).json()
    assert (before["attribution_status"], before["comparison"]["verdict"]) == ("expected", "changed")
    same = api.get(URL, params={**params, "b": "cpu+nocontract"}).json()
    assert same["attribution_status"] == "none" and "no trajectory differs" in same["attribution_note"]

    ((attribution_id, _),) = run_store.open_environment_attributions(runs["cpu+fma"].id, session=db_session)
    assert api.get(URL, params=params).json()["attribution_status"] == "queued"
    run_store.finish_environment_attribution(attribution_id, detail=STORED, session=db_session)

    body = api.get(URL, params=params).json()
    assert body["attribution_status"] == "done"
    cases = {case["case_id"]: case for case in body["comparison"]["cases"]}
    moved = cases["adam-moved"]
    assert (moved["verdict"], moved["first_divergent_step"], moved["max_ulps"]) == ("changed", 1, 3.0)
    assert moved["max_abs_diff_per_step"] == [5.9e-8, 1.2e-7, 1.8e-7]
    assert moved["attribution"]["class"] == "rounding-level"
    assert moved["attribution"]["looks_like"] == "fma-contraction"
    assert moved["attribution"]["label"].startswith("looks like FMA contraction: rounding-level, 1.000e+00 ulp at step 1")
    assert "cpu+fma builds with -mfma, cpu without" in moved["attribution"]["label"]
    assert moved["attribution"]["evidence"]["flags"] == ["-mfma"]
    assert cases["adam-same"]["attribution"] is None and cases["adam-same"]["max_ulps"] is None
    # Asked the other way round, the same row, the flag named as A's.
    reverse = api.get(URL, params={**params, "a": "cpu+fma", "b": "cpu"}).json()
    (back,) = [c for c in reverse["comparison"]["cases"] if c["case_id"] == "adam-moved"]
    assert "cpu+fma builds with -mfma, cpu without" in back["attribution"]["label"]

    # The dashboard's environments page and its matrix: the headline with the flag it rests on.
    cells = {c["environment"]: c for c in api.get("/api/v1/projects/variants/environment-matrix").json()["rows"][0]["cells"]}
    assert cells["cpu+fma"]["looks_like"] == "looks like FMA contraction, -mfma (1)"
    assert cells["cpu+nocontract"]["looks_like"] is None and cells["cpu+nocontract"]["state"] == "unchanged"
    page = api.get("/projects/variants/environments").text
    assert "looks like FMA contraction, -mfma (1)" in page


def test_the_compare_command_shows_the_label_and_what_is_still_coming(live_api, db_session) -> None:  # noqa: ANN001
    _, runs = _project(db_session, ["cpu", "cpu+fma"])
    args = ["compare", "--project", "variants", "--commit", SHA, "--env", "cpu", "--env", "cpu+fma", "--url", live_api]
    runner = CliRunner(env={"COLUMNS": "400"})  # one line per row: the label is matched whole
    coming = runner.invoke(cli_app, args)
    assert coming.exit_code == 1 and "attribution expected" in coming.output, coming.output
    ((attribution_id, _),) = run_store.open_environment_attributions(runs["cpu+fma"].id, session=db_session)
    run_store.finish_environment_attribution(attribution_id, detail=STORED, session=db_session)
    done = runner.invoke(cli_app, args)
    assert done.exit_code == 1, done.output
    assert "looks like FMA contraction: rounding-level" in done.output and "-mfma" in done.output
    assert "attribution: looks like FMA contraction, -mfma (1)" in done.output
