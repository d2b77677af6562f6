"""Wall time of a catalogue run with mutants built ahead (`--build-jobs`) against one at a time.

Each measurement starts from the same state: a fresh copy of a build cache that holds only the
unmutated build (its objects in the cache's ccache), so every mutant compiles what its patch reaches
and nothing of an earlier measurement is a hit. The mutants are the first COUNT that reach the CPU
build, in the order a run judges them (classes interleaved), so the same set for every jobs value.

    .venv/bin/python bench/sensitivity_build_ahead.py --count 8 --jobs 0 --jobs 1
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from worker import pipeline
from worker.sensitivity.catalogue import load_catalogue
from worker.sensitivity.engine import BUNDLED_CSRC, SensitivityRun, _interleaved


def seed_cache(folder: Path) -> None:
    """`folder` as a build cache holding only the unmutated CPU build."""
    run = SensitivityRun(cache_dir=folder)
    job = pipeline.prepare(BUNDLED_CSRC, requested_battery="ci")
    built = pipeline.build(job, run.policy())
    assert built.ok, built.error


def measure(jobs: int, mutant_ids: list[str], seed: Path, work: Path) -> dict:
    cache = work / f"cache-jobs{jobs}"
    shutil.copytree(seed, cache, symlinks=True)
    started = time.monotonic()
    report = SensitivityRun(only=mutant_ids, cache_dir=cache, fallback_battery=None, build_jobs=jobs,
                            progress=lambda line: print(f"  {time.monotonic() - started:7.1f} {line}", flush=True)).run()
    return {"build_jobs": jobs, "mutants": len(report.mutants), "wall_s": round(time.monotonic() - started, 1),
            "build_s": [m.build_s for m in report.mutants], "run_s": [m.run_s for m in report.mutants],
            "statuses": {m.id: m.status for m in report.mutants}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=8, help="how many CPU mutants")
    parser.add_argument("--jobs", type=int, action="append", help="a --build-jobs value; repeat (default 0 and 1)")
    args = parser.parse_args()
    mutant_ids = [m.id for m in _interleaved(load_catalogue()) if "cpu" in m.reaches][:args.count]
    with tempfile.TemporaryDirectory(prefix="optdrift-build-ahead-") as work:
        seed = Path(work) / "seed"
        seed_cache(seed)
        results = [measure(jobs, mutant_ids, seed, Path(work)) for jobs in args.jobs or [0, 1]]
    for result in results:
        print(json.dumps(result))
    statuses = {json.dumps(r["statuses"], sort_keys=True) for r in results}
    print("same verdicts for every jobs value" if len(statuses) == 1 else "VERDICTS DIFFER between jobs values")


if __name__ == "__main__":
    main()
