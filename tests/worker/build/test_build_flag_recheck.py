"""The worker checks a build's compiler flags against the allow-list again right before it builds
(issue 43): a configuration or variant that skipped validation (model_construct, a row written by
an older service) never hands `-wrapper` to a compiler. No build runs and the result names the flag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from service.core.environments import BuildVariant
from service.core.project_config import BuildConfig, ProjectConfig
from worker.build import project
from worker.build.project import build_project

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"


@pytest.fixture
def no_compiler_runs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Records any call into the two build kinds; the checks below want none."""
    called: list[str] = []
    monkeypatch.setattr(project, "build_extension", lambda *a, **k: called.append("build_extension"))
    monkeypatch.setattr(project, "build_command", lambda *a, **k: called.append("build_command"))
    return called


def test_a_tree_flag_that_skipped_validation_is_refused_before_any_build(tmp_path: Path,
                                                                         no_compiler_runs: list[str]) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(FIXTURES / "tiny_ext", tree)
    (tree / "src").mkdir(exist_ok=True)
    (tree / "src" / "wrap.h").write_text("#!/bin/sh\nexec \"$@\"\n")
    build = BuildConfig.model_construct(kind="torch-extension", cflags=["-O2", "-wrapper", "sh,src/wrap.h"])
    config = ProjectConfig.model_construct(build=build)
    result = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not result.ok and result.digest == "" and no_compiler_runs == []
    assert result.error.startswith("build.cflags[1] '-wrapper' is not an allowed compiler flag"), result.error
    assert not (tmp_path / "cache").exists()
    nvcc = ProjectConfig.model_construct(build=BuildConfig.model_construct(kind="torch-extension",
                                                                           cuda_cflags=["-Xcompiler", "-wrapper"]))
    refused = build_project(tree, nvcc, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not refused.ok and "build.cuda_cflags[0] '-Xcompiler'" in refused.error and no_compiler_runs == []


def test_a_variant_flag_that_skipped_validation_is_refused_before_the_tree_s_commands_run(tmp_path: Path) -> None:
    """A command build with a variant: its flags would reach the tree's commands as CFLAGS. Nothing
    is built: the build cache folder is not even made."""
    tree = tmp_path / "tree"
    tree.mkdir()
    config = ProjectConfig(build=BuildConfig(kind="command", library="out.txt",
                                             commands=["sh -c 'echo built > out.txt'"]))
    variant = BuildVariant.model_construct(compiler=None, cflags=("-B.",), cuda_cflags=(), cuda_archs=None)
    result = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[], variant=variant)
    assert not result.ok and result.digest == "" and not (tmp_path / "cache").exists()
    assert result.error.startswith("build variant.cflags[0] '-B.' is not an allowed compiler flag"), result.error
    # The same build with an allowed variant flag runs: the refusal above is the flag's, not the setup's.
    allowed = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[],
                            variant=BuildVariant(cflags=("-O2",)))
    assert allowed.ok and (tmp_path / "cache").exists(), allowed.error
