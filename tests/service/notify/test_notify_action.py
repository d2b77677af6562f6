"""The composite GitHub Action (action.yml) and the README's workflow that uses it: both valid
against the GitHub schemas check-jsonschema ships, inputs and outputs wired to the step, and the
step's script run for real with a stand-in `optdrift` on PATH (what it passes, what it writes to
$GITHUB_OUTPUT, the exit code it ends with)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from service.notify.action_outputs import outputs

REPO_ROOT = Path(__file__).resolve().parents[3]
ACTION = REPO_ROOT / "action.yml"
BIN = Path(sys.executable).parent


def _check_jsonschema() -> str:
    found = shutil.which("check-jsonschema", path=str(BIN)) or shutil.which("check-jsonschema")
    if found is None:
        pytest.fail("check-jsonschema is not installed (pip install -e '.[test]' brings it)")
    return found


def _readme_workflow() -> str:
    readme = (REPO_ROOT / "README.md").read_text()
    blocks = re.findall(r"```yaml\n(# \.github/workflows/.*?)```", readme, re.S)
    assert blocks, "README.md has no ```yaml block starting with '# .github/workflows/...'"
    return blocks[0]


def test_action_and_readme_workflow_are_valid_against_githubs_schemas(tmp_path: Path) -> None:
    action = subprocess.run([_check_jsonschema(), "--builtin-schema", "vendor.github-actions", str(ACTION)],
                            capture_output=True, text=True, timeout=60)
    assert action.returncode == 0, action.stdout + action.stderr
    workflow = tmp_path / "optdrift.yml"
    workflow.write_text(_readme_workflow())
    checked = subprocess.run([_check_jsonschema(), "--builtin-schema", "vendor.github-workflows", str(workflow)],
                             capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The README's workflow uses this action with every required input.
    [step] = [s for s in yaml.safe_load(_readme_workflow())["jobs"]["trajectories"]["steps"]
              if "optdrift" in s.get("uses", "") and not s["uses"].startswith("actions/")]
    required = {name for name, spec in yaml.safe_load(ACTION.read_text())["inputs"].items()
                if spec.get("required")}
    assert required <= set(step["with"])


def _submit_step(action: dict) -> dict:
    [step] = [s for s in action["runs"]["steps"] if s.get("id") == "submit"]
    return step


def test_inputs_and_outputs_are_wired_to_the_submit_step() -> None:
    action = yaml.safe_load(ACTION.read_text())
    assert action["runs"]["using"] == "composite"
    assert {"url", "project", "source", "battery", "token"} <= set(action["inputs"])
    step = _submit_step(action)
    for name in ("url", "project", "source", "battery", "token"):
        assert f"${{{{ inputs.{name} }}}}" in step["env"].values(), f"input {name} does not reach the step"
    for name in ("verdict", "run-url", "exit-code"):
        # A fork's pull request (issue 44) skips with verdict `skipped`, exit code 0 and no run page.
        fork = f" || steps.fork.outputs.{name}" if name != "run-url" else ""
        assert action["outputs"][name]["value"] == (
            f"${{{{ steps.submit.outputs.{name} || steps.compare.outputs.{name}{fork} }}}}")
    # No expression is spliced into the script's text (script injection): inputs come as env.
    assert "${{" not in step["run"]
    install = [s for s in action["runs"]["steps"] if "pip install" in s.get("run", "")]
    assert install and "$GITHUB_ACTION_PATH" in install[0]["run"], "the client comes from the action's own tree"


FAKE_OPTDRIFT = """#!{python}
import json, os, sys
open(os.environ["ARGS_LOG"], "w").write(json.dumps(sys.argv[1:]))
print(json.dumps({{"exit_code": 1, "dashboard_urls": {{"7": "https://o.example/runs/7", "8": "https://o.example/runs/8"}},
                  "runs": [{{"id": 7, "status": "done", "verdict": {{"outcome": "unchanged", "acknowledged": False}}}},
                           {{"id": 8, "status": "done", "verdict": {{"outcome": "changed", "acknowledged": False}}}}]}}))
sys.exit(1)
"""


def test_the_submit_script_runs_optdrift_and_writes_the_outputs(tmp_path: Path) -> None:
    step = _submit_step(yaml.safe_load(ACTION.read_text()))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "optdrift"
    fake.write_text(FAKE_OPTDRIFT.format(python=sys.executable))
    fake.chmod(0o755)
    python = bin_dir / "python"
    python.symlink_to(sys.executable)
    github_output = tmp_path / "github_output"
    github_output.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT),
           "ARGS_LOG": str(tmp_path / "args.json"), "GITHUB_OUTPUT": str(github_output),
           "RUNNER_TEMP": str(tmp_path), "OPTDRIFT_URL": "https://o.example", "OPTDRIFT_TOKEN": "t",
           "OPTDRIFT_PROJECT": "my kernels", "OPTDRIFT_SOURCE": "csrc", "OPTDRIFT_BATTERY": "standard",
           "OPTDRIFT_COMMIT": "c0ffee", "OPTDRIFT_REF": "feature/$(touch pwned)"}
    done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1, done.stderr  # the verdict's exit code fails the step
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[0] == "submit" and "--wait" in args and args[args.index("--format") + 1] == "json"
    assert args[args.index("--project") + 1] == "my kernels"
    assert args[args.index("--battery") + 1] == "standard" and args[args.index("--ref") + 1] == "feature/$(touch pwned)"
    assert not (tmp_path / "pwned").exists()
    written = dict(line.split("=", 1) for line in github_output.read_text().splitlines())
    assert written == {"verdict": "changed", "run-url": "https://o.example/runs/8", "exit-code": "1"}


def test_outputs_name_the_deciding_run_and_survive_a_failed_submit() -> None:
    ok = {"dashboard_urls": {"3": "u3"}, "runs": [{"id": 3, "status": "done",
                                                    "verdict": {"outcome": "no-baseline", "acknowledged": False}}]}
    assert outputs(ok, 0) == {"verdict": "no-baseline", "run-url": "u3", "exit-code": "0"}
    acked = {"dashboard_urls": {"3": "u3"}, "runs": [{"id": 3, "status": "done",
                                                       "verdict": {"outcome": "changed", "acknowledged": True}}]}
    assert outputs(acked, 0)["verdict"] == "acknowledged"
    assert outputs(None, 4) == {"verdict": "error", "run-url": "", "exit-code": "4"}


FAKE_COMPARE = """#!{python}
import json, os, sys
open(os.environ["ARGS_LOG"], "w").write(json.dumps(sys.argv[1:]))
print(json.dumps({{"comparison": {{"verdict": "changed"}}, "run_url": "https://o.example/runs/9"}}))
sys.exit(1)
"""


def _compare_step(action: dict) -> dict:
    return next(step for step in action["runs"]["steps"] if step.get("id") == "compare")


def _run_step(step: dict, tmp_path: Path, fake: str, **env_extra: str) -> tuple[subprocess.CompletedProcess, dict]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "optdrift").write_text(fake.format(python=sys.executable))
    (bin_dir / "optdrift").chmod(0o755)
    if not (bin_dir / "python").exists():
        (bin_dir / "python").symlink_to(sys.executable)
    output = tmp_path / "github_output"
    output.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(REPO_ROOT),
           "ARGS_LOG": str(tmp_path / "args.json"), "GITHUB_OUTPUT": str(output), "RUNNER_TEMP": str(tmp_path),
           "GITHUB_SHA": "f" * 40, **env_extra}
    done = subprocess.run(["bash", "-e", "-c", step["run"]], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    return done, dict(line.split("=", 1) for line in output.read_text().splitlines())


def test_the_upgrade_check_mode_compares_two_environments_instead_of_submitting(tmp_path: Path) -> None:
    """compare-environments set: the commit and submit steps are skipped, the compare step runs
    `optdrift compare --run` on `release` (default github.sha) with submit's exit codes and outputs."""
    action = yaml.safe_load(ACTION.read_text())
    steps = {step.get("id"): step for step in action["runs"]["steps"]}
    # ... and all three are skipped for a fork's pull request (issue 44: the fork step).
    not_fork = " && steps.fork.outputs.skip != 'true'"
    assert steps["commit"]["if"] == steps["submit"]["if"] == "inputs.compare-environments == ''" + not_fork
    assert steps["compare"]["if"] == "inputs.compare-environments != ''" + not_fork
    step = _compare_step(action)
    assert "${{" not in step["run"]  # inputs reach the script as environment only
    assert step["env"]["OPTDRIFT_ENVIRONMENTS"] == "${{ inputs.compare-environments }}"
    done, written = _run_step(step, tmp_path, FAKE_COMPARE, OPTDRIFT_URL="https://o.example", OPTDRIFT_TOKEN="t",
                              OPTDRIFT_PROJECT="k", OPTDRIFT_BATTERY="", OPTDRIFT_ENVIRONMENTS="cpu cpu+clang",
                              OPTDRIFT_RELEASE="v1.2")
    assert done.returncode == 1, done.stderr
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[:5] == ["compare", "--project", "k", "--commit", "v1.2"] and "--run" in args
    assert [args[i + 1] for i, word in enumerate(args) if word == "--env"] == ["cpu", "cpu+clang"]
    assert written == {"verdict": "changed", "run-url": "https://o.example/runs/9", "exit-code": "1"}

    one, written = _run_step(step, tmp_path, FAKE_COMPARE, OPTDRIFT_URL="u", OPTDRIFT_TOKEN="t", OPTDRIFT_PROJECT="k",
                             OPTDRIFT_BATTERY="", OPTDRIFT_ENVIRONMENTS="cpu", OPTDRIFT_RELEASE="")
    assert one.returncode == 2 and "must name two environments" in one.stdout
    assert written["verdict"] == "bad-input"
