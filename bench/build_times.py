"""Cold build, digest cache hit, and one-file-changed rebuild of the bundled csrc, with ccache and
without; prints a table.

    python bench/build_times.py [--archs 9.0] [--source csrc] [--ccache PATH] [--no-compare]

For each mode (through ccache; without it, OPTDRIFT_CCACHE=0), in a fresh build cache folder:
  cold             the sources into an empty cache (ccache's own folder, under it, empty too);
  digest hit       the same sources again: the same digest, so nothing compiles;
  one file changed a copy of the tree with one kernel file changed in its code (a new constant, not
                   a comment: ccache rightly treats a comment-only change as unchanged), built into
                   the same cache folder. A new digest, so a new build folder: without ccache every
                   file recompiles, with it only the changed one (the table shows ccache's hits and
                   misses for that build).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.build import BuildResult, build_extension, detect_cuda_archs, find_ccache  # noqa: E402

CODE_CHANGE = "\nnamespace { [[maybe_unused]] constexpr int optdrift_bench_changed = 1; }\n"


def changed_copy(source: Path, destination: Path, archs: list[str]) -> Path:
    """A copy of `source` with one kernel file (a .cu for a CUDA build, else a cpu .cpp) changed."""
    shutil.copytree(source, destination)
    kernels = sorted((destination / ("cuda" if archs else "cpu")).glob("*.cu" if archs else "*.cpp"))
    if not kernels:
        raise SystemExit(f"no kernel file to change under {destination}")
    kernel = kernels[0]
    kernel.write_text(kernel.read_text() + CODE_CHANGE)
    return kernel


def timed_build(source: Path, cache: Path, archs: list[str]) -> tuple[float, BuildResult]:
    started = time.monotonic()
    result = build_extension(source, cache_dir=cache, cuda_archs=archs)
    elapsed = time.monotonic() - started
    if not result.ok:
        raise SystemExit(f"build of {source} failed (log {result.log_path}):\n{result.error}")
    return elapsed, result


def run_mode(mode: str, ccache: str, source: Path, cache: Path, archs: list[str], scratch: Path) -> list[dict]:
    os.environ["OPTDRIFT_CCACHE"] = ccache
    rows = []
    for build, tree in (("cold", source), ("digest hit", source), ("one file changed", None)):
        label = build
        if tree is None:
            kernel = changed_copy(source, scratch / f"changed-{mode.replace(' ', '-')}", archs)
            tree, label = kernel.parents[1], f"one file changed ({kernel.name})"
        seconds, result = timed_build(tree, cache, archs)
        stats = result.compiler_cache if not result.cached else None
        rows.append({
            "mode": mode, "build": label, "seconds": seconds, "digest_hit": result.cached,
            "ccache_hits": stats.hits if stats else None, "ccache_misses": stats.misses if stats else None,
            "ccache_missed_files": stats.missed_files if stats else None,
            "ccache_uncacheable": stats.uncacheable if stats else None,
            "log": result.log_path,
        })
        print(f"{mode:>9} | {label}: {seconds:.3f} s"
              + (f" | {stats.summary()}" if stats else ""), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "csrc")
    parser.add_argument("--cache", type=Path, default=None,
                        help="an empty or missing folder to build into (kept afterwards); default: a temporary folder")
    parser.add_argument("--archs", default=None, help='CUDA archs such as "9.0"; "" for CPU-only; default: detect')
    parser.add_argument("--ccache", default=None,
                        help="the ccache to use (default: OPTDRIFT_CCACHE, else ccache on PATH or beside python)")
    parser.add_argument("--no-compare", action="store_true", help="skip the builds without ccache")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    archs = detect_cuda_archs() if args.archs is None else [a for a in args.archs.split(";") if a]
    if args.ccache:
        os.environ["OPTDRIFT_CCACHE"] = args.ccache
    ccache = find_ccache()
    if ccache is None:
        print("no ccache found (OPTDRIFT_CCACHE, PATH, beside python): timing builds without it only", flush=True)

    modes = ([("ccache", str(ccache))] if ccache else []) + ([] if args.no_compare and ccache else [("no ccache", "0")])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.cache or Path(tmp) / "cache"
        if root.exists() and any(root.iterdir()):
            raise SystemExit(f"--cache {root} is not empty: a cold build needs an empty cache folder")
        # A snapshot: an edit to the checkout during the run must not turn the digest hit into a build.
        source = Path(tmp) / "source" / args.source.resolve().name
        shutil.copytree(args.source.resolve(), source)
        for mode, setting in modes:
            rows += run_mode(mode, setting, source, root / mode.replace(" ", "-"), archs, Path(tmp))

    table = Table(title=f"csrc build times, CUDA archs: {archs or 'none (CPU-only)'}, "
                        f"ccache: {ccache or 'none'}, {os.cpu_count()} cores")
    for column in ("mode", "build", "seconds", "digest hit", "ccache hits", "ccache misses"):
        table.add_column(column)
    for row in rows:
        misses = "" if row["ccache_misses"] is None else str(row["ccache_misses"])
        if row["ccache_missed_files"]:
            misses += f" ({', '.join(row['ccache_missed_files'])})"
        table.add_row(row["mode"], row["build"], f"{row['seconds']:.3f}", str(row["digest_hit"]),
                      "" if row["ccache_hits"] is None else str(row["ccache_hits"]), misses)
    Console(width=160).print(table)
    if args.json_out:
        args.json_out.write_text(json.dumps({"archs": archs, "ccache": str(ccache) if ccache else None,
                                             "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
