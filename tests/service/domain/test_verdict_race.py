"""Two workers judge one run at the same moment (issue 19): a run and its baseline finish together
on two workers, and both evaluate the child. One verdict is stored; the second worker keeps it
instead of failing its task on the unique key (tests/scenarios/test_scale_out_cpu.py met this for real).
Real PostgreSQL, a database of its own, two sessions in two threads."""

from __future__ import annotations

import os
import threading

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.migrate import upgrade_to_head
from service.db.models import Run, Verdict
from service.db.session import make_engine
from service.domain import projects, runs, submissions, trajectories, verdict_store
from service.settings import Settings
from tests.service_fixtures import create_database, drop_database, make_archive
from tests.service.domain.test_db_runs import _result


def test_a_verdict_judged_by_two_workers_at_once_is_stored_once(tmp_path) -> None:
    name = f"optdrift_race_{os.getpid()}"
    url = create_database(name)
    engine = make_engine(url)
    try:
        upgrade_to_head(url)
        settings = Settings(home=tmp_path, database_url=url)
        with Session(engine) as session:
            project = projects.ensure(session=session, name="p")
            ids = []
            for sha, parents, digest in (("a", [], "0" * 32), ("b", ["a"], "1" * 32)):
                run = submissions.submit_commit(session=session, settings=settings, project=project, sha=sha,
                                                parents=parents, archive=make_archive({"a.cpp": sha})).runs[0]
                assert runs.claim(session=session, run_id=run.id, worker="w")
                trajectories.store_case_result(session=session, run_id=run.id, case_index=0,
                                               result=_result([digest] * 3, last_nonfinite=0))
                runs.set_status(session=session, run_id=run.id, worker="w", status="done", battery_hash="h")
                ids.append(run.id)
            session.commit()
        child = ids[1]

        first, second = Session(engine), Session(engine)
        # The first worker has written the child's verdict but not committed it yet...
        held = verdict_store.evaluate(session=first, run=first.get(Run, child))
        assert held is not None and held.outcome == "changed"
        answer: dict = {}

        def second_worker() -> None:
            # ...when the second judges it too: its insert waits on the first's, then meets the key.
            try:
                answer["verdict"] = verdict_store.evaluate_with_dependants(session=second, run=second.get(Run, child))
            except Exception as error:  # noqa: BLE001 - the assertion below names it
                answer["error"] = error

        thread = threading.Thread(target=second_worker)
        thread.start()
        thread.join(timeout=1.0)
        assert thread.is_alive(), "the second insert should wait for the first transaction"
        first.commit()
        thread.join(timeout=30)
        assert "error" not in answer, f"the second worker failed: {answer.get('error')!r}"
        assert answer["verdict"].id == held.id and answer["verdict"].outcome == "changed"
        with Session(engine) as session:
            assert session.scalar(select(func.count()).select_from(Verdict).where(Verdict.run_id == child)) == 1
        first.close()
        second.close()
    finally:
        engine.dispose()
        drop_database(name)
