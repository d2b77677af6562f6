"""Issue 47: a run's build progress is stored on the run while it builds, for its page. The build
log's lines go through the real watcher and parser (worker.build.progress) into the real store
(service.run_store.build_progress, PostgreSQL), as worker/jobs/run.py wires them; at most one
write a second (Pacer)."""

from __future__ import annotations

import threading
from pathlib import Path

from service import run_store
from service.db.models import Run
from service.domain.runs import BUILD_PROGRESS_KEY, build_progress_of
from tests.notify_rows import make_commit, make_project, make_run
from worker.build.progress import BuildStep, LogProgress, Pacer, listening, watching

WORKER = "w@build-progress"


def _building_run(session) -> Run:  # noqa: ANN001
    run = make_run(session, make_commit(session, make_project(session), "b1d"), status="building")
    run.worker = WORKER
    run.environment_detail = {"battery": "quick"}  # what the run held before: kept beside the progress
    session.flush()
    return run


def test_the_pacer_hands_on_the_newest_step_at_most_once_a_second() -> None:
    pacer = Pacer(1.0)
    a, b, c = BuildStep(1, 40, "compiling a.cpp"), BuildStep(2, 40, "compiling b.cpp"), BuildStep(3, 40, "x")
    assert pacer.due(None, 0.0) is None
    assert pacer.due(a, 0.0) == a
    assert pacer.due(a, 5.0) is None          # nothing new
    assert pacer.due(b, 0.4) is None          # new, but within the second: held back ...
    assert pacer.due(b, 0.9) is None
    assert pacer.due(b, 1.0) == b             # ... and handed on at the first poll after it
    assert pacer.due(c, 1.5) is None and pacer.due(c, 2.1) == c
    # Without an interval (`optdrift check`'s own pacing): every new step.
    unpaced = Pacer(0.0)
    assert [unpaced.due(step, 0.0) for step in (a, a, b)] == [a, None, b]


def test_what_a_step_stores_is_numbers_only() -> None:
    progress = LogProgress()
    assert progress.feed("[12/40] c++ -O3 -c /box/src/<b>adam</b>.cpp -o adam.o\n").counts() == \
        {"done": 12, "total": 40, "unit": "units"}
    assert progress.feed("[ 45%] Building CXX object x.cpp.o\n").counts() == {"done": 45, "total": 100,
                                                                             "unit": "percent"}
    assert progress.feed("/usr/bin/g++ -O2 -c src/a.cpp -o a.o\n").counts() == {"done": 1, "total": None,
                                                                                "unit": "units"}
    assert progress.feed("$ cmake --build build\n").counts() == {"done": None, "total": None, "unit": "units"}


def test_the_log_read_as_it_grows_is_stored_on_the_building_run(tmp_path: Path, db_session) -> None:  # noqa: ANN001
    run = _building_run(db_session)
    stored = threading.Event()
    seen: list[dict] = []

    def store(step: BuildStep) -> None:  # as worker/jobs/run.py passes it, in the test's transaction
        assert run_store.build_progress(run.id, worker=WORKER, session=db_session, **step.counts())
        seen.append(step.counts())
        if step.done == 12:
            stored.set()

    log = tmp_path / "build.log"
    log.write_text("")
    with listening(store, every_s=1.0), watching(log):
        with log.open("a") as out:
            out.write("ninja: Entering directory `/box/build'\n")
            out.write("".join(f"[{n}/40] c++ -O3 -c /box/src/k{n}.cpp -o k{n}.o\n" for n in range(1, 13)))
        # The watcher polls every half second; one write of the newest step is due within it.
        assert stored.wait(timeout=15.0), seen
    assert seen[-1] == {"done": 12, "total": 40, "unit": "units"}
    assert len(seen) == 1  # the twelve lines arrived together: one write, of the newest step
    db_session.expire_all()
    row = db_session.get(Run, run.id)
    assert row.environment_detail == {"battery": "quick", BUILD_PROGRESS_KEY: {
        "phase": "building", "done": 12, "total": 40, "unit": "units"}}
    assert build_progress_of(row) == row.environment_detail[BUILD_PROGRESS_KEY]


def test_nothing_is_stored_once_the_run_is_not_building_or_not_this_workers(db_session) -> None:  # noqa: ANN001
    run = _building_run(db_session)
    assert not run_store.build_progress(run.id, worker="another", done=1, total=2, unit="units", session=db_session)
    run.status = "running"
    db_session.flush()
    assert not run_store.build_progress(run.id, worker=WORKER, done=1, total=2, unit="units", session=db_session)
    db_session.expire_all()
    row = db_session.get(Run, run.id)
    assert row.environment_detail == {"battery": "quick"}
    # A key left by a build that was stopped says nothing once the run is past building.
    row.environment_detail = {BUILD_PROGRESS_KEY: {"phase": "building", "done": 1, "total": 2, "unit": "units"}}
    assert build_progress_of(row) is None


def test_a_run_row_locked_elsewhere_is_skipped_not_waited_for(pg_engine) -> None:  # noqa: ANN001
    """The watcher's write never waits on the run's row (the job's own transaction may hold it):
    it is skipped, and the next step writes. Committed rows (another connection must see them),
    deleted at the end."""
    import time

    from sqlalchemy import delete, select, text
    from sqlalchemy.orm import Session

    from service.db.models import Commit, Project, SourceArchive

    digest = f"{time.time_ns():064x}"[-64:]  # rows of this test's own, however many tests run beside it
    with Session(pg_engine) as setup:
        setup.add(SourceArchive(digest=digest, size_bytes=1, member_count=1))
        project = Project(name=f"build-progress-{digest[-12:]}", environments=["cpu"])
        setup.add(project)
        setup.flush()
        commit = Commit(project_id=project.id, sha=digest[:12], parents=[], ref="main", source_digest=digest)
        setup.add(commit)
        setup.flush()
        run = Run(project_id=project.id, commit_id=commit.id, source_digest=digest, battery="quick",
                  environment="cpu", status="building", attempt=1, worker=WORKER)
        setup.add(run)
        setup.commit()
        run_id, project_id = run.id, project.id
    try:
        with Session(pg_engine) as holder, Session(pg_engine) as watcher:
            holder.scalar(select(Run).where(Run.id == run_id).with_for_update())  # the row is held
            # A write that waited would fail here after 5 s instead of hanging the test.
            watcher.execute(text("SET lock_timeout = '5s'"))
            began = time.monotonic()
            assert not run_store.build_progress(run_id, worker=WORKER, done=1, total=4, unit="units",
                                                session=watcher)
            assert time.monotonic() - began < 2.0  # skipped at once (a wait would last until the holder ends)
            holder.commit()
            assert run_store.build_progress(run_id, worker=WORKER, done=2, total=4, unit="units", session=watcher)
        with Session(pg_engine) as check:
            assert check.get(Run, run_id).environment_detail[BUILD_PROGRESS_KEY]["done"] == 2
    finally:
        with Session(pg_engine) as cleanup:
            cleanup.execute(delete(Project).where(Project.id == project_id))  # its commit and run cascade
            cleanup.execute(delete(SourceArchive).where(SourceArchive.digest == digest))
            cleanup.commit()
