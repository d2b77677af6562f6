"""`optdrift check` bad input and exit codes, through the real CLI app."""

import json
import os
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from worker.battery import load_battery

runner = CliRunner()


def test_missing_folder_is_a_one_line_error_and_exit_2(tmp_path, monkeypatch):
    # The suite's OPTDRIFT_BUILD_CACHE (tests/conftest.py) would add check's deprecation line.
    monkeypatch.delenv("OPTDRIFT_BUILD_CACHE", raising=False)
    result = runner.invoke(app, ["check", "--source", str(tmp_path / "nope")])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "nope" in lines[0] and "not a folder" in lines[0]
    result = runner.invoke(app, ["check", "--source", str(tmp_path), "--baseline", str(tmp_path / "gone")])
    assert result.exit_code == 2 and "--baseline" in result.output


def test_invalid_battery_file_lists_every_problem_and_exit_2(tmp_path):
    battery = tmp_path / "bad.json"
    battery.write_text(json.dumps({"name": "bad", "version": 1, "groups": [
        {"optimizers": ["adamw"], "sizes": [1 << 40], "steps": -1, "points": [{"lr": -0.1}]}]}))
    result = runner.invoke(app, ["check", "--source", str(tmp_path), "--battery", str(battery)])
    assert result.exit_code == 2
    for field in ("groups.0.optimizers.0", "groups.0.sizes", "groups.0.steps", "groups.0.points.0.lr"):
        assert field in result.output
    result = runner.invoke(app, ["check", "--source", str(tmp_path), "--battery", "fastest"])
    assert result.exit_code == 2 and "battery 'fastest' is neither a built-in battery nor a file" in result.output


@pytest.mark.slow
def test_a_source_that_does_not_build_is_broken_with_the_compiler_message(tmp_path, csrc_under_test,
                                                                          build_cache_dir, monkeypatch):
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE", str(build_cache_dir))
    broken = tmp_path / "broken"
    shutil.copytree(csrc_under_test, broken)
    (broken / "cpu" / "syntax_error.cpp").write_text("int optdrift_broken( { return 0; }\n")
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["check", "--source", str(broken), "--json-out", str(out), "--device", "cpu"])
    assert result.exit_code == 3, result.output  # broken (README: exit codes)
    comparison = json.loads(out.read_text())["comparison"]
    assert comparison["verdict"] == "broken"
    assert "syntax_error.cpp" in comparison["summary"]


@pytest.mark.slow
def test_no_baseline_runs_the_battery_and_exits_0(tmp_path, csrc_under_test, build_cache_dir, monkeypatch):
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE", str(build_cache_dir))
    out = tmp_path / "out.json"
    result = runner.invoke(app, ["check", "--source", str(csrc_under_test), "--json-out", str(out), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    assert payload["comparison"]["verdict"] == "no-baseline" and payload["baseline"] is None
    cases = payload["commit"]["cases"]
    assert len(cases) == len(load_battery("quick").expand()) and all(c["status"] == "ok" for c in cases)
    assert "NO-BASELINE" in result.output


@pytest.mark.slow
def test_a_warm_check_never_imports_torch_in_its_own_process(tmp_path, csrc_under_test, build_cache_dir):
    """Only the kernel hosts run kernels: a check whose builds are cached imports no torch itself,
    so its hosts start at once instead of after a torch import of its own (2 s of a 4-s check on
    a 2-core machine: docs/PERFORMANCE.md). Run as the CLI runs, in a fresh process."""
    import subprocess
    import sys

    env = {**os.environ, "OPTDRIFT_BUILD_CACHE": str(build_cache_dir)}
    script = ("import sys; from pathlib import Path; from service.cli.check import run_check; "
              f"code = run_check(Path({str(csrc_under_test)!r}), Path({str(csrc_under_test)!r}), 'quick', device='cpu'); "
              "print('exit', code, 'torch imported', 'torch' in sys.modules)")
    for _ in range(2):  # the first may build (torch imported to compile); the second is warm
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                             cwd=Path(__file__).resolve().parents[3], timeout=600)
    assert out.stdout.strip().splitlines()[-1] == "exit 0 torch imported False", out.stdout + out.stderr


@pytest.mark.slow
def test_with_a_baseline_both_hosts_start_before_either_battery_and_none_is_left(tmp_path, csrc_under_test,
                                                                              build_cache_dir, monkeypatch):
    """A check with a baseline starts both kernel hosts at once (worker/check.py run): each battery
    gets a host that was already up when it began, and every host is closed when the check
    returns, after both batteries as when the baseline does not build."""
    from worker import pipeline, sandbox
    from worker.engine import host_reserve

    if not sandbox.available():
        pytest.skip("hosts start ahead only where they are boxed (bubblewrap)")
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE", str(build_cache_dir))
    started, handed = [], []
    real_spares, real_run = host_reserve.spares, pipeline.run

    def spares(count, **options):  # noqa: ANN001, ANN003
        hosts = real_spares(count, **options)
        started.extend(hosts)
        return hosts

    def run(*args, host=None, **options):  # noqa: ANN001, ANN002, ANN003
        handed.append((host, host is not None and host.running()))
        return real_run(*args, host=host, **options)

    monkeypatch.setattr(host_reserve, "spares", spares)
    monkeypatch.setattr(pipeline, "run", run)
    check = ["check", "--source", str(csrc_under_test), "--battery", "ci", "--device", "cpu", "--baseline"]
    result = runner.invoke(app, [*check, str(csrc_under_test)])
    assert result.exit_code == 0, result.output
    assert len(started) == 2 and all(started)
    assert [host for host, _ in handed] == started  # the baseline's battery took the first, the commit's the second
    assert all(up for _, up in handed)
    assert not any(host.running() for host in started)

    started.clear()
    handed.clear()
    broken = tmp_path / "broken"
    shutil.copytree(csrc_under_test, broken)
    (broken / "cpu" / "syntax_error.cpp").write_text("int optdrift_broken( { return 0; }\n")
    result = runner.invoke(app, [*check, str(broken)])
    assert result.exit_code == 2 and "does not build" in result.output, result.output
    assert len(started) == 2 and not handed and not any(host.running() for host in started)
