"""The watchdog (worker/jobs/watchdog.py) in this process, against the real PostgreSQL: a job thread
stuck in open() on a FIFO (the finding of issue 43: nothing in Python can interrupt it) and a box
process that never ends. The deadline, a cancel: the box's process group is killed from the
watchdog's own thread; a thread that unwinds settles its run, one still stuck is recorded `error`
(here through service.run_store.end_stopped, the worker's own call) and its process ended (here a
recorded call in place of os._exit). With real worker processes: tests/scenarios/test_wedged_worker.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from service import run_store
from service.db.models import Run
from service.domain import projects, runs, submissions
from tests.service_fixtures import make_archive
from worker.jobs.watchdog import CANCEL, DEADLINE, EXIT_WEDGED, JobStopped, Stop, Watchdog

# Timing bounds: TICK_S is 0.1 s and the cancel poll CANCEL_POLL_S 1 s; a loaded shared machine
# (two cores, five engineers) is given a few seconds on top, still far below anything that waits
# for the box (600 s here).
FEW_S = 4.0


def _box() -> subprocess.Popen:
    """A stand-in for a box: a process leading its own group that never ends by itself."""
    return subprocess.Popen(["sleep", "600"], start_new_session=True)


def _stuck_in_open(fifo: Path) -> threading.Thread:
    """A job thread blocked in open() of a FIFO that no writer will open."""
    os.mkfifo(fifo)
    thread = threading.Thread(target=lambda: open(fifo, "rb").close(), daemon=True)  # noqa: SIM115
    thread.start()
    return thread


def _release(fifo: Path, thread: threading.Thread) -> None:
    """The test's own cleanup: a writer opens the FIFO, so the stuck open() returns."""
    descriptor = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    os.close(descriptor)
    thread.join(timeout=5)


@pytest.fixture
def claimed_run(db_session, api_settings) -> Run:  # noqa: ANN001
    project = projects.ensure(session=db_session, name="wedge")
    run = submissions.submit_commit(session=db_session, settings=api_settings, project=project, sha="w",
                                    parents=[], archive=make_archive({"a.cpp": "w"})).runs[0]
    assert runs.claim(session=db_session, run_id=run.id, worker="w1")
    return run


def test_a_job_stuck_in_open_of_a_fifo_is_ended_at_its_deadline_and_its_run_is_error(
        tmp_path: Path, db_session, claimed_run) -> None:  # noqa: ANN001
    box = _box()
    stuck = _stuck_in_open(tmp_path / "planted.fifo")
    exits: list[int] = []
    recorded: list[Stop] = []

    def on_wedged(stop: Stop) -> None:
        recorded.append(stop)
        run_store.end_stopped(claimed_run.id, worker="w1", status="error", error=f"{stop.reason}; wedged",
                              session=db_session)

    started = time.monotonic()
    with Watchdog(label="run under test", grace_s=0.5, on_wedged=on_wedged, exit_process=exits.append) as guard, \
            guard.phase("build", 0.5):
        while not exits and time.monotonic() - started < 0.5 + 0.5 + FEW_S:
            time.sleep(0.05)
    elapsed = time.monotonic() - started
    try:
        assert exits == [EXIT_WEDGED], f"the process was not ended within {elapsed:.1f} s"
        assert box.wait(timeout=FEW_S) == -9  # SIGKILLed with its group, by the watchdog's thread
        assert stuck.is_alive()  # nothing could interrupt the open(): hence the process's end
        assert [stop.cause for stop in recorded] == [DEADLINE]
        db_session.refresh(claimed_run)
        assert claimed_run.status == "error" and claimed_run.finished_at is not None
        assert "build phase passed the watchdog's deadline of 0.5 s" in claimed_run.error
        # The run is final: the task's message, delivered again, finds nothing to claim.
        assert not runs.claim(session=db_session, run_id=claimed_run.id, worker="w2")
    finally:
        box.kill()
        _release(tmp_path / "planted.fifo", stuck)


def test_a_cancel_kills_the_box_and_the_job_that_unwinds_is_not_ended(tmp_path: Path) -> None:
    box = _box()
    asked = threading.Event()
    exits: list[int] = []
    outcome: list[str] = []

    def job(guard: Watchdog) -> None:
        box.wait()  # a build waiting on its box, with a limit of 600 s of its own
        try:
            guard.check()  # what the run job does before it records a failed build
            outcome.append("recorded as the commit's failure")
        except JobStopped as stopped:
            outcome.append(stopped.stop.cause)

    with Watchdog(label="run under test", grace_s=FEW_S, cancelled=asked.is_set, exit_process=exits.append) as guard, \
            guard.phase("build", 600):
        thread = threading.Thread(target=job, args=(guard,))
        thread.start()
        time.sleep(0.3)
        asked.set()
        cancelled_at = time.monotonic()
        thread.join(timeout=1.0 + FEW_S)
        took = time.monotonic() - cancelled_at
    assert outcome == [CANCEL], outcome
    assert took < 1.0 + FEW_S
    assert box.returncode == -9
    assert exits == []  # the job unwound within its grace: the process goes on


def test_a_job_that_ends_before_its_deadline_is_left_alone(tmp_path: Path) -> None:
    box = _box()
    exits: list[int] = []
    try:
        with Watchdog(label="run under test", grace_s=0.2, exit_process=exits.append) as guard, \
                guard.phase("kernel host", 0.5):
            time.sleep(0.2)
        time.sleep(0.6)  # past the deadline the phase had: disarmed, nothing happens
        assert guard.stop is None and exits == [] and box.poll() is None
    finally:
        box.kill()
        box.wait()


def test_pool_processes_are_found_when_the_kernel_refuses_their_executable(monkeypatch) -> None:
    """A worker that dropped root (saved uid 0) may not read its children's /proc/<pid>/exe: the
    SIGTERM relay must still find its forked pool processes, and still leave other children alone."""
    import subprocess
    import time

    from worker import tasks

    pid = os.fork()
    if pid == 0:  # a pool process: forked without exec, this Python's command line
        time.sleep(30)
        os._exit(0)
    other = subprocess.Popen(["sleep", "30"])
    real_readlink = os.readlink

    def refused(path, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if str(path).endswith("/exe") and not str(path).startswith("/proc/self"):
            raise PermissionError(13, "Permission denied", path)
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(tasks.os, "readlink", refused)
    try:
        found = tasks._pool_processes()
        assert pid in found and other.pid not in found
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        other.kill()
        other.wait()
