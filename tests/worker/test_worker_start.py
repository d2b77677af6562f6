"""A worker builds optdrift's own harness library before it takes a run (worker/tasks.py
_build_harness_before_runs): a fresh worker's first run must not pay for that build out of its
budget (issue 18; CI once saw a verify run stopped at its 40 s budget while the harness built).

A real `optdrift worker` on the embedded default (SQLite and the filesystem broker in a fresh
OPTDRIFT_HOME); the harness cache is the machine's shared one (a cache hit once any test built it),
or one that cannot be made, for the failure path.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.service_fixtures import start_process, stop_process

pytestmark = pytest.mark.slow


def _log_until_ready(env: dict[str, str], log_path: Path, timeout_s: float = 300.0) -> str:
    """The worker's log up to Celery's "ready." line (the handler runs before it)."""
    worker = start_process(["worker", "--pool", "solo", "--name", "harnesscheck"], env, log_path)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = log_path.read_text(errors="replace")
            if " ready." in text:
                return text
            assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{text[-3000:]}"
            time.sleep(0.3)
        raise AssertionError(f"the worker was not ready within {timeout_s:g} s:\n{log_path.read_text()[-3000:]}")
    finally:
        stop_process(worker)


def test_the_harness_is_built_before_the_worker_is_ready(tmp_path: Path) -> None:
    text = _log_until_ready({"OPTDRIFT_HOME": str(tmp_path / "home")}, tmp_path / "worker.log")
    built = [line for line in text.splitlines() if "harness library for cpu ready in" in line]
    assert built, f"no line says the harness library was built:\n{text[-3000:]}"
    assert text.index(built[0]) < text.index(" ready."), "the harness was built after the worker took runs"
    library = Path(built[0].rsplit(": ", 1)[1])
    assert library.is_file() and library.suffix == ".so", built[0]


def test_a_harness_that_cannot_be_built_is_logged_and_the_worker_still_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the harness cache would be made\n")
    text = _log_until_ready({"OPTDRIFT_HOME": str(tmp_path / "home"), "OPTDRIFT_HARNESS_CACHE": str(blocker / "harness")},
                            tmp_path / "worker.log")
    assert "the harness library for cpu did not build; runs use the engine's Python paths" in text, text[-3000:]
    assert "cannot be built" in text, "the reason (the cache folder cannot be made) is not in the log"
