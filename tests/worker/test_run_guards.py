"""What the worker takes from a submitter, bounded before anything runs (worker/jobs/run.py,
worker/battery.py, worker/build/project.py): the battery a run names, the time a tree may ask for,
and whether a verify run may run at all on a worker that cannot sandbox."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.core.project_config import parse_config
from service.settings import Settings
from worker import sandbox
from worker.battery import BUILTIN_BATTERIES, BatteryError, battery_from_tree
from worker.build.project import build_project
from worker.jobs.run import RunBudget, _refusal

SECRET = "odt_canary_secret_token_in_a_file_outside_the_tree"


@pytest.fixture
def tree_and_secret(tmp_path: Path) -> tuple[Path, Path]:
    tree = tmp_path / "tree"
    (tree / "batteries").mkdir(parents=True)
    secret = tmp_path / "admin-token"
    secret.write_text(SECRET)
    return tree, secret


@pytest.mark.parametrize("name", [
    "{secret}", "../admin-token", "batteries/../../admin-token", "/proc/self/environ", "/etc/passwd",
    "batteries\\..\\..\\admin-token", "bat\0teries", "", "x" * 300, "link-out.json", "batteries",
    "missing.json",
])
def test_a_battery_is_a_builtin_or_a_file_inside_the_tree(tree_and_secret, name) -> None:
    tree, secret = tree_and_secret
    (tree / "link-out.json").symlink_to(secret)
    name = name.format(secret=secret)
    with pytest.raises(BatteryError) as refused:
        battery_from_tree(tree, name)
    message = str(refused.value)
    assert SECRET not in message and SECRET[:16] not in message  # never a read of the file
    assert "built-in battery" in message or "not a valid battery" in message or "larger" in message


def test_a_battery_file_in_the_tree_is_read_and_its_errors_name_the_fields(tree_and_secret) -> None:
    tree, _ = tree_and_secret
    assert battery_from_tree(tree, "quick").digest == BUILTIN_BATTERIES["quick"]().digest
    spec = BUILTIN_BATTERIES["quick"]()
    (tree / "batteries" / "mine.json").write_text(spec.model_dump_json())
    assert battery_from_tree(tree, "batteries/mine.json").digest == spec.digest
    (tree / "batteries" / "bad.json").write_text('{"name": "x", "version": 1, "groups": [{"optimizers": ["nope"]}]}')
    with pytest.raises(BatteryError, match=r"batteries/bad.json.*groups"):
        battery_from_tree(tree, "batteries/bad.json")
    (tree / "big.json").write_bytes(b" " * (2 * 1024 * 1024))
    with pytest.raises(BatteryError, match="larger than"):
        battery_from_tree(tree, "big.json")


def test_the_operator_caps_what_a_tree_asks_for(tmp_path) -> None:
    settings = Settings(home=tmp_path, max_build_s=1800, case_timeout_s=600, max_run_s=10_000,
                        verify_max_build_s=900, verify_case_timeout_s=120, verify_max_run_s=1800)
    commit, verify = RunBudget(settings, untrusted=False), RunBudget(settings, untrusted=True)
    assert (commit.build_s, commit.case_timeout_s, commit.run_s) == (1800, 600, 10_000)
    assert (verify.build_s, verify.case_timeout_s, verify.run_s) == (900, 120, 1800)
    assert verify.build_timeout_s() <= 900 and not verify.exceeded()
    verify.deadline = time.monotonic() - 1
    assert verify.exceeded() and verify.build_timeout_s() == 1.0
    assert "OPTDRIFT_VERIFY_MAX_RUN_S" in verify.reason(3, 81) and "3 of 81" in verify.reason(3, 81)


def test_a_tree_asking_for_six_hours_gets_the_operators_cap(tmp_path) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    config = parse_config('[build]\nkind = "command"\ncommands = ["sleep 30"]\ntimeout_s = 21600\n'
                          'library = "out.so"\n')
    started = time.monotonic()
    build = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[], max_timeout_s=2)
    assert time.monotonic() - started < 20
    assert not build.ok and "build.timeout_s = 2 s" in build.error


def test_verify_runs_are_refused_where_the_sandbox_cannot_be_made(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("OPTDRIFT_BWRAP", str(tmp_path / "no-bwrap-here"))
    sandbox.status.cache_clear()
    try:
        verify, commit = SimpleNamespace(kind="verify"), SimpleNamespace(kind="commit")
        strict, lenient = Settings(home=tmp_path), Settings(home=tmp_path, allow_unsandboxed=True)
        reason = _refusal(verify, strict)
        assert reason and "bubblewrap" in reason and "OPTDRIFT_ALLOW_UNSANDBOXED" in reason
        assert _refusal(commit, strict) is None and _refusal(verify, lenient) is None
    finally:
        monkeypatch.delenv("OPTDRIFT_BWRAP")
        sandbox.status.cache_clear()
    if sandbox.available():
        assert _refusal(SimpleNamespace(kind="verify"), Settings(home=tmp_path)) is None
    assert os.environ.get("OPTDRIFT_BWRAP") is None


def test_every_job_builds_a_verify_runs_tree_under_the_verify_cap(tmp_path) -> None:
    """The run, the co-run and the timing build through one workspace (worker/jobs/workspace.py):
    a verify run's tree gets the smaller of the two build caps whichever job builds it, a commit
    run's tree OPTDRIFT_MAX_BUILD_S; the run's budget says the same."""
    from worker.jobs.workspace import Workspace

    for verify_cap, expected_verify in ((900, 900), (3600, 1800)):  # the verify cap never exceeds the general one
        settings = Settings(home=tmp_path, max_build_s=1800, verify_max_build_s=verify_cap)
        with Workspace(settings, prefix="optdrift-test-") as workspace:
            assert workspace.root.is_dir()
            for warm in (False, True):  # the co-run's policy, the run's and the timing's
                assert workspace.policy(untrusted=True, environment="cpu", warm=warm).max_build_s == expected_verify
                assert workspace.policy(untrusted=False, environment="cpu", warm=warm).max_build_s == 1800
            assert not workspace.policy(untrusted=True, environment="cpu").trusted and workspace.policy(untrusted=False, environment="cpu").trusted
        assert not workspace.root.exists()  # the job's folder goes with it
        assert RunBudget(settings, untrusted=True).build_s == expected_verify
