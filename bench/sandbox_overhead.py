"""A battery through the kernel host with and without the bubblewrap sandbox, in one process.

    python bench/sandbox_overhead.py [--battery standard] [--device auto] [--repeats 3]

Each repeat runs the whole battery through `KernelHost.run_many` (the worker's path: fast engine,
host start included) once sandboxed and once with bubblewrap turned off (OPTDRIFT_BWRAP naming no
program), alternating which goes first. Prints a table of the times (median of the repeats) and
checks that both ways give the same digests for every case: the box must change nothing but who
can see what. The build is made once beforehand and is not timed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker import sandbox  # noqa: E402
from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine.host import KernelHost  # noqa: E402


def run_once(library: str, cases, device: str, *, sandboxed: bool, real_bwrap: str | None):  # noqa: ANN001
    if sandboxed:
        if real_bwrap:
            os.environ["OPTDRIFT_BWRAP"] = real_bwrap
        else:
            os.environ.pop("OPTDRIFT_BWRAP", None)
    else:
        os.environ["OPTDRIFT_BWRAP"] = "/nonexistent/bwrap-turned-off"
    sandbox.status.cache_clear()
    if sandbox.available() != sandboxed:
        raise SystemExit(f"sandbox {'unavailable' if sandboxed else 'still on'}: {sandbox.status()[1]}")
    started = time.perf_counter()
    with KernelHost(library, device=device, case_timeout_s=600) as host:
        host.start()
        ready = time.perf_counter()
        results = host.run_many(cases)
        done = time.perf_counter()
    return ready - started, done - ready, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "csrc")
    args = parser.parse_args()

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    real_bwrap = os.environ.get("OPTDRIFT_BWRAP")
    build = build_extension(args.source, cuda_archs=[] if device == "cpu" else None)
    if not build.ok:
        print(f"build failed:\n{build.error}", file=sys.stderr)
        return 1
    cases = load_battery(args.battery).expand()
    starts: dict[bool, list[float]] = {True: [], False: []}
    batteries: dict[bool, list[float]] = {True: [], False: []}
    digests: dict[bool, list] = {}
    for repeat in range(args.repeats):
        for sandboxed in ((True, False) if repeat % 2 == 0 else (False, True)):
            start_s, battery_s, results = run_once(build.library_path, cases, device, sandboxed=sandboxed,
                                                   real_bwrap=real_bwrap)
            starts[sandboxed].append(start_s)
            batteries[sandboxed].append(battery_s)
            digests[sandboxed] = [(r.status, r.message, r.trajectory.digests if r.trajectory else None)
                                  for r in results]
            print(f"repeat {repeat + 1}: {'sandboxed' if sandboxed else 'unsandboxed'} host start "
                  f"{start_s:.3f} s, battery {battery_s:.3f} s", flush=True)
    same = digests[True] == digests[False]
    not_ok = sum(1 for status, _, _ in digests[True] if status != "ok")
    print(f"\n{args.battery} battery, {len(cases)} cases, device {device}, {args.repeats} repeats "
          f"(build excluded); median (min-max) seconds")
    print("| way | host start | battery (run_many) |")
    print("|---|---:|---:|")
    for label, key in (("unsandboxed", False), ("sandboxed (bubblewrap)", True)):
        print(f"| {label} | {statistics.median(starts[key]):.3f} ({min(starts[key]):.3f}-{max(starts[key]):.3f}) "
              f"| {statistics.median(batteries[key]):.3f} ({min(batteries[key]):.3f}-{max(batteries[key]):.3f}) |")
    ratio = statistics.median(batteries[True]) / statistics.median(batteries[False])
    print(f"\nbattery sandboxed / unsandboxed: {ratio:.3f}; results identical (status, message, digests): "
          f"{same}; cases not ok: {not_ok}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
