"""Cold build, cache hit, and one-file-changed rebuild of the bundled csrc; prints a table.

    python bench/build_times.py [--archs 9.0] [--source csrc]

Cold: a fresh cache folder. Hit: the same key again (compiles nothing). One file changed: a copy
of the tree with a comment appended to one kernel file (a new digest, so a new build folder;
without a compiler cache this is a full rebuild, which the table makes visible).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.build import build_extension, detect_cuda_archs  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "csrc")
    parser.add_argument("--cache", type=Path, default=None,
                        help="an empty or missing folder to build into (kept afterwards, so later runs hit it); "
                             "default: a temporary folder")
    parser.add_argument("--archs", default=None, help='CUDA archs such as "9.0"; "" for CPU-only; default: detect')
    args = parser.parse_args()
    archs = detect_cuda_archs() if args.archs is None else [a for a in args.archs.split(";") if a]

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache or Path(tmp) / "cache"
        if cache.exists() and any(cache.iterdir()):
            raise SystemExit(f"--cache {cache} is not empty: a cold build needs an empty cache folder")
        cold = build_extension(args.source, cache_dir=cache, cuda_archs=archs)
        if not cold.ok:
            raise SystemExit(f"build failed:\n{cold.error}")
        rows.append(("cold", cold.duration_s, cold.cached))
        hit = build_extension(args.source, cache_dir=cache, cuda_archs=archs)
        rows.append(("cache hit", hit.duration_s, hit.cached))

        changed = Path(tmp) / "changed"
        shutil.copytree(args.source, changed)
        kernel = sorted((changed / ("cuda" if archs else "cpu")).glob("*.c*"))[0]
        kernel.write_text(kernel.read_text() + "\n// touched by bench/build_times.py\n")
        started = time.monotonic()
        one = build_extension(changed, cache_dir=Path(tmp) / "scratch-cache", cuda_archs=archs)
        rows.append((f"one file changed ({kernel.name})", time.monotonic() - started, one.cached))

    table = Table(title=f"csrc build times, CUDA archs: {archs or 'none (CPU-only)'}")
    for column in ("build", "seconds", "cache hit"):
        table.add_column(column)
    for name, seconds, cached in rows:
        table.add_row(name, f"{seconds:.3f}", str(cached))
    Console().print(table)


if __name__ == "__main__":
    main()
