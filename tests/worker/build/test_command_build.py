"""The `command` build kind on a project of our own (tests/fixtures/cmake_project: CMake + Ninja,
a C ABI loaded with ctypes), at two commits of a real git history: the second moves AdamW's
decoupled decay after the update, and the engine's co-run must flag exactly the weight-decayed
Adam cases, from step 1, while momentum and the wd=0 cases stay bit-identical."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from service.core.project_config import ProjectConfigError, load_project_config, parse_config
from service.core.verdicts import compare_runs
from worker.battery import load_battery
from worker.engine.corun import corun_battery
from worker.build.project import build_project

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "cmake_project"
PATCH = FIXTURE / "commits" / "0002-decay-after-update.patch"

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None or shutil.which("ninja") is None,
                                reason="needs cmake and ninja on PATH")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=ci", "-c", "user.email=ci@example.invalid", *args],
                          cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture(scope="module")
def two_commits(tmp_path_factory) -> tuple[Path, Path]:
    """(tree at commit 1, tree at commit 2), each exported from a git repository with `git archive`."""
    root = tmp_path_factory.mktemp("tinyopt")
    repo = root / "repo"
    shutil.copytree(FIXTURE, repo, ignore=shutil.ignore_patterns("commits", "build"))
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "tinyopt: AdamW and SGD momentum")
    first = _git(repo, "rev-parse", "HEAD")
    _git(repo, "apply", str(PATCH))
    _git(repo, "commit", "-qam", "AdamW: decay after the update")
    second = _git(repo, "rev-parse", "HEAD")
    trees = []
    for sha in (first, second):
        tree = root / sha[:12]
        tree.mkdir()
        archive = subprocess.run(["git", "archive", sha], cwd=repo, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
        trees.append(tree)
    return trees[0], trees[1]


def test_second_commit_is_flagged_on_exactly_the_decayed_adam_cases(two_commits, tmp_path):
    base_tree, commit_tree = two_commits
    config = load_project_config(commit_tree)
    assert config.build.kind == "command" and config.adapter == "tinyopt"
    builds = [build_project(tree, load_project_config(tree), cache_dir=tmp_path, cuda_archs=[])
              for tree in (base_tree, commit_tree)]
    for build in builds:
        assert build.ok, build.error
        assert Path(build.library_path).name == "libtinyopt.so"
    assert builds[0].digest != builds[1].digest

    battery = load_battery(str(commit_tree / config.battery))
    commit_run, baseline_run, diffs = corun_battery(
        battery, builds[1].library_path, builds[0].library_path, commit_digest=builds[1].digest,
        baseline_digest=builds[0].digest, device="cpu", adapter=config.adapter)
    comparison = compare_runs(commit_run, baseline_run, diffs)
    assert comparison.verdict == "changed"

    by_id = {c.case_id: c for c in comparison.cases}
    expected_changed = {c.case_id for c in battery.expand()
                        if c.optimizer == "adam" and c.hyper["weight_decay"] > 0}
    changed = {case_id for case_id, c in by_id.items() if c.verdict == "changed"}
    assert changed == expected_changed
    assert all(c.verdict == "unchanged" for case_id, c in by_id.items() if case_id not in expected_changed)
    for case_id in expected_changed:
        case = by_id[case_id]
        # (p - s u)(1 - lr wd) vs p(1 - lr wd) - s u differ by s u lr wd from the first step on.
        assert case.first_divergent_step == 1
        # The bug moves the trajectory away from torch.optim.AdamW (float64) at the discriminating point.
        if "lr=0.1." in case_id:
            assert case.direction == "farther"
            assert max(case.max_abs_diff_per_step) > 1e-4


def test_a_failing_command_is_a_failed_build_with_its_message(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(FIXTURE, tree, ignore=shutil.ignore_patterns("commits", "build"))
    source = tree / "src" / "adamw.cpp"
    source.write_text(source.read_text().replace("const float g = grad[i];", "const float g = grad[i]"))
    result = build_project(tree, load_project_config(tree), cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not result.ok
    assert "cmake --build build" in result.error and "error" in result.error
    assert Path(result.log_path).is_file()


def test_a_missing_output_and_a_timeout_are_reported(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(FIXTURE, tree, ignore=shutil.ignore_patterns("commits", "build"))
    wrong_output = parse_config('[project]\nadapter="tinyopt"\n[build]\nkind="command"\n'
                                'commands=["true"]\nlibrary="build/libnothere.so"\n')
    result = build_project(tree, wrong_output, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not result.ok and "build/libnothere.so" in result.error

    slow = parse_config('[build]\nkind="command"\ncommands=["sleep 30"]\ntimeout_s=1\nlibrary="x"\n')
    started = __import__("time").monotonic()
    result = build_project(tree, slow, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not result.ok and "timeout_s = 1 s" in result.error
    assert __import__("time").monotonic() - started < 15


def test_commands_see_the_cuda_architectures_and_a_rebuild_is_cached(tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    config = parse_config('[build]\nkind="command"\nlibrary="archs.txt"\n'
                          'commands=["sh -c \'echo $CUDAARCHS $TORCH_CUDA_ARCH_LIST $BUILD_EXTRA > archs.txt\'"]\n'
                          'env={BUILD_EXTRA="x"}\n')
    first = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=["9.0", "8.6"])
    assert first.ok and not first.cached, first.error
    assert Path(first.library_path).read_text().split() == ["90;86", "9.0;8.6", "x"]
    again = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=["9.0", "8.6"])
    assert again.cached and again.digest == first.digest
    (tree / "new.txt").write_text("a change anywhere in the tree is a new build")
    assert build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=["9.0", "8.6"]).digest != first.digest


def test_configuration_errors_name_the_field():
    with pytest.raises(ProjectConfigError, match="build.library"):
        parse_config('[build]\nkind="command"\ncommands=["make"]\n')
    with pytest.raises(ProjectConfigError, match="needs build.commands"):
        parse_config('[build]\nkind="command"\nlibrary="a.so"\n')
    with pytest.raises(ProjectConfigError, match="inside the tree"):
        parse_config('[build]\nkind="command"\ncommands=["make"]\nlibrary="../../etc/passwd"\n')
    with pytest.raises(ProjectConfigError, match="kind"):
        parse_config('[build]\nkind="bazel"\n')
    with pytest.raises(ProjectConfigError, match="unknown table"):
        parse_config('[projekt]\nadapter="x"\n')


def test_command_builds_run_in_the_sandbox_without_the_workers_secrets(tmp_path, monkeypatch):
    """A submitted build command sees no database URL, broker URL or token, and a scratch HOME."""
    from service.core.project_config import ProjectConfig
    from worker.build.project import build_project

    monkeypatch.setenv("OPTDRIFT_DATABASE_URL", "postgresql://user:s3cret-password@db/optdrift")
    monkeypatch.setenv("OPTDRIFT_WORKER_TOKEN", "odt_s3cret-token")
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "README").write_text("a project whose build prints its environment\n")
    config = ProjectConfig.model_validate({"build": {
        "kind": "command", "commands": ["sh -c 'env > seen-environment.txt'"],
        "library": "seen-environment.txt"}})
    result = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert result.ok, result.error
    seen = Path(result.library_path).read_text()
    assert "s3cret" not in seen
    home = dict(line.split("=", 1) for line in seen.splitlines() if "=" in line)["HOME"]
    assert home != str(Path.home()) and "optdrift-command-build-scratch-" in home


def test_build_commands_get_the_workers_python_first_on_path(tmp_path):
    """issue 20: `python3` in a build command is the worker's interpreter (the one with torch),
    also named by OPTDRIFT_PYTHON, not whatever Python comes first on the worker's PATH."""
    import sys

    from service.core.project_config import parse_config

    tree = tmp_path / "tree"
    tree.mkdir()
    config = parse_config('[build]\nkind = "command"\nlibrary = "out.txt"\ncommands = ['
                          '"sh -c \'command -v python3 > out.txt; echo $OPTDRIFT_PYTHON >> out.txt; '
                          'python3 -c \\"import torch\\" && echo torch >> out.txt\'"]\n')
    build = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert build.ok, build.error
    found, named, torch_line = Path(build.library_path).read_text().split()
    assert Path(found).parent == Path(sys.executable).parent and named == sys.executable
    assert torch_line == "torch"


def test_tinyopt_runs_when_registered_and_is_refused_by_name_when_not(two_commits, tmp_path, monkeypatch):
    """The fixture adapter is the operator's registration (OPTDRIFT_EXTRA_ADAPTERS, set by
    tests/conftest.py), not the product's: registered, a host loads it by the tree's name for it
    and runs a case; unregistered, the same tree's `adapter = "tinyopt"` gets the refusal that
    lists the valid names."""
    from service.settings import get_settings
    from worker.engine.host import KernelHost, KernelHostError

    tree = two_commits[0]
    config = load_project_config(tree)
    build = build_project(tree, config, cache_dir=tmp_path, cuda_archs=[])
    assert build.ok, build.error
    case = next(c for c in load_battery(str(tree / config.battery)).expand() if c.optimizer == "adam")
    with KernelHost(build.library_path, device="cpu", adapter=config.adapter, case_timeout_s=120) as host:
        result = host.run(case)
        assert result.status == "ok" and len(result.trajectory.digests) == case.steps, result.message
        assert host.adapter_description["adapter"] == "tinyopt"

    monkeypatch.setenv("OPTDRIFT_EXTRA_ADAPTERS", "")
    get_settings.cache_clear()
    try:
        with KernelHost(build.library_path, device="cpu", adapter=config.adapter, case_timeout_s=120) as host:
            with pytest.raises(KernelHostError) as refused:
                host.start()
    finally:
        get_settings.cache_clear()
    assert "unknown adapter 'tinyopt'" in str(refused.value)
    from worker.adapters import BUILTIN_ADAPTERS

    assert f"Use one of {sorted(BUILTIN_ADAPTERS)}" in str(refused.value)
    assert "OPTDRIFT_EXTRA_ADAPTERS" in str(refused.value)
