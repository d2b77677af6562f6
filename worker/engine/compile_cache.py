"""The kernel hosts' persistent compile cache: a `torch.compile`-based library compiles once per
build and environment, not once per host.

A host's HOME and TMPDIR are a scratch folder removed when it closes (worker.sandbox.Scratch), and
inductor keeps its FX graph cache, its AOTAutograd cache and the code it generates (C++ and Triton
sources, the shared objects built from them) under TORCHINDUCTOR_CACHE_DIR, by default a folder of
TMPDIR; Triton keeps its kernels under TRITON_CACHE_DIR. So every host compiled every graph from
cold. Here both point into one folder per build and environment:

    <build cache root>/compile/<build digest>/<environment class_key>

The worker binds `<build cache root>/compile/<build digest>` into the box (the environment is the
host's own fingerprint, known inside it: `use_in_host` picks the sub-folder):

- read-write for a trusted host (a commit run, a baseline, `optdrift check`): what it compiles is
  kept for the next host of the same build;
- read-only for an untrusted one (a verify run): its code must not plant compiled artifacts that a
  trusted host would load (the build cache's rule, docs/security/SUPPLY.md). The host copies the folder
  into its scratch and compiles there: it reads what trusted hosts compiled, and what it adds goes
  with its scratch.

A spare host (worker.engine.host_reserve) is boxed before its build is known: at adoption the
folder is linked into its read-only slot and the host compiles into a copy in its scratch, as an
untrusted host does. For trusted work the worker then keeps what it added (`keep_new_entries`, when
the host closes): the scratch copy's new regular files go into the build's folder, never replacing
one that is there (a trusted host's files are what a trusted bind would have let it write).

The cache's entries are keyed by inductor itself on the graph, the torch version and the
configuration; the build digest in the path keeps one build's compiled library code from ever
being served to another build, and the class_key keeps CPU ISA / GPU classes apart.

Every kernel host of a build gets it: a run's and a baseline's (worker.pipeline), the co-run's
two (worker.jobs.corun, worker.engine.corun), the attribution's two (worker.attribution.pair_run)
and the timing's (worker.speed.record), in the service and in `optdrift check` alike.

Disk. The digest folders together are kept under a cap (OPTDRIFT_COMPILE_CACHE_MAX_BYTES,
service.settings, handed in as `max_bytes`): when a new build's folder is made and again when a
trusted use that made it is released, the least recently used digest folders go first (`evict`).
A build whose folder exists (a warm run) does not walk the cache: only a new build brings a cold
compile's worth of files, and it pays the walk beside its compile. A folder in use is
never evicted: `for_build` holds a shared flock on `<root>/compile/.locks/<digest>.lock` until
`release()` (or until the CompileCache is dropped), and eviction takes only folders whose lock it
can hold exclusively, so two workers on one machine never pull a cache from under each other's
hosts. A folder's last use is its mtime, set when a trusted run takes or releases it (a verify run
reads a folder without prolonging its life, as with the build cache).

No torch here at import: the parent (worker.pipeline, KernelHost) only names folders.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from worker.sandbox import boxfiles

FOLDER = "compile"  # <build cache root>/compile
SCRATCH_COPY = "compile-cache"  # an untrusted host's copy, in its scratch
LOCKS = ".locks"  # <root>/compile/.locks/<digest>.lock: held shared while a digest's cache is in use
EVICTING = ".evict.lock"  # one eviction at a time per cache root
EVICTED = ".evicted-"  # <root>/compile/.evicted-<digest>-<random>: renamed out, being removed
# A digest is one path component that is never one of the names above (they start with a dot).
_DIGEST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# How long taking a digest's lock waits for an eviction of that digest (a rename) to finish.
LOCK_WAIT_S = 60.0


@dataclass(frozen=True)
class CompileCache:
    """One build's compile cache as a host is given it: `folder` is bound into the box,
    read-write when `writable`, else read-only. While it is held (until `release()`) its folder is
    in use and never evicted."""

    folder: Path
    writable: bool
    max_bytes: int | None = None  # the cap `release()` evicts to (None: no cap)
    created: bool = False  # this use made the folder (a new build): it evicts
    _hold: IO | None = field(default=None, compare=False, repr=False)

    def host_arguments(self) -> list[str]:
        return ["--compile-cache", str(self.folder), *([] if self.writable else ["--compile-cache-read-only"])]

    def release(self) -> None:
        """This use is over (its hosts are closed): a trusted use marks the folder used and evicts
        down to the cap (its own folder, still held, is kept), then the hold is let go. Again: nothing."""
        if self._hold is None or self._hold.closed:
            return
        try:
            if self.writable:
                _mark_used(self.folder)
                if self.max_bytes is not None and self.created:
                    evict(self.folder.parent.parent, self.max_bytes)
        finally:
            self._hold.close()


def for_build(cache_root: Path | None, build_digest: str | None, *, trusted: bool,
              max_bytes: int | None = None) -> CompileCache | None:
    """The compile cache of the build `build_digest` under `cache_root` (the build cache's root), made
    when missing and held in use until its `release()`; None without a digest (a failed or
    digest-less build: nothing to key it by). `max_bytes`: the cap on all digests' folders
    (OPTDRIFT_COMPILE_CACHE_MAX_BYTES): when the folder is new, the least recently used others are
    evicted down to it now, and again when a trusted use is released."""
    if cache_root is None or not build_digest or not _DIGEST.fullmatch(build_digest):
        return None
    compile_root = Path(cache_root) / FOLDER
    hold = _hold_shared(compile_root / LOCKS / f"{build_digest}.lock")
    try:
        folder = compile_root / build_digest
        created = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True)
        os.chmod(folder, 0o755)  # the sandbox user reads it (a verify host, which is not handed it)
        if trusted:
            _mark_used(folder)
        if max_bytes is not None and created:
            evict(Path(cache_root), max_bytes)
    except BaseException:
        hold.close()
        raise
    return CompileCache(folder=folder.resolve(), writable=trusted, max_bytes=max_bytes, created=created, _hold=hold)


def release(*caches: CompileCache | None) -> None:
    """`release()` each of `caches` that is one (a caller's finally: some may be None)."""
    for cache in caches:
        if cache is not None:
            cache.release()


def evict(cache_root: Path, max_bytes: int) -> list[str]:
    """Delete the least recently used digest folders under `<cache_root>/compile` until they take at
    most `max_bytes` in all (worker.build.cache.folder_bytes: file sizes plus a little per entry);
    a folder whose lock someone holds (a host of that build may be using it) is skipped. Returns the
    digests evicted. One eviction at a time per root; each folder is renamed out while its lock is
    held, then removed with no lock held (a taker of that digest waits for the rename alone)."""
    from worker.build.cache import folder_bytes, remove_tree  # the worker's; never imported in a box

    compile_root = Path(cache_root) / FOLDER
    if not compile_root.is_dir():
        return []
    evicted: list[str] = []
    doomed: list[Path] = []
    with open(compile_root / EVICTING, "a+") as serial:
        fcntl.flock(serial, fcntl.LOCK_EX)
        doomed += [p for p in compile_root.glob(f"{EVICTED}*")]  # a removal cut short before
        folders = []
        for folder in compile_root.iterdir():
            if folder.name.startswith(".") or not folder.is_dir() or folder.is_symlink():
                continue
            try:
                folders.append((folder.stat().st_mtime, folder_bytes(folder), folder))
            except OSError:
                continue
        total = sum(size for _, size, _ in folders)
        for _used, size, folder in sorted(folders, key=lambda f: (f[0], f[2].name)):
            if total <= max_bytes:
                break
            lock_path = compile_root / LOCKS / f"{folder.name}.lock"
            handle = _try_exclusive(lock_path)
            if handle is None:
                continue  # in use
            try:
                target = compile_root / f"{EVICTED}{folder.name}-{uuid.uuid4().hex[:8]}"
                os.rename(folder, target)
                lock_path.unlink(missing_ok=True)  # a waiter on this inode takes a fresh one (_hold_shared)
                doomed.append(target)
                evicted.append(folder.name)
                total -= size
            except OSError:
                continue
            finally:
                handle.close()
    for target in doomed:
        remove_tree(target)
    return evicted


def _mark_used(folder: Path) -> None:
    try:
        os.utime(folder)
    except OSError:
        pass


def _hold_shared(lock_path: Path) -> IO:
    """`lock_path` opened and held shared: waits out an eviction of its digest (which holds it
    exclusively, then unlinks it); a lock taken on an unlinked file is taken again on the new one."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        handle = open(lock_path, "a+")
        try:
            while True:
                try:
                    fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the compile cache's lock {lock_path} was held for "
                                           f"{LOCK_WAIT_S:.0f} s by an eviction") from None
                    time.sleep(0.05)
            try:
                same = os.stat(lock_path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                same = False
        except BaseException:
            handle.close()
            raise
        if same:
            return handle
        handle.close()


def _try_exclusive(lock_path: Path) -> IO | None:
    """`lock_path` held exclusively, or None when someone holds it (shared: in use)."""
    try:
        handle = open(lock_path, "a+")
    except OSError:
        return None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def environment_folder_name(class_key: str) -> str:
    """The class_key as one path component."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", class_key).strip("-.") or "environment"


def use_in_host(bound: str | Path, *, writable: bool, class_key: str, scratch: str | Path) -> Path:
    """In the host, before any compile: point inductor and Triton at this environment's folder of
    the bound cache (`writable`), or at a copy of it in `scratch` (read-only: an untrusted host or a
    spare). Returns the folder they now use."""
    folder = Path(bound) / environment_folder_name(class_key)
    if writable:
        folder.mkdir(exist_ok=True)
        target = folder
    else:
        target = Path(scratch) / SCRATCH_COPY
        if folder.is_dir():
            shutil.copytree(folder, target, symlinks=True, dirs_exist_ok=True)
        target.mkdir(exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(target)
    os.environ["TRITON_CACHE_DIR"] = str(target / "triton")
    # The local caches are on by default; said here so that the cache does what this module says
    # whatever a later torch defaults to.
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1"
    os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "1"
    if "torch._inductor.config" in sys.modules:  # imported already (an adapter's import): set it too
        import torch._functorch.config
        import torch._inductor.config

        torch._inductor.config.fx_graph_cache = True
        torch._functorch.config.enable_autograd_cache = True
    return target


# One compiled artefact of inductor's caches is kilobytes to a few MB; a larger file in a host's
# scratch copy is not taken.
MAX_ENTRY_FILE_BYTES = 256 * 1024 * 1024


def keep_new_entries(copy: Path, cache: CompileCache, class_key: str) -> int:
    """A trusted spare's scratch copy (`copy`) merged into `cache`'s folder for its environment:
    regular files not there yet, each written beside its place and renamed in (a reader never sees
    half a file); links and special files are left out. Returns how many files were added."""
    if not cache.writable or not copy.is_dir():
        return 0
    target = cache.folder / environment_folder_name(class_key)
    added = 0
    for folder, _subfolders, files in os.walk(copy):
        relative = Path(folder).relative_to(copy)
        here = target / relative
        for name in files:
            destination = here / name
            if destination.exists():
                continue
            here.mkdir(parents=True, exist_ok=True)
            # The scratch copy is the host's: taken through worker.sandbox.boxfiles (no link
            # followed, no FIFO opened, bounded), written beside its place and renamed in.
            try:
                if boxfiles.copy_out(copy, relative / name, destination, max_bytes=MAX_ENTRY_FILE_BYTES):
                    added += 1
            except boxfiles.BoxFileRefused:
                continue
    return added


def hit_counts() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd cache counters in this process (hits, misses):
    what a host reports so a test can tell a warm cache from a cold one without timing."""
    if "torch._dynamo.utils" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    out = {f"fx_graph_{k}": int(v) for k, v in counters["inductor"].items()
           if k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")}
    out.update({f"aot_autograd_{k}": int(v) for k, v in counters["aot_autograd"].items()
                if k in ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")})
    return out
