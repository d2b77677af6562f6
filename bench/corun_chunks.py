"""Where the fast co-run's kernels phase goes, by chunk size (issue 18: flagged commit -> co-run detail).

    python bench/corun_chunks.py [--battery standard] [--device auto] [--chunk-mib 64 256 1024 4096]

Builds the bundled kernels and the decay-after-update copy (PR 2040), takes the battery's cases
that copy changes (Adam and AdEMAMix at weight decay > 0), and co-runs them the worker's way
(worker.engine.corun_battery, fast) once per chunk size, in two hosts started before the clock
starts (as the worker's spares are). Prints one table: chunks, the kernels phase, each host's busy
seconds (its requests, its parameter file written; in brackets what the host says its device-to-host
copies and its writing into the file took) and this process's diffs (reading both files; they
overlap the next chunk's requests but for the last chunk's). Every chunk size must give the
same per-step diffs, bit for bit (compared through repr), or the script exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corun_builds import build_baseline_and_decay, resolve_device  # noqa: E402  (bench/, this script's folder)

from worker.battery import load_battery  # noqa: E402
from worker.engine.corun import corun_battery  # noqa: E402
from worker.engine.host import KernelHost  # noqa: E402
from worker.mutations import DECAY_AFTER_UPDATE_OPTIMIZERS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[64, 256, 1024, 4096])
    args = parser.parse_args()
    device = resolve_device(args.device)
    try:
        base_build, commit_build = build_baseline_and_decay(device)
    except RuntimeError as error:
        print(error, file=sys.stderr)
        return 1
    battery = load_battery(args.battery)
    cases = [c for c in battery.expand()
             if c.optimizer in DECAY_AFTER_UPDATE_OPTIMIZERS and c.hyper.get("weight_decay", 0) > 0]
    per_side = sum(c.steps * c.size * 4 for c in cases)
    print(f"\n{args.battery} battery: {len(cases)} cases the decay copy may change, {per_side / 1e9:.2f} GB of "
          f"float32 parameters per side; device {device}; hosts started before the clock", flush=True)
    print("| chunk MiB | chunks | kernels s | commit host s (to host, into file) | baseline host s (to host, into file) "
          "| diffs s | cases with diffs |")
    print("|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    first = None
    for mib in args.chunk_mib:
        hosts = tuple(KernelHost(build.library_path, device=device, case_timeout_s=600)
                      for build in (commit_build, base_build))
        KernelHost.start_together(list(hosts))
        timings: dict[str, float] = {}
        _, _, diffs = corun_battery(battery, commit_build.library_path, base_build.library_path, device=device,
                                    cases=cases, fast=True, chunk_bytes=mib * 1024**2, hosts=hosts,
                                    timings=timings)
        sides = " | ".join(f"{timings.get(f'{side}_host_s', 0):.2f} ({timings.get(f'{side}_device_to_host_s', 0):.2f}, "
                           f"{timings.get(f'{side}_into_file_s', 0):.2f})" for side in ("commit", "baseline"))
        print(f"| {mib} | {timings.get('chunks', 0):.0f} | {timings['kernels_s']:.2f} | {sides} | "
              f"{timings.get('diff_s', 0):.2f} | {len(diffs)} |", flush=True)
        exact = {k: repr(v) for k, v in diffs.items()}
        if first is None:
            first = exact
        elif exact != first:
            print(f"FAILED: chunks of {mib} MiB gave other diffs than chunks of {args.chunk_mib[0]} MiB")
            return 1
    print("every chunk size gave the same per-step diffs (repr)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
