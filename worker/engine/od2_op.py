"""The fused od2 observation: `optdrift_od2::observe_rows` (worker/engine/od2_csrc), built once per
environment and loaded wherever the fast engine runs.

Why. The fast engine observes every arena every step: each case's non-finite count and its two
od2 lanes (worker/engine/digest.py). As torch ops that is about twenty int64 kernels per arena,
each reading and writing the arena widened to 8 bytes an element; on the H200 they were most of
the warm battery's GPU time (docs/PERFORMANCE.md, round 7 profile). The op reads each element once.
Its sums are modulo 2^64 like the torch ops', so the digests are the same bits either way
(tests/test_od2_op.py compares them on every dtype; the fast engine's identity tests run with it).

Where it comes from. The op is optdrift's own harness code, never a contributor's: it is built
from this package's sources by the same sandboxed, digest-keyed build as a kernel tree
(worker.build.extension), into its own cache (`cache_dir`), outside the secrets a kernel host may
not see. A CUDA build holds both the CPU and the CUDA implementation. The parent that starts a
kernel host builds it (a cache hit after the first time) and hands its path to the host
(`--od2-library`), which shows its folder read-only. Where it cannot be built or loaded the
engine runs the torch ops, which give the same digests, and says so in the log once.
`OPTDRIFT_OD2_FUSED=0` turns it off (to measure or to bisect the two paths).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

NAMESPACE = "optdrift_od2"
SOURCE_DIR = Path(__file__).resolve().parent / "od2_csrc"
_DISPATCH_KEY = {"cpu": "CPU", "cuda": "CUDA"}

_lock = threading.Lock()
_built: dict[str, Path | None] = {}  # ";".join(cuda archs) -> the library, or None: it did not build
_loaded: Path | None = None


def enabled() -> bool:
    return os.environ.get("OPTDRIFT_OD2_FUSED", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """OPTDRIFT_OD2_CACHE, else <XDG cache>/optdrift/od2: shared by every run and test on this
    machine (the library depends only on these sources, torch, the flags and the archs)."""
    configured = os.environ.get("OPTDRIFT_OD2_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "optdrift" / "od2"


def library_for(device: str) -> Path | None:
    """The library for a kernel host on `device` ("cpu", "cuda", "cuda:N" or "auto"), built on first
    use; None when it is turned off or does not build (logged once per process and arch set)."""
    if not enabled():
        return None
    from worker.build.extension import build_extension, detect_cuda_archs

    archs = [] if device == "cpu" else detect_cuda_archs()
    key = ";".join(archs)
    with _lock:
        if key not in _built:
            try:
                result = build_extension(SOURCE_DIR, cache_dir=cache_dir(), cuda_archs=archs)
            except OSError as error:  # the cache folder cannot be made: run without
                log.warning("the fused od2 observation cannot be built (%s); the engine uses torch ops", error)
                _built[key] = None
            else:
                if not result.ok:
                    log.warning("the fused od2 observation did not build (log %s): %s; the engine uses "
                                "torch ops (same digests, slower)", result.log_path, result.error)
                _built[key] = Path(result.library_path) if result.ok else None
        return _built[key]


def load(path: str | Path) -> None:
    """Load the library into this process (idempotent for one path)."""
    global _loaded
    path = Path(path).resolve()
    with _lock:
        if _loaded == path:
            return
        if _loaded is not None or _registered():
            raise RuntimeError(f"{NAMESPACE} ops are already loaded in this process (from {_loaded}); "
                               f"cannot also load {path}")
        torch.ops.load_library(str(path))
        _loaded = path


def ensure_loaded(device: torch.device | str) -> bool:
    """In-process use (benches, tests): build and load the library for `device`; whether the fused
    path is now available there."""
    device = torch.device(device)
    if _loaded is None:
        path = library_for(device.type)
        if path is None:
            return False
        load(path)
    return fused_for(device)


def _registered() -> bool:
    """Whether the op's schema is registered in this process (by any library)."""
    try:
        torch._C._dispatch_find_schema_or_throw(f"{NAMESPACE}::observe_rows", "")
    except RuntimeError:
        return False
    return True


def fused_for(device: torch.device) -> bool:
    """Whether observe_rows runs on `device` in this process (loaded, enabled, and built for it)."""
    key = _DISPATCH_KEY.get(torch.device(device).type)
    return (_loaded is not None and key is not None and enabled()
            and torch._C._dispatch_has_kernel_for_dispatch_key(f"{NAMESPACE}::observe_rows", key))


def observe_rows(data: torch.Tensor, lengths: torch.Tensor, slot: int, case_index: torch.Tensor,
                 counts: torch.Tensor) -> None:
    """counts[0, case_index[r]] += non-finite elements of row r; counts[1 and 2, ...] += od2's two
    lanes of row r's first lengths[r] elements, salted for state slot `slot` (0: the parameter)."""
    torch.ops.optdrift_od2.observe_rows(data, lengths, slot, case_index, counts)
