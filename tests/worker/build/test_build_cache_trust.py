"""Trust and disk in the build cache (issue 33 items 6 and 7), with real sandboxed builds.

A verify run's build (untrusted) must never be served to a trusted run: it is built into a private
folder under <cache>/verify, deleted when its run's task ends, and refused past its size cap. The
trusted cache is kept under its total, least recently used first, never evicting an entry in use.
The builds are small `command` builds (shell commands in bubblewrap), and one tiny extension.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from service.core.project_config import parse_config
from worker.build import cache as build_cache
from worker.build.cache import LAST_USED, MANIFEST, VERIFY_FOLDER, folder_bytes, release_builds
from worker.build.extension import BOX_FOLDER, build_extension
from worker.build.project import build_project

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = REPO_ROOT / "tests" / "fixtures" / "tiny_ext"

# Every build writes something no other build writes: a build served from another's entry shows it.
UNIQUE_OUTPUT = ('[build]\nkind="command"\nlibrary="out.txt"\n'
                 'commands=["sh -c \'echo $(date +%s%N)-$$ > out.txt\'"]\n')


@pytest.fixture(autouse=True)
def _nothing_held_between_tests():
    release_builds()
    yield
    release_builds()


def _tree(tmp_path: Path, name: str, payload: str = "") -> Path:
    tree = tmp_path / name
    tree.mkdir()
    (tree / "payload.txt").write_text(payload or name)
    return tree


def _build(tree: Path, cache: Path, config_text: str = UNIQUE_OUTPUT, *, trusted: bool = True):
    return build_project(tree, parse_config(config_text), cache_dir=cache, cuda_archs=[], trusted=trusted)


# --- item 6: a verify build never reaches a trusted run ---

def test_a_verify_build_is_never_served_to_a_later_trusted_build_of_the_same_tree(tmp_path: Path):
    cache, tree = tmp_path / "cache", _tree(tmp_path, "tree")
    untrusted = _build(tree, cache, trusted=False)
    assert untrusted.ok and not untrusted.cached, untrusted.error
    assert Path(untrusted.library_path).is_relative_to(cache / VERIFY_FOLDER)

    trusted = _build(tree, cache)
    assert trusted.ok and not trusted.cached, "the trusted build took the verify build's output"
    assert trusted.digest == untrusted.digest
    assert Path(trusted.library_path).is_relative_to(cache / "command")
    assert Path(trusted.library_path).read_text() != Path(untrusted.library_path).read_text()
    # And the next trusted build is a hit on the trusted entry.
    again = _build(tree, cache)
    assert again.cached and again.library_path == trusted.library_path


def test_a_verify_build_reads_a_trusted_entry_and_writes_nothing_to_it(tmp_path: Path):
    cache, tree = tmp_path / "cache", _tree(tmp_path, "tree")
    trusted = _build(tree, cache)
    assert trusted.ok, trusted.error
    entry = Path(trusted.library_path).parents[1]
    before = {p: p.stat().st_mtime_ns for p in entry.rglob("*")}

    untrusted = _build(tree, cache, trusted=False)
    assert untrusted.cached and untrusted.library_path == trusted.library_path
    assert {p: p.stat().st_mtime_ns for p in entry.rglob("*")} == before, "the verify run marked the entry"
    assert not list((cache / VERIFY_FOLDER).glob("*/"))


def test_an_entry_from_before_trust_was_recorded_is_not_served(tmp_path: Path):
    """A cache filled by the old code holds verify builds beside trusted ones, indistinguishably:
    a trusted lookup takes only an entry whose manifest says it is trusted."""
    cache, tree = tmp_path / "cache", _tree(tmp_path, "tree")
    first = _build(tree, cache)
    manifest = Path(first.library_path).parents[1] / MANIFEST
    manifest.write_text(manifest.read_text().replace('"trust": "trusted"', '"trust": "unknown"'))
    release_builds()
    rebuilt = _build(tree, cache)
    assert rebuilt.ok and not rebuilt.cached
    assert Path(rebuilt.library_path).read_text() != "", rebuilt


@pytest.mark.slow
def test_a_verify_extension_build_is_never_served_to_a_trusted_one(tmp_path: Path):
    cache, source = tmp_path / "cache", tmp_path / "tiny"
    shutil.copytree(TINY, source)
    untrusted = build_extension(source, cache_dir=cache, cuda_archs=[], trusted=False)
    assert untrusted.ok and not untrusted.cached, untrusted.error
    assert Path(untrusted.library_path).is_relative_to(cache / VERIFY_FOLDER)
    trusted = build_extension(source, cache_dir=cache, cuda_archs=[])
    assert trusted.ok and not trusted.cached and trusted.digest == untrusted.digest
    # The library lies in the entry's box folder (worker.build.extension BOX_FOLDER), beside which
    # the worker keeps the log and manifest.
    assert Path(trusted.library_path).parent == cache / trusted.digest / BOX_FOLDER
    assert release_builds() == [Path(untrusted.library_path).parents[1]]
    assert not Path(untrusted.library_path).exists() and Path(trusted.library_path).exists()


# --- item 7: verify builds do not stay, and nothing grows without bound ---

def test_verify_build_folders_are_gone_when_the_task_ends(tmp_path: Path):
    from celery.signals import task_postrun

    from worker.tasks import execute_run_task

    cache = tmp_path / "cache"
    built = _build(_tree(tmp_path, "good"), cache, trusted=False)
    failed = _build(_tree(tmp_path, "bad"), cache, '[build]\nkind="command"\nlibrary="x"\ncommands=["false"]\n',
                    trusted=False)
    assert built.ok and not failed.ok
    folders = [Path(built.library_path).parents[1], Path(failed.log_path).parent]
    assert all(folder.is_dir() and folder.parent == cache / VERIFY_FOLDER for folder in folders)

    # What a Celery worker sends when a task (a run, a co-run, a timing) has returned.
    task_postrun.send(sender=execute_run_task, task_id="t", task=execute_run_task, args=(1,), kwargs={},
                      retval="done", state="SUCCESS")
    assert not [p for p in (cache / VERIFY_FOLDER).iterdir() if p.name != "locks"]
    assert not list((cache / VERIFY_FOLDER / "locks").iterdir())


def test_a_verify_build_left_by_a_dead_process_goes_with_the_next_verify_build(tmp_path: Path):
    cache = tmp_path / "cache"
    tree = _tree(tmp_path, "left")
    script = ("import sys; from pathlib import Path; from service.core.project_config import parse_config; "
              "from worker.build.project import build_project; "
              f"r = build_project(Path({str(tree)!r}), parse_config({UNIQUE_OUTPUT!r}), cache_dir=Path({str(cache)!r}), "
              "cuda_archs=[], trusted=False); assert r.ok, r.error; print(r.library_path)")
    left = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    left_folder = Path(left.stdout.strip().splitlines()[-1]).parents[1]
    assert left_folder.is_dir(), "the dead process's build should still be there before the sweep"

    mine = _build(_tree(tmp_path, "mine"), cache, trusted=False)
    assert mine.ok and not left_folder.exists()
    assert Path(mine.library_path).exists(), "a build in use (its lock held) is never swept"


def _sized(tmp_path: Path, name: str, kib: int) -> tuple[Path, str]:
    return _tree(tmp_path, name), ('[build]\nkind="command"\nlibrary="out.bin"\n'
                                   f'commands=["sh -c \'head -c {kib * 1024} /dev/zero > out.bin\'"]\n')


def test_eviction_keeps_the_trusted_cache_under_its_cap_least_recently_used_first_never_one_in_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "cache"
    entries = {name: _sized(tmp_path, name, 200) for name in "ABCD"}
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE_MAX_BYTES", str(450 * 1024))  # two entries, not three

    def build(name: str):
        tree, config = entries[name]
        result = _build(tree, cache, config)
        assert result.ok, result.error
        release_builds()  # the run that used it is over
        time.sleep(0.05)  # distinct last-use times
        return Path(result.library_path).parents[1], result

    a, _ = build("A")
    b, _ = build("B")
    assert a.is_dir() and b.is_dir()
    _, hit = build("A")  # a hit: A is now used more recently than B
    assert hit.cached
    c, _ = build("C")
    assert a.is_dir() and c.is_dir() and not b.exists(), "B, the least recently used, should have gone"
    assert sum(folder_bytes(p) for p in (cache / "command").glob("*") if (p / MANIFEST).exists()) <= 450 * 1024

    # A is now the least recently used; a run elsewhere holds it (its lock, shared): C goes instead.
    assert (a / LAST_USED).stat().st_mtime < (c / LAST_USED).stat().st_mtime
    with open(cache / "command" / "locks" / f"{a.name}.lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_SH)
        d, _ = build("D")
    assert a.is_dir() and d.is_dir() and not c.exists()


def test_an_entry_this_process_is_using_is_not_evicted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("OPTDRIFT_BUILD_CACHE_MAX_BYTES", str(250 * 1024))  # one entry
    tree, config = _sized(tmp_path, "A", 200)
    first = _build(tree, cache, config)  # held until release_builds(): its run is not over
    tree, config = _sized(tmp_path, "B", 200)
    second = _build(tree, cache, config)
    assert Path(first.library_path).exists() and Path(second.library_path).exists()
    release_builds()
    tree, config = _sized(tmp_path, "C", 200)
    third = _build(tree, cache, config)
    assert Path(third.library_path).exists()
    assert not Path(first.library_path).exists() and not Path(second.library_path).exists()


def test_a_verify_build_writing_more_than_its_cap_is_refused_and_removed(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPTDRIFT_VERIFY_BUILD_MAX_BYTES", str(1024 * 1024))
    cache = tmp_path / "cache"
    # Many files, each well under any per-file limit, 4 MB in all; the build succeeds.
    many = ('[build]\nkind="command"\nlibrary="out.txt"\ncommands=["sh -c \'for i in $(seq 1 40); do '
            'head -c 100000 /dev/zero > f$i; done; echo ok > out.txt\'"]\n')
    tree = _tree(tmp_path, "many")
    result = _build(tree, cache, many, trusted=False)
    assert not result.ok and "OPTDRIFT_VERIFY_BUILD_MAX_BYTES" in result.error, result
    folder = Path(result.log_path).parent
    assert [p.name for p in folder.iterdir()] == ["build.log"]
    # The same build is trusted elsewhere (a commit run): no such cap, the cache's total applies.
    assert _build(tree, cache, many).ok


def test_a_verify_build_that_keeps_writing_is_stopped_while_it_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OPTDRIFT_VERIFY_BUILD_MAX_BYTES", str(2 * 1024 * 1024))
    endless = ('[build]\nkind="command"\nlibrary="out.txt"\ntimeout_s=120\ncommands=["sh -c \'i=0; while true; '
               'do i=$((i+1)); head -c 200000 /dev/zero > f$i; done\'"]\n')
    started = time.monotonic()
    result = _build(_tree(tmp_path, "endless"), tmp_path / "cache", endless, trusted=False)
    assert not result.ok and "OPTDRIFT_VERIFY_BUILD_MAX_BYTES" in result.error, result
    assert time.monotonic() - started < 30, "the build ran on past its cap"
    assert [p.name for p in Path(result.log_path).parent.iterdir()] == ["build.log"]


@pytest.mark.parametrize("variable", ["OPTDRIFT_BUILD_CACHE_MAX_BYTES", "OPTDRIFT_VERIFY_BUILD_MAX_BYTES"])
def test_a_cap_that_is_not_a_number_of_bytes_is_a_clear_error(variable: str, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(variable, "20GB")
    reader = (build_cache.build_cache_max_bytes if variable.startswith("OPTDRIFT_BUILD")
              else build_cache.verify_build_max_bytes)
    with pytest.raises(ValueError, match=f"{variable}='20GB' is not a positive whole number of bytes"):
        reader()
    monkeypatch.delenv(variable)
    assert reader() > 0


def test_a_build_folder_left_unreadable_is_measured_and_removed(tmp_path: Path):
    folder = tmp_path / "f"
    (folder / "hidden").mkdir(parents=True)
    (folder / "hidden" / "big").write_bytes(b"x" * 100_000)
    (folder / "hidden").chmod(0)
    assert folder_bytes(folder) >= 100_000
    (folder / "hidden").chmod(0)
    build_cache.remove_tree(folder)
    assert not folder.exists()
