"""Run by tests/project/test_upgrade_from_0_1_0.py with the PREVIOUS release's tree first on
PYTHONPATH (never imported by this tree): makes a database the way that release's code made it —
its own migrations, its own domain and run_store functions, its own API for the acknowledgement —
then reads it back through that release's API and dumps every table, so the test can compare what
the new release serves with what the old one served.

    python previous_release_writer.py OUT.json

The environment names the database (OPTDRIFT_DATABASE_URL), the home with the source archives
(OPTDRIFT_HOME) and the broker (OPTDRIFT_BROKER_URL, never used: nothing is dispatched).
"""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile

PROJECT = "upgrade"
BASE_SHA, CHANGED_SHA = "a" * 40, "b" * 40
STEPS = 4


def archive(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def case_results(changed: bool) -> list:
    from service.core.results import CaseResult, CaseSpec, Trajectory

    results = []
    for index, (optimizer, hyper) in enumerate([("adam", {"lr": 0.1, "weight_decay": 0.1}),
                                                ("lion", {"lr": 0.01})]):
        digests = [f"{index}{step:x}" * 8 for step in range(STEPS)]
        if changed and index == 0:  # the first case's trajectory moves from its third step
            digests[2:] = [digest[::-1] + "f" for digest in digests[2:]]
        case = CaseSpec(case_id=f"{optimizer}-case", optimizer=optimizer, hyper=hyper, seed=index, size=64,
                        steps=STEPS)
        trajectory = Trajectory(ref64_max_abs=[0.25 * (step + 1) + index for step in range(STEPS)],
                                ref64_max_rel=[1e-7 * (step + 1) for step in range(STEPS)],
                                nonfinite_count=[0] * STEPS, digests=digests)
        results.append((index, CaseResult(case=case, status="ok", trajectory=trajectory)))
    return results


def run_commit(session, settings, project, sha: str, parents: list[str], changed: bool) -> int:  # noqa: ANN001
    from service import run_store
    from service.domain import submissions

    submission = submissions.submit_commit(session=session, settings=settings, project=project, sha=sha,
                                           parents=parents, archive=archive({"kernel.cpp": f"// {sha}\n"}),
                                           message=f"commit {sha[:7]}", ref="main")
    session.commit()
    run_id = submission.runs[0].id
    assert run_store.claim(run_id, worker="old-worker", session=session)
    claimed = run_store.ClaimedRun(session, run_id=run_id, worker="old-worker")
    assert claimed.record(build_digest=("c" if changed else "d") * 64, build_cached=False,
                          environment_detail={"build_ok": True})
    results = case_results(changed)
    claimed.start_cases(len(results))
    claimed.store_batch(results, cases_done=len(results))
    claimed.finish({"adapter": "bundled", "torch": "old"})
    session.commit()
    run_store.judge(run_id, worker="old-worker", settings=settings, session=session)
    session.commit()
    return run_id


def main(out_path: str) -> None:
    import service
    from fastapi.testclient import TestClient
    from sqlalchemy import create_engine, text
    from sqlalchemy.orm import Session

    from service.api.main import create_app
    from service.db.migrate import MIGRATIONS_DIR, upgrade_to_head
    from service.domain import auth, projects
    from service.settings import Settings

    url = os.environ["OPTDRIFT_DATABASE_URL"]
    settings = Settings(maintenance_interval_s=0)
    upgrade_to_head(url)
    engine = create_engine(url)
    with Session(engine, expire_on_commit=False) as session:
        project = projects.ensure(session=session, name=PROJECT)
        _, admin = auth.create_token(session=session, name="old-admin", scope="admin")
        _, submit = auth.create_token(session=session, name="old-ci", scope="submit", project=PROJECT)
        session.commit()
        base_run = run_commit(session, settings, project, BASE_SHA, [], changed=False)
        changed_run = run_commit(session, settings, project, CHANGED_SHA, [BASE_SHA], changed=True)
        source_digests = [row[0] for row in session.execute(
            text("SELECT source_digest FROM runs ORDER BY id"))]

    # What the old API answered, acknowledgement included (written by the old API itself).
    answers: dict[str, object] = {}
    with TestClient(create_app(), headers={"Authorization": f"Bearer {admin}"}) as client:
        acked = client.post(f"/api/v1/runs/{changed_run}/acknowledge",
                            json={"note": "the reorder was meant", "by": "maintainer"})
        assert acked.status_code == 200, acked.text
        for path in read_paths([base_run, changed_run], ["adam-case", "lion-case"]):
            answer = client.get(path)
            assert answer.status_code == 200, (path, answer.status_code, answer.text)
            answers[path] = answer.json() if "json" in answer.headers.get("content-type", "") else answer.text
        for digest in source_digests:
            answers[f"/api/v1/sources/{digest}"] = client.get(f"/api/v1/sources/{digest}").content.hex()

    with engine.connect() as connection:
        tables = [row[0] for row in connection.execute(text(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1"))]
        dump = {table: [dict(row._mapping) for row in connection.execute(text(f'SELECT * FROM "{table}" ORDER BY 1'))]
                for table in tables}
    engine.dispose()
    with open(out_path, "w") as out:
        json.dump({"code": service.__file__, "migrations": str(MIGRATIONS_DIR), "admin_token": admin,
                   "submit_token": submit, "runs": [base_run, changed_run], "answers": answers, "tables": dump},
                  out, default=str, indent=1)


def read_paths(run_ids: list[int], case_ids: list[str]) -> list[str]:
    """The reads both releases serve: runs, their trajectories (JSON, CSV, one case), the commits and
    their verdicts, the project's verdicts."""
    paths = [f"/api/v1/projects/{PROJECT}", f"/api/v1/projects/{PROJECT}/commits",
             f"/api/v1/projects/{PROJECT}/verdicts"]
    for sha in (BASE_SHA, CHANGED_SHA):
        paths += [f"/api/v1/projects/{PROJECT}/commits/{sha}", f"/api/v1/projects/{PROJECT}/commits/{sha}/verdicts"]
    for run_id in run_ids:
        paths += [f"/api/v1/runs/{run_id}", f"/api/v1/runs/{run_id}/trajectories",
                  f"/api/v1/runs/{run_id}/trajectories.csv"]
        paths += [f"/api/v1/runs/{run_id}/trajectories/{case_id}" for case_id in case_ids]
    return paths


if __name__ == "__main__":
    main(sys.argv[1])
