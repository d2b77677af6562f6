"""Time a battery on one build, in one kernel host, and print a per-optimizer table.

    python bench/battery_cpu.py [--battery quick] [--source csrc] [--device cpu|cuda|auto]

Builds the source with worker.build (cached by digest), runs every case in one kernel host (as
`optdrift check` does for each side) and prints, per optimizer x family, the case count, total
steps and seconds, so a regression in the engine's speed shows as a number, not a timed test.
On a GPU machine `--device auto --battery standard` gives the same table for the standard battery.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine.corun import run_battery  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="quick")
    parser.add_argument("--source", default=str(Path(__file__).resolve().parent.parent / "csrc"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    started = time.monotonic()
    build = build_extension(Path(args.source))
    if not build.ok:
        print(f"build failed:\n{build.error}", file=sys.stderr)
        return 1
    built = time.monotonic() - started
    battery = load_battery(args.battery)
    run_started = time.monotonic()
    run = run_battery(battery, build.library_path, build_digest=build.digest, device=args.device)
    wall = time.monotonic() - run_started

    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])
    for result in run.cases:
        row = rows[(result.case.optimizer, result.case.family)]
        row[0] += 1
        row[1] += result.case.steps
        row[2] += result.duration_s
    table = Table(title=f"battery {battery.name} v{battery.version} on {run.environment.class_key if run.environment else args.device}")
    for column in ("optimizer", "family", "cases", "steps", "seconds", "ms/step"):
        table.add_column(column, justify="right")
    for (optimizer, family), (cases, steps, seconds) in sorted(rows.items()):
        table.add_row(optimizer, family, str(cases), str(steps), f"{seconds:.2f}", f"{1000 * seconds / steps:.2f}")
    console = Console(width=120)
    console.print(table)
    broken = sum(r.status == "broken" for r in run.cases)
    console.print(f"build {built:.1f} s ({'cached' if build.cached else 'compiled'}); battery wall {wall:.1f} s "
                  f"(host start included); {len(run.cases)} cases, {broken} broken")
    return 0


if __name__ == "__main__":
    sys.exit(main())
