"""Wall time of `optdrift check --battery ci --device cpu` on a changed tree, warm builds, and the
share its attribution phase takes (issue 47: a warm changed ci check took 31 s, 20 s of it
attributing).

    .venv/bin/python bench/check_attribution_time.py [--repeats 3] [MUTANT ...]

Mutants of the committed csrc (bench/attribution_table.py's): decay (semantic: weight decay after
the update; 3 changed cases), fma and ulp (rounding-level; their one-element case is probed at
16384 elements, worker/attribution/probe.py). The baseline is the committed csrc itself
(`git archive HEAD csrc`), so uncommitted work in the checkout does not enter the figures. Builds
go through OPTDRIFT_BUILD_CACHE (default the test suite's cache); the first check of each mutant
warms them and is not counted. Prints one line per check: its phase line (service/cli/check.py).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import attribution_table  # noqa: E402 - its mutants

PHASES = re.compile(r"^\((?P<total>[0-9.]+) s: (?P<parts>.*)\)$", re.MULTILINE)


def committed_csrc(dest: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", "csrc"], check=True,
                             capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(dest, filter="data")
    return dest / "csrc"


def check(source: Path, baseline: Path, env: dict) -> tuple[float, dict[str, float], int]:
    completed = subprocess.run([str(ROOT / ".venv/bin/optdrift"), "check", "--source", str(source), "--baseline",
                                str(baseline), "--battery", "ci", "--device", "cpu"], env=env, capture_output=True,
                               text=True, check=False)
    found = PHASES.search(completed.stdout)
    if found is None:
        raise SystemExit(f"no phase line in the check's output:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    parts = {name: float(seconds) for name, seconds in re.findall(r"([a-z -]+?) ([0-9.]+) s \(", found["parts"])}
    return float(found["total"]), {k.strip(): v for k, v in parts.items()}, completed.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", default=["fma", "decay"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    env = {**os.environ, "OPTDRIFT_BUILD_CACHE": os.environ.get("OPTDRIFT_BUILD_CACHE",
                                                                  str(ROOT / ".optdrift" / "test-build-cache"))}
    with tempfile.TemporaryDirectory(prefix="optdrift-bench-") as tmp:
        base = committed_csrc(Path(tmp) / "base")
        attribution_table.ROOT = base.parent  # its mutants copy ROOT / "csrc"
        for name in args.mutants:
            tree = attribution_table.mutant(name, Path(tmp) / "mutants")
            check(tree, base, env)  # warms the builds and the compile cache
            totals, attributions = [], []
            for _ in range(args.repeats):
                total, parts, code = check(tree, base, env)
                totals.append(total)
                attributions.append(parts.get("attribution", 0.0))
                print(f"{name}: exit {code}, {total:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in parts.items()),
                      flush=True)
            print(f"{name}: check median {statistics.median(totals):.1f} s, attribution median "
                  f"{statistics.median(attributions):.1f} s (min {min(attributions):.1f}, max {max(attributions):.1f}); "
                  f"load {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
