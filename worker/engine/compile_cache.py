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
  trusted host would load (the build cache's rule, docs/SECURITY.md). The host copies the folder
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

No torch here at import: the parent (worker.pipeline, KernelHost) only names folders.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

FOLDER = "compile"  # <build cache root>/compile
SCRATCH_COPY = "compile-cache"  # an untrusted host's copy, in its scratch


@dataclass(frozen=True)
class CompileCache:
    """One build's compile cache as a host is given it: `folder` is bound into the box,
    read-write when `writable`, else read-only."""

    folder: Path
    writable: bool

    def host_arguments(self) -> list[str]:
        return ["--compile-cache", str(self.folder), *([] if self.writable else ["--compile-cache-read-only"])]


def for_build(cache_root: Path | None, build_digest: str | None, *, trusted: bool) -> CompileCache | None:
    """The compile cache of the build `build_digest` under `cache_root` (the build cache's root), made
    when missing; None without a digest (a failed or digest-less build: nothing to key it by)."""
    if cache_root is None or not build_digest or not re.fullmatch(r"[A-Za-z0-9._-]+", build_digest):
        return None
    folder = Path(cache_root) / FOLDER / build_digest
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)  # the sandbox user reads it (a verify host, which is not handed it)
    return CompileCache(folder=folder.resolve(), writable=trusted)


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


def keep_new_entries(copy: Path, cache: CompileCache, class_key: str) -> int:
    """A trusted spare's scratch copy (`copy`) merged into `cache`'s folder for its environment:
    regular files not there yet, each written beside its place and renamed in (a reader never sees
    half a file); links and special files are left out. Returns how many files were added."""
    if not cache.writable or not copy.is_dir():
        return 0
    target = cache.folder / environment_folder_name(class_key)
    added = 0
    for folder, _subfolders, files in os.walk(copy):
        here = target / Path(folder).relative_to(copy)
        for name in files:
            source, destination = Path(folder) / name, here / name
            if source.is_symlink() or not source.is_file() or destination.exists():
                continue
            here.mkdir(parents=True, exist_ok=True)
            partial = destination.with_name(f".{name}.{os.getpid()}.partial")
            shutil.copyfile(source, partial)
            os.replace(partial, destination)
            added += 1
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
