"""Issue 47: `optdrift check` and the service's workers share one build cache for the same
OPTDRIFT_HOME, named by one variable (OPTDRIFT_BUILD_CACHE_DIR); the older OPTDRIFT_BUILD_CACHE
still works, with a deprecation message naming the new one.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from service.settings import Settings
from worker.build import cache


@pytest.fixture
def bare_environment(monkeypatch, tmp_path):  # noqa: ANN001, ANN201
    """No build cache variable set, HOME and the XDG folders empty under tmp_path."""
    for name in ("OPTDRIFT_BUILD_CACHE", "OPTDRIFT_BUILD_CACHE_DIR", "OPTDRIFT_HOME", "XDG_DATA_HOME",
                 "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.setattr(cache, "_deprecation_said", False)
    return monkeypatch


@pytest.mark.parametrize("environment", [
    {},
    {"OPTDRIFT_HOME": "{tmp}/home"},
    {"XDG_DATA_HOME": "{tmp}/data"},
    {"OPTDRIFT_HOME": "{tmp}/home", "OPTDRIFT_BUILD_CACHE_DIR": "{tmp}/elsewhere"},
    {"XDG_DATA_HOME": "{tmp}/data", "XDG_CACHE_HOME": "{tmp}/cache"},
])
def test_checks_cache_is_the_services_for_the_same_environment(bare_environment, tmp_path, environment) -> None:  # noqa: ANN001
    for name, value in environment.items():
        bare_environment.setenv(name, value.format(tmp=tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing deprecated is set: no warning
        assert cache.default_cache_dir() == Settings().resolved_build_cache_dir


def test_the_old_name_still_works_and_says_the_new_one(bare_environment, tmp_path) -> None:  # noqa: ANN001
    bare_environment.setenv("OPTDRIFT_BUILD_CACHE", str(tmp_path / "old"))
    with pytest.warns(DeprecationWarning, match="OPTDRIFT_BUILD_CACHE is deprecated: set OPTDRIFT_BUILD_CACHE_DIR="):
        assert cache.default_cache_dir() == tmp_path / "old"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        assert cache.default_cache_dir() == tmp_path / "old"


def test_the_new_name_wins_and_the_old_one_is_said_ignored(bare_environment, tmp_path) -> None:  # noqa: ANN001
    bare_environment.setenv("OPTDRIFT_BUILD_CACHE", str(tmp_path / "old"))
    bare_environment.setenv("OPTDRIFT_BUILD_CACHE_DIR", str(tmp_path / "new"))
    with pytest.warns(DeprecationWarning, match="ignored here: OPTDRIFT_BUILD_CACHE_DIR="):
        assert cache.default_cache_dir() == tmp_path / "new" == Settings().resolved_build_cache_dir


def test_check_prints_the_deprecation_on_stderr(bare_environment, tmp_path, capsys) -> None:  # noqa: ANN001
    """A CLI user never sees a DeprecationWarning (Python hides them): `check` says it first."""
    from service.cli.check import EXIT_USAGE, run_check

    bare_environment.setenv("OPTDRIFT_BUILD_CACHE", str(tmp_path / "old"))
    assert run_check(tmp_path / "no-such-tree", None) == EXIT_USAGE  # stops before any build
    err = capsys.readouterr().err
    assert err.startswith("warning: OPTDRIFT_BUILD_CACHE is deprecated: set OPTDRIFT_BUILD_CACHE_DIR="), err
    bare_environment.delenv("OPTDRIFT_BUILD_CACHE")
    run_check(tmp_path / "no-such-tree", None)
    assert "deprecated" not in capsys.readouterr().err


@pytest.mark.slow
def test_check_hits_the_build_a_worker_made_under_the_same_home(bare_environment, tmp_path,  # noqa: ANN001
                                                                build_cache_dir, csrc_under_test) -> None:  # noqa: ANN001
    """A worker builds the bundled kernels into $OPTDRIFT_HOME/builds (its Workspace policy); the
    build `optdrift check` asks for then, with the same OPTDRIFT_HOME and no cache variable, is that
    build. (Its builds folder is the suite's shared cache, linked in, so no test compiles twice;
    before issue 47 `check` looked in ~/.cache/optdrift/builds, empty here, and rebuilt.)"""
    from worker import pipeline
    from worker.jobs.workspace import Workspace

    home = tmp_path / "home"
    home.mkdir()
    (home / "builds").symlink_to(build_cache_dir.resolve(), target_is_directory=True)
    bare_environment.setenv("OPTDRIFT_HOME", str(home))
    settings = Settings(worker_device="cpu")
    with Workspace(settings, prefix="optdrift-test-") as workspace:
        job = workspace.prepare(csrc_under_test, project=None, battery="quick")
        worker_build = workspace.build(job, workspace.policy(untrusted=False, environment="cpu"))
    assert worker_build.ok, worker_build.error
    check_job = pipeline.prepare(csrc_under_test, requested_battery="quick", local_battery_file=True)
    check_build = pipeline.build(check_job, pipeline.Policy(device="cpu", cache_dir=None, cuda_archs=[]))
    assert check_build.cached and check_build.digest == worker_build.digest
    assert Path(check_build.library_path) == Path(worker_build.library_path)
    assert os.path.realpath(check_build.library_path).startswith(str(build_cache_dir.resolve()))
