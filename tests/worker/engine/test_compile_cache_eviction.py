"""The compile cache's cap (worker/engine/compile_cache.py, OPTDRIFT_COMPILE_CACHE_MAX_BYTES): least
recently used digest folders go first, a folder in use (its lock held, by this process or another
worker's) never does. Real folders, real flocks, a second real process; no torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from service.settings import Settings
from worker.build.cache import folder_bytes
from worker.engine import compile_cache

ROOT = Path(__file__).resolve().parents[3]
MIB = 1024 * 1024


def _fill(root: Path, digest: str, size: int, used_at: float) -> Path:
    """A digest folder as a trusted host leaves it (one compiled file of `size` bytes), last used at
    `used_at` (seconds since the epoch), and not held by anyone."""
    cache = compile_cache.for_build(root, digest, trusted=True)
    (cache.folder / "cpu-env" / "fxgraph").mkdir(parents=True)
    (cache.folder / "cpu-env" / "fxgraph" / "entry").write_bytes(b"x" * size)
    cache._hold.close()  # let go without release(): release() would mark it used now
    os.utime(cache.folder, (used_at, used_at))
    return cache.folder


def _digests(root: Path) -> set[str]:
    return {p.name for p in (root / compile_cache.FOLDER).iterdir() if not p.name.startswith(".")}


def test_least_recently_used_go_first_down_to_the_cap(tmp_path: Path):
    now = time.time()
    for age, digest in enumerate(("newest", "middle", "oldest")):
        _fill(tmp_path, digest, MIB, now - 3600 * (age + 1))
    each = folder_bytes(tmp_path / compile_cache.FOLDER / "oldest")
    assert MIB < each < MIB + 8192  # the file plus a little per folder and file (ENTRY_BYTES)

    # Room for two of the three: the oldest goes, nothing else.
    assert compile_cache.evict(tmp_path, 2 * each) == ["oldest"]
    assert _digests(tmp_path) == {"newest", "middle"}
    # Under the cap already: nothing goes.
    assert compile_cache.evict(tmp_path, 2 * each) == []
    # Taking a new build's cache evicts down to the cap, the least recently used first; the new
    # folder (in use, and most recent) stays though the cap cannot hold even it and one other.
    taken = compile_cache.for_build(tmp_path, "fresh", trusted=True, max_bytes=each)
    assert _digests(tmp_path) == {"newest", "fresh"}
    taken.release()
    assert not list((tmp_path / compile_cache.FOLDER).glob(f"{compile_cache.EVICTED}*"))  # removed, not left renamed
    # A build whose folder exists (a warm run) does not walk the cache, taking or releasing it; the
    # next new build's folder brings the cap back.
    compile_cache.for_build(tmp_path, "newest", trusted=True, max_bytes=1).release()
    assert _digests(tmp_path) == {"newest", "fresh"}
    compile_cache.for_build(tmp_path, "next", trusted=True, max_bytes=1).release()
    assert "newest" not in _digests(tmp_path) and "next" in _digests(tmp_path)


def test_a_folder_in_use_is_never_evicted(tmp_path: Path):
    now = time.time()
    _fill(tmp_path, "held", MIB, now - 7200)
    _fill(tmp_path, "idle", MIB, now - 3600)
    held = compile_cache.for_build(tmp_path, "held", trusted=False)  # a verify run's host reads it
    os.utime(held.folder, (now - 7200, now - 7200))  # still the least recently used
    assert compile_cache.evict(tmp_path, 0) == ["idle"]
    assert _digests(tmp_path) == {"held"}
    held.release()
    assert compile_cache.evict(tmp_path, 0) == ["held"]
    held.release()  # twice: nothing


def test_another_workers_folder_in_use_is_kept_until_its_process_lets_go(tmp_path: Path):
    """Two workers on one machine share the build cache: one's eviction must not pull a cache from
    under the other's hosts. The other worker is a real second process holding its cache."""
    _fill(tmp_path, "theirs", MIB, time.time() - 3600)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from worker.engine import compile_cache; "
         "c = compile_cache.for_build(Path(sys.argv[1]), 'theirs', trusted=True); print('held', flush=True); "
         "sys.stdin.readline()", str(tmp_path)],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        mine = compile_cache.for_build(tmp_path, "mine", trusted=True, max_bytes=1)
        (mine.folder / "compiled").write_bytes(b"x" * MIB)  # what its host compiled
        assert _digests(tmp_path) == {"theirs", "mine"}  # theirs in use there, mine in use here
        mine.release()
        assert _digests(tmp_path) == {"theirs", "mine"}  # release keeps its own (still held while it evicts)
    finally:
        holder.stdin.close()  # the holder exits; the kernel drops its flock
        holder.wait(timeout=30)
    assert sorted(compile_cache.evict(tmp_path, 0)) == ["mine", "theirs"]


def test_taking_a_digest_while_it_is_evicted_gets_a_fresh_folder_and_a_live_lock(tmp_path: Path):
    """The race: a taker opens the digest's lock while an eviction holds it exclusively, renames
    the folder out and unlinks the lock. The taker must end up holding the lock file now at that
    path (or a third worker's eviction would see it free) and a folder that exists."""
    folder = _fill(tmp_path, "contended", MIB, time.time() - 3600)
    lock_path = tmp_path / compile_cache.FOLDER / compile_cache.LOCKS / "contended.lock"
    evicting = compile_cache._try_exclusive(lock_path)
    assert evicting is not None
    taken: list = []
    taker = threading.Thread(target=lambda: taken.append(compile_cache.for_build(tmp_path, "contended", trusted=True)))
    taker.start()
    time.sleep(0.3)
    assert taker.is_alive()  # waiting for the eviction
    os.rename(folder, folder.with_name(compile_cache.EVICTED + "contended-test"))
    lock_path.unlink()
    evicting.close()
    taker.join(timeout=10)
    (cache,) = taken
    assert cache.folder.is_dir() and not any(cache.folder.iterdir())  # compiled from cold again
    assert os.fstat(cache._hold.fileno()).st_ino == os.stat(lock_path).st_ino
    assert compile_cache.evict(tmp_path, 0) == []  # held: the leftover rename is all that goes
    assert _digests(tmp_path) == {"contended"}
    cache.release()


def test_a_verify_run_reads_a_folder_without_prolonging_its_life(tmp_path: Path):
    long_ago = time.time() - 86400
    folder = _fill(tmp_path, "read", MIB, long_ago)
    compile_cache.for_build(tmp_path, "read", trusted=False).release()
    assert folder.stat().st_mtime == long_ago
    compile_cache.for_build(tmp_path, "read", trusted=True).release()
    assert folder.stat().st_mtime > long_ago + 3600


def test_the_cap_is_a_setting_and_reaches_every_run_s_policy(tmp_path: Path, monkeypatch):
    assert Settings().compile_cache_max_bytes == 20 * 1024 ** 3
    monkeypatch.setenv("OPTDRIFT_COMPILE_CACHE_MAX_BYTES", "12345")
    settings = Settings(home=tmp_path)
    assert settings.compile_cache_max_bytes == 12345
    from worker import pipeline
    from worker.jobs.workspace import Workspace

    with Workspace(settings, prefix="cap-") as workspace:
        policy = workspace.policy(untrusted=False, environment="cpu")
    assert policy.compile_cache_max_bytes == 12345
    cache = pipeline.compile_cache_for("d" * 64, policy)
    assert cache.max_bytes == 12345 and cache.folder.parent.parent == settings.resolved_build_cache_dir.resolve()
    cache.release()
    assert pipeline.compile_cache_for(None, policy) is None
    # Names that are not one plain path component, or that are the cache's own dot-names: no cache.
    for bad in ("../x", ".locks", ".evict.lock", "a/b", ""):
        assert compile_cache.for_build(tmp_path, bad, trusted=True) is None
