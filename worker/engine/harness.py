"""optdrift's own compiled harness (worker/engine/harness_csrc): built once per environment and
loaded wherever the fast engine runs. It holds two things the engine uses when they are there:

* `optdrift_od2::observe_rows`, the od2 observation in one pass per arena (worker.engine.od2_op);
* `PreparedCalls`, the loop that makes a step's kernel calls from C++ (worker.engine.call_loop).

Both give the same bits as the Python paths they replace, which stay as the fallback and as the
reference the tests compare with (tests/worker/engine/test_od2_op.py, tests/worker/engine/test_call_loop.py).

Where it comes from. It is optdrift's code, never a contributor's: it is built from this
package's sources by the same sandboxed, digest-keyed build as a kernel tree
(worker.build.extension), into its own cache (`cache_dir`), outside the secrets a kernel host may
not see. A CUDA build holds the CPU and the CUDA code. The parent that starts a kernel host builds
it (a cache hit after the first time) and hands its path to the host (`--harness-library`), which
shows its folder read-only and loads it. Where it cannot be built or loaded the engine runs the
Python paths, which give the same results, and the log says so once.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "harness_csrc"

_lock = threading.Lock()
_built: dict[str, Path | None] = {}  # ";".join(cuda archs) -> the library, or None: it did not build
_loaded: tuple[Path, ModuleType] | None = None


def switched_on(variable: str) -> bool:
    """False when the environment variable says 0/false/no/off (measuring or bisecting a path)."""
    return os.environ.get(variable, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    """OPTDRIFT_HARNESS_CACHE, else <XDG cache>/optdrift/harness: shared by every run and test on
    this machine (the library depends only on these sources, torch, the flags and the archs)."""
    configured = os.environ.get("OPTDRIFT_HARNESS_CACHE")
    if configured:
        return Path(configured)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "optdrift" / "harness"


def library_for(device: str) -> Path | None:
    """The library for a kernel host on `device` ("cpu", "cuda", "cuda:N" or "auto"), built on first
    use; None when OPTDRIFT_HARNESS=0 or it does not build (logged once per process and arch set)."""
    if not switched_on("OPTDRIFT_HARNESS"):
        return None
    from worker.build.extension import build_extension, detect_cuda_archs

    archs = [] if device == "cpu" else detect_cuda_archs()
    key = ";".join(archs)
    with _lock:
        if key not in _built:
            try:
                result = build_extension(SOURCE_DIR, cache_dir=cache_dir(), cuda_archs=archs)
            except OSError as error:  # the cache folder cannot be made: run without
                log.warning("the harness library cannot be built (%s); the engine uses its Python paths", error)
                _built[key] = None
            else:
                if not result.ok:
                    log.warning("the harness library did not build (log %s): %s; the engine uses its Python "
                                "paths (same results, slower)", result.log_path, result.error)
                _built[key] = Path(result.library_path) if result.ok else None
        return _built[key]


def load(path: str | Path) -> ModuleType:
    """Load the library into this process as a Python module (its torch ops register as it loads);
    idempotent for one path, refused for a second one."""
    global _loaded
    path = Path(path).resolve()
    with _lock:
        if _loaded is not None:
            if _loaded[0] == path:
                return _loaded[1]
            raise RuntimeError(f"the harness library {_loaded[0]} is loaded in this process; cannot also load {path}")
        # The module's name is the file's stem: the build names the library and its PyInit the same.
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise RuntimeError(f"{path} cannot be loaded as a Python extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _loaded = (path, module)
        return module


def module() -> ModuleType | None:
    """The loaded harness module, or None."""
    return None if _loaded is None else _loaded[1]


def ensure_loaded(device: object) -> bool:
    """In-process use (benches, tests): build and load the library for `device`'s type; whether it
    is loaded now."""
    import torch

    if _loaded is None:
        path = library_for(torch.device(device).type)
        if path is None:
            return False
        load(path)
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m worker.engine.harness DEVICE`: build the library for DEVICE (a cache hit after
    the first time) and print its path; exit 1 when it does not build. A worker runs it before it
    takes its first run (worker/tasks.py), in a process of its own."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m worker.engine.harness", description=main.__doc__)
    parser.add_argument("device", help="cpu, cuda, cuda:N or auto")
    device = parser.parse_args(argv).device
    if not switched_on("OPTDRIFT_HARNESS"):
        print("OPTDRIFT_HARNESS is off: the engine uses its Python paths; nothing built", file=sys.stderr)
        return 0
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    path = library_for(device)
    if path is None:
        print(f"the harness library for {device!r} did not build (see the warning above)", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
