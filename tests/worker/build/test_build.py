"""The digest-keyed build cache: hits, concurrency, killed builds, compiler errors.

These use a tiny extension (tests/fixtures/tiny_ext) so they cost one small compile each; the
mechanics are the same for csrc.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import processes
from worker.build import build_digest, build_extension, compiler_message

REPO_ROOT = Path(__file__).resolve().parents[3]
TINY = REPO_ROOT / "tests" / "fixtures" / "tiny_ext"

pytestmark = pytest.mark.slow


@pytest.fixture
def tiny_source(tmp_path: Path) -> Path:
    source = tmp_path / "tiny"
    shutil.copytree(TINY, source)
    return source


def test_second_build_is_a_cache_hit_that_compiles_nothing(tiny_source: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    first = build_extension(tiny_source, cache_dir=cache, cuda_archs=[])
    assert first.ok and not first.cached, first.error
    library = Path(first.library_path)
    mtime = library.stat().st_mtime_ns

    second = build_extension(tiny_source, cache_dir=cache, cuda_archs=[])
    assert second.cached and second.ok
    assert second.library_path == first.library_path
    assert library.stat().st_mtime_ns == mtime  # nothing was rewritten
    assert f"optdrift_kernels_{first.digest[:16]}" in library.name

    # The library is usable: load it in a fresh process and call its op.
    code = (
        "import torch, sys; torch.ops.load_library(sys.argv[1]); x = torch.ones(3);"
        "torch.ops.optdrift_tiny.scale_(x, 2.5); assert x.tolist() == [2.5] * 3"
    )
    subprocess.run([sys.executable, "-c", code, first.library_path], check=True)


def test_digest_follows_sources_flags_and_archs_but_not_other_files(tiny_source: Path):
    base = build_digest(tiny_source, cuda_archs=[])
    (tiny_source / "README.txt").write_text("not a kernel source")
    assert build_digest(tiny_source, cuda_archs=[]) == base
    assert build_digest(tiny_source, cuda_archs=["9.0"]) != base
    assert build_digest(tiny_source, cuda_archs=[], extra_cflags=("-O2",)) != base
    source = tiny_source / "cpu" / "scale.cpp"
    source.write_text(source.read_text() + "\n// a comment is a different source\n")
    assert build_digest(tiny_source, cuda_archs=[]) != base


def _build_in_subprocess(source: Path, cache: Path) -> subprocess.Popen:
    code = (
        "import sys, json; from pathlib import Path; from worker.build import build_extension;"
        "r = build_extension(Path(sys.argv[1]), cache_dir=Path(sys.argv[2]), cuda_archs=[]);"
        "print(r.model_dump_json())"
    )
    return subprocess.Popen([sys.executable, "-c", code, str(source), str(cache)],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)


def test_concurrent_requests_for_one_key_build_once(tiny_source: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    builders = [_build_in_subprocess(tiny_source, cache) for _ in range(3)]
    results = [json.loads(b.communicate(timeout=600)[0]) for b in builders]
    assert all(r["ok"] for r in results)
    assert sorted(r["cached"] for r in results) == [False, True, True]
    assert len({r["library_path"] for r in results}) == 1


def test_a_killed_build_leaves_no_lock_that_hangs_the_next(tiny_source: Path, tmp_path: Path):
    cache = tmp_path / "cache"
    victim = _build_in_subprocess(tiny_source, cache)
    deadline = time.monotonic() + 120
    while not list(cache.glob("*.staging-*")):  # it holds the lock and is compiling
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.1)
    # Kill it once a compiler runs (the victim and its build child mention the cache folder too).
    processes.wait_for(str(cache), 3, timeout_s=max(0.0, deadline - time.monotonic()))
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    killed_at = time.monotonic()
    assert processes.wait_gone(str(cache), timeout_s=120) == [], "compilers outlived the killed build by 120 s"
    gone_s = time.monotonic() - killed_at

    started = time.monotonic()
    result = build_extension(tiny_source, cache_dir=cache, cuda_archs=[], timeout_s=300)
    rebuild_s = time.monotonic() - started
    assert result.ok and not result.cached, result.error
    assert rebuild_s < 300
    # ninja and the compilers (grandchildren of the killed process) go with it (worker.sandbox.group_guard):
    # gone in a fraction of the time the same build takes at this moment's load, where an orphaned
    # compiler would have lived until its compile ended (a fixed 2 s window failed on a loaded machine).
    assert gone_s < 0.5 * rebuild_s, f"compilers outlived the killed build: gone {gone_s:.1f} s after the kill, " \
                                     f"the same build takes {rebuild_s:.1f} s"
    assert not list(cache.glob("*.staging-*")), "the abandoned staging folder was not cleaned up"


def test_compile_error_is_a_structured_failure_with_the_compilers_message(tiny_source: Path, tmp_path: Path):
    source = tiny_source / "cpu" / "scale.cpp"
    source.write_text(source.read_text().replace("x.mul_(factor);", "x.mul_(factor) undeclared_thing;"))
    result = build_extension(tiny_source, cache_dir=tmp_path / "cache", cuda_archs=[])
    assert not result.ok
    assert result.library_path is None
    assert "scale.cpp" in result.error and "error" in result.error
    assert "Traceback" not in result.error
    log = Path(result.log_path).read_text()
    assert "undeclared_thing" in log  # the full log is kept
    # A failure is not cached: the corrected source builds.
    source.write_text(source.read_text().replace(" undeclared_thing;", ";"))
    assert build_extension(tiny_source, cache_dir=tmp_path / "cache", cuda_archs=[]).ok


def test_build_timeout_stops_the_compiler_and_says_so(tiny_source: Path, tmp_path: Path):
    result = build_extension(tiny_source, cache_dir=tmp_path / "cache", cuda_archs=[], timeout_s=1)
    assert not result.ok
    assert "longer than 1 s" in result.error


def test_missing_source_folder_is_a_clear_error(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_extension(tmp_path / "nope", cache_dir=tmp_path / "cache", cuda_archs=[])


def test_compiler_message_keeps_errors_and_drops_tracebacks():
    log = "\n".join([
        "[1/2] c++ -c foo.cpp",
        "foo.cpp:3:5: error: expected ';' before 'x'",
        "    3 | int y x;",
        "Traceback (most recent call last):",
        '  File "/x/cpp_extension.py", line 1, in _run_ninja_build',
        "RuntimeError: Error building extension",
    ])
    message = compiler_message(log)
    assert "foo.cpp:3:5: error" in message and "int y x" in message
    assert "Traceback" not in message and "cpp_extension.py" not in message


def test_a_digest_is_the_same_whether_or_not_torch_is_imported(tiny_source: Path):
    """worker.build.extension.torch_versions reads torch's version.py in a process that has not
    imported torch (a check's or a Celery worker's parent: 2-5 s saved): the digest must be the one
    made from the imported torch, or a cached build would be missed, or worse, shared across
    torch versions. Made in a fresh process that imports no torch, then here, where torch is."""
    import torch

    from worker.build.extension import build_digest, torch_versions

    script = ("import sys; from pathlib import Path; from worker.build.extension import build_digest, torch_versions; "
              f"print(torch_versions()); print(build_digest(Path({str(tiny_source)!r}), cuda_archs=[])); "
              f"print(build_digest(Path({str(tiny_source)!r}), cuda_archs=['9.0'])); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[3]).stdout.splitlines()
    assert out[3] == "False"  # the fresh process never imported torch
    assert out[0] == repr((str(torch.__version__), torch.version.cuda)) == repr(torch_versions())
    assert out[1] == build_digest(tiny_source, cuda_archs=[])
    assert out[2] == build_digest(tiny_source, cuda_archs=["9.0"])
