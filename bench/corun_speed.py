"""The baseline co-run (per-step |commit - baseline| of changed cases) against the battery's own time.

    python bench/corun_speed.py [--battery standard] [--device auto]

Builds the bundled kernels and the decay-after-update mutant (PR 2040), runs the battery on the
mutant through the kernel host's fast engine (what a run costs), finds the changed cases against
the bundled build's run, then co-runs them the worker's way (worker.engine.corun_battery,
params_only: the kernels alone in two hosts, parameters compared step by step) and, for the worst
case, co-runs every case. Prints one table: seconds and the ratio to the battery's time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corun_builds import build_baseline_and_decay, resolve_device  # noqa: E402  (bench/, this script's folder)

from worker.battery import load_battery  # noqa: E402
from worker.engine.corun import corun_battery  # noqa: E402
from worker.engine.host import KernelHost  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--all-cases", action="store_true", help="also co-run every case (the worst case)")
    args = parser.parse_args()
    device = resolve_device(args.device)
    try:
        base_build, commit_build = build_baseline_and_decay(device)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    battery = load_battery(args.battery)
    cases = battery.expand()
    runs = {}
    for name, build in (("baseline", base_build), ("commit", commit_build)):
        with KernelHost(build.library_path, device=device, case_timeout_s=600) as host:
            host.start()
            started = time.perf_counter()
            runs[name] = host.run_many(cases)
            if name == "commit":
                battery_s = time.perf_counter() - started
    changed = [c for c, a, b in zip(cases, runs["commit"], runs["baseline"])
               if a.trajectory and b.trajectory and a.trajectory.digests != b.trajectory.digests]
    print(f"\n{args.battery} battery ({len(cases)} cases), device {device}; host start excluded from the battery, "
          "included in the co-runs", flush=True)
    print("| what | seconds | / battery | cases with diffs |")
    print("|---|---:|---:|---:|")
    print(f"| battery on the commit (fast engine) | {battery_s:.2f} | 1.00 | |", flush=True)
    subsets = [(f"co-run of the {len(changed)} changed cases", changed)]
    if args.all_cases:
        subsets.append((f"co-run of all {len(cases)} cases", cases))
    for label, subset in subsets:
        started = time.perf_counter()
        _, _, diffs = corun_battery(battery, commit_build.library_path, base_build.library_path, device=device,
                                    cases=subset, params_only=True, case_timeout_s=600)
        seconds = time.perf_counter() - started
        print(f"| {label} | {seconds:.2f} | {seconds / battery_s:.2f} | {len(diffs)} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
