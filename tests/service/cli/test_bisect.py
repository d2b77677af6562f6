"""`optdrift bisect --local` on a real git history of the bundled kernels, and its bad input.

The fixture repository (`make_history`): 33 commits after the good one. The bundled csrc with a
three-case battery (adam, ademamix, lion at lr 0.1 / wd 0.1, where the decay ordering moves the
bits at step 1). At one commit Adam's update applies weight decay after the update (the first
substitution of worker/mutations.DECAY_AFTER_UPDATE); eleven commits later AdEMAMix's does (the
second). Every other commit changes a NOTES.md beside the kernels (the source tree changes, the build digest does
not: only compiled files are digested) or, every fourth, the repository's README (the source tree
does not change: bisect never tests those). Three distinct builds in all, shared with the test
build cache.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from service.cli import app
from worker.mutations import DECAY_AFTER_UPDATE, _substitute, copy_tree

REPO_ROOT = Path(__file__).resolve().parents[3]
BATTERY = {"name": "bisect-tiny", "version": 1, "groups": [
    {"optimizers": ["adam", "ademamix", "lion"], "points": [{"lr": 0.1, "weight_decay": 0.1}],
     "sizes": [64], "steps": 4}]}
COMMITS_AFTER_GOOD = 33
ADAM_AT, ADEMAMIX_AT = 9, 20   # 1-based positions after good
runner = CliRunner()


@dataclass
class History:
    repo: Path
    shas: list[str]            # shas[0] good ... shas[-1] bad
    outside_source: set[str]   # commits that leave csrc as it was


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.org",
           "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def make_history(root: Path, *, commits_after_good: int = COMMITS_AFTER_GOOD, adam_at: int = ADAM_AT,
                 ademamix_at: int = ADEMAMIX_AT) -> History:
    repo = root / "kernels"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "main")
    source = copy_tree(REPO_ROOT / "csrc", repo / "csrc")
    (source / "bisect-battery.json").write_text(json.dumps(BATTERY))
    (source / "optdrift.toml").write_text('[project]\nbattery = "bisect-battery.json"\n')
    (source / "NOTES.md").write_text("notes\n")
    (repo / "README.md").write_text("kernels\n")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "good: the bundled kernels")
    shas, outside = [_git(repo, "rev-parse", "HEAD")], set()
    for position in range(1, commits_after_good + 1):
        if position == adam_at:
            _substitute(source, *DECAY_AFTER_UPDATE[0])
            message = "adam: apply weight decay after the update"
        elif position == ademamix_at:
            _substitute(source, *DECAY_AFTER_UPDATE[1])
            message = "ademamix: apply weight decay after the update"
        elif position % 4 == 0:
            with (repo / "README.md").open("a") as readme:
                readme.write(f"line {position}\n")
            message = f"docs {position}"
        else:
            with (source / "NOTES.md").open("a") as notes:
                notes.write(f"note {position}\n")
            message = f"notes {position}"
        _git(repo, "commit", "-q", "-am", message)
        shas.append(_git(repo, "rev-parse", "HEAD"))
        if message.startswith("docs"):
            outside.add(shas[-1])
    return History(repo=repo, shas=shas, outside_source=outside)


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> History:
    return make_history(tmp_path_factory.mktemp("bisect"))


def assert_located(document: dict, history: History) -> None:
    """Adam's case first changed at ADAM_AT, AdEMAMix's at ADEMAMIX_AT, exactly; lion never."""
    by_optimizer = {f["optimizer"]: f for f in document["findings"]}
    assert set(by_optimizer) == {"adam", "ademamix"}, document["findings"]
    assert by_optimizer["adam"]["first_changed"] == history.shas[ADAM_AT]
    assert by_optimizer["ademamix"]["first_changed"] == history.shas[ADEMAMIX_AT]
    for finding in by_optimizer.values():
        assert finding["exact"] and finding["verdict"] == "changed" and finding["first_divergent_step"] == 1
        # The decay-after-update ordering is farther from the float64 reference at lr 0.1 / wd 0.1.
        assert finding["direction"] == "farther"
    tested = [t["sha"] for t in document["tested"]]
    assert not set(tested) & history.outside_source, "a commit that leaves csrc as it was was tested"
    assert len(tested) == len(set(tested))


def test_local_bisect_finds_the_first_commit_of_each_change_in_log2_tests(history, build_cache_dir,
                                                                           monkeypatch) -> None:
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE", str(build_cache_dir))
    result = runner.invoke(app, ["bisect", "--repo", str(history.repo), "--good", history.shas[0],
                                 "--bad", history.shas[-1], "--local", "--device", "cpu", "--format", "json"])
    assert result.exit_code == 0, result.stderr + result.stdout
    document = json.loads(result.stdout)
    assert_located(document, history)
    candidates = document["candidate_commits"]
    assert candidates == COMMITS_AFTER_GOOD - len(history.outside_source)
    # The bound for one change among >= 30 commits: each case was located in at most
    # ceil(log2 n) + 1 tested midpoints (n: the commits after good, before collapsing)...
    for finding in document["findings"]:
        assert finding["midpoints_tested"] <= math.ceil(math.log2(COMMITS_AFTER_GOOD)) + 1, finding
    # ...and the two changes together shared their first midpoints: fewer than two searches' worth.
    midpoints = len(document["tested"]) - 2
    assert midpoints < 2 * math.ceil(math.log2(candidates)), document["tested"]
    # Commits of one build digest share one battery run: good, adam-only, adam+ademamix.
    assert document["builds"] == 3, document["tested"]
    assert "round 1:" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--good", "0000000000000000000000000000000000000bad"], "--good 0000000000000000000000000000000000000bad: no such commit"),
    (["--swap"], "is not an ancestor of --bad"),
    (["--same"], "are the same commit"),
    (["--source", "kernels"], "has no folder 'kernels'"),
    (["--no-project"], "--project is required"),
])
def test_bad_input_is_one_line_and_exit_2(history, args, message) -> None:
    good, bad = history.shas[0], history.shas[-1]
    base = ["bisect", "--repo", str(history.repo), "--project", "p", "--url", "http://127.0.0.1:9"]
    if args == ["--swap"]:
        args = ["--good", bad, "--bad", good]
    elif args == ["--same"]:
        args = ["--good", good, "--bad", good]
    elif args == ["--no-project"]:
        base = base[:3]
        args = ["--good", good, "--bad", bad]
    if "--good" not in args:
        args = [*args, "--good", good]
    if "--bad" not in args:
        args = [*args, "--bad", bad]
    result = runner.invoke(app, [*base, *args])
    assert result.exit_code == 2, result.stderr + result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def test_not_a_repository_and_server_down(history, tmp_path) -> None:
    result = runner.invoke(app, ["bisect", "--repo", str(tmp_path), "--good", "a", "--bad", "b", "--local"])
    assert result.exit_code == 2 and "is not a git repository" in result.stderr
    # Nothing listens on port 9: the service is unreachable, exit 4 (README "Exit codes").
    result = runner.invoke(app, ["bisect", "--repo", str(history.repo), "--good", history.shas[0],
                                 "--bad", history.shas[-1], "--project", "p", "--url", "http://127.0.0.1:9"])
    assert result.exit_code == 4, result.stderr
    assert "cannot reach the optdrift service at http://127.0.0.1:9" in result.stderr


def test_local_on_cuda_without_a_gpu_is_exit_2(history) -> None:
    from service.cli.main import _cuda_visible

    if _cuda_visible():
        pytest.skip("a GPU is visible here: --device cuda is valid")
    result = runner.invoke(app, ["bisect", "--repo", str(history.repo), "--good", history.shas[0],
                                 "--bad", history.shas[-1], "--local", "--device", "cuda"])
    assert result.exit_code == 2 and "--device cuda: no CUDA GPU is visible" in result.stderr, result.stderr
