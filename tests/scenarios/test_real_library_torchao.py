"""Issue 37's real low-bit library: torchao 0.18.0 from PyPI (its `torchao.optim` steps through
torch.compile on the CPU with quantized tensor-subclass states), through its adapter
(worker/adapters/torchao.py), its own optdrift.toml and battery (tests/fixtures/torchao_project),
as a git repository whose tree is the installed package's files, made here:

    base ── comment ── decay     comment: a comment in torchao/optim/adam.py
                                 decay: AdamW's weight decay applied after the update

Through `optdrift check` (the real CLI, its exit codes): comment → unchanged against base (exit 0);
decay → changed (1), exactly the runnable cases (every one of them decays), from step 1; the 8-bit
case below torchao's 4096-element threshold (fp32 states in fact) is not applicable in both.
Both checks share one OPTDRIFT_HOME, so the second finds the builds and their compile cache
(worker/engine/compile_cache.py) warm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service_fixtures import REPO_ROOT
from worker.battery import load_battery

pytestmark = pytest.mark.slow
torchao = pytest.importorskip("torchao")

FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "torchao_project"
CASES = load_battery(str(FIXTURE / "battery.json")).expand()
FALLEN_BACK = {c.case_id for c in CASES if c.family == "8bit_blockwise" and c.size < 4096}
RUNNABLE = {c.case_id for c in CASES} - FALLEN_BACK
ADAMW_DECAY = "    if IS_ADAMW:\n        p_f32 = p_f32 - lr * weight_decay * p_f32\n    else:\n"
UPDATE = "    p_f32 = p_f32 - lr * (exp_avg_f32 / bias_correction1) / denom\n"


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True, text=True,
                          env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                               "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()


def _commit(repo: Path, trees: Path, name: str, message: str) -> Path:
    _git(repo, "commit", "-qam", message)
    tree = trees / name
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=repo, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return tree


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("torchao")
    repo, trees = root / "repo", root / "trees"
    shutil.copytree(Path(torchao.__file__).parent, repo / "torchao", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("optdrift.toml", "battery.json"):
        shutil.copyfile(FIXTURE / name, repo / name)
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", ".")
    made = {"base": _commit(repo, trees, "base", "torchao 0.18.0 with its optdrift.toml and battery")}
    adam = repo / "torchao" / "optim" / "adam.py"
    source = adam.read_text()
    assert source.count(ADAMW_DECAY) == 1 and source.count(UPDATE) == 1, "torchao's adam.py is not 0.18.0's"
    adam.write_text(source.replace(UPDATE, "    # the update, from the decayed parameter\n" + UPDATE))
    made["comment"] = _commit(repo, trees, "comment", "adam: say what the update starts from")
    source = adam.read_text()
    decay = "    if IS_ADAMW:\n        p_f32 = p_f32 - lr * weight_decay * p_f32\n"
    source = source.replace(ADAMW_DECAY, "    if not IS_ADAMW:\n")
    adam.write_text(source.replace(UPDATE, UPDATE + decay))
    made["decay"] = _commit(repo, trees, "decay", "adam: decay after the update")
    return made


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("torchao-check-home")


def check(history: dict[str, Path], name: str, baseline: str, home: Path) -> tuple[int, dict, str]:
    """The real CLI without a server: (exit code, the --json-out document, its output)."""
    json_out = home / f"{name}.json"
    args = ["check", "--source", str(history[name]), "--baseline", str(history[baseline]), "--device", "cpu",
            "--json-out", str(json_out)]
    script = Path(sys.executable).with_name("optdrift")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "service.cli"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "400", "OPTDRIFT_HOME": str(home),
           "OPTDRIFT_BUILD_CACHE_DIR": str(home / "builds"), "OPTDRIFT_DATABASE_URL": "",
           "OPTDRIFT_BROKER_URL": "", "OPTDRIFT_URL": "http://127.0.0.1:9", "OPTDRIFT_PUBLIC_URL": ""}
    answer = subprocess.run([*command, *args], cwd=REPO_ROOT, capture_output=True, text=True, env=env,
                            timeout=900, check=False)
    output = f"exit {answer.returncode}\nstdout:\n{answer.stdout}\nstderr:\n{answer.stderr[-6000:]}"
    assert json_out.exists(), output
    return answer.returncode, json.loads(json_out.read_text()), output


def _by_verdict(comparison: dict) -> dict[str, set[str]]:
    verdicts: dict[str, set[str]] = {}
    for case in comparison["cases"]:
        verdicts.setdefault(case["verdict"], set()).add(case["case_id"])
    return verdicts


def test_check_comment_only_is_unchanged(history, home):
    code, document, output = check(history, "comment", "base", home)
    assert code == 0, output
    verdicts = _by_verdict(document["comparison"])
    assert verdicts.get("unchanged") == RUNNABLE, output
    assert verdicts.get("not_applicable") == FALLEN_BACK, output


def test_check_decay_after_the_update_is_changed_from_step_1(history, home):
    code, document, output = check(history, "decay", "comment", home)
    assert code == 1, output
    verdicts = _by_verdict(document["comparison"])
    assert verdicts.get("changed") == RUNNABLE, output
    assert verdicts.get("not_applicable") == FALLEN_BACK, output
    for case in document["comparison"]["cases"]:
        if case["verdict"] == "changed":
            assert case["first_divergent_step"] == 1, case
    # The compile cache the two checks share holds what their hosts compiled.
    assert any(p.is_file() for p in (home / "builds" / "compile").rglob("*"))
