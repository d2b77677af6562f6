"""The kernels' own speed on one device: every bundled kernel timed (worker/speed/timing.py), the
timing repeated in fresh processes to show that the noise model (service/core/speed_noise.py) does not
flag a no-change rerun, and a deliberately slowed mutant (worker/speed/mutant.py: an extra pass
over part of the parameter) to show that it is flagged.

    python bench/kernel_speed.py [--device cuda] [--sizes 1048576 67108864] [--repeats 50]
                                 [--reruns 20] [--mutant adam/32bit] [--mutant-fraction 0.35]
                                 [--json-out kernel_speed.json]

Each timing (the baseline, each rerun, the mutant) runs in its own process, as a worker's kernel
host would: a rerun shares nothing with the baseline but the build and the card. The mutant's
extra pass over 35 % of an fp32 Adam parameter adds 2 x 0.35 x 4 = 2.8 bytes per element to the
step's 28: a 10 % slowdown of adam/32bit float32 by its traffic (more at 2^20, where the extra
launch costs too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def child(args: argparse.Namespace) -> int:
    """One timing in this process: the plan on the loaded build, the answer as JSON to --out."""
    import torch

    from worker.adapters.bundled import BundledAdapter
    from worker.engine.environment import resolve_device
    from worker.speed import timing
    from worker.speed.mutant import slowed_families

    adapter = BundledAdapter()
    adapter.load(args.library)
    families = adapter.families()
    if args.slow:
        families = slowed_families(families, args.slow, args.mutant_fraction)
    plan = timing.TimingPlan(sizes=tuple(args.sizes), repeats=args.repeats, budget_s=args.budget_s)
    device = resolve_device(args.device)
    torch.set_num_threads(1)
    answer = timing.time_kernels(plan, device, adapter, families)
    Path(args.out).write_text(json.dumps(answer))
    return 0


def _spawn(args: argparse.Namespace, library: str, out: Path, mutant: list[str]) -> dict:
    command = [sys.executable, __file__, "--child", "--library", library, "--out", str(out), "--device", args.device,
               "--repeats", str(args.repeats), "--budget-s", str(args.budget_s), "--sizes", *map(str, args.sizes)]
    if mutant:
        command += ["--slow", *mutant, "--mutant-fraction", str(args.mutant_fraction)]
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def _by_key(answer: dict) -> dict:
    return {(t["kernel"], t["param_dtype"], t["size"]): t for t in answer["timings"] if not t["error"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 1 << 26])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=300.0)
    parser.add_argument("--reruns", type=int, default=20, help="no-change reruns, each in a fresh process")
    parser.add_argument("--mutant", nargs="*", default=["adam/32bit"])
    parser.add_argument("--mutant-fraction", type=float, default=0.35)
    parser.add_argument("--max-s", type=float, default=420.0, help="stop starting reruns after this many seconds")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    # The child's own flag: --mutant's default must not slow the baseline and rerun children too.
    parser.add_argument("--slow", nargs="*", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    import tempfile

    from service.core.speed_noise import CONFIDENCE, SLOWDOWN_THRESHOLD, compare, summarize
    from worker.build import build_extension

    started = time.monotonic()
    # the tests' build cache (tests/conftest.py): the CUDA test before this bench built it already
    cache = Path(os.environ.get("OPTDRIFT_BUILD_CACHE") or REPO / ".optdrift" / "test-build-cache")
    built = build_extension(REPO / "csrc", cache_dir=cache)
    if not built.ok:
        print(built.error)
        return 1
    print(f"build {'cached' if built.cached else 'made'} in {time.monotonic() - started:.0f} s: {built.library_path}")
    with tempfile.TemporaryDirectory() as tmp:
        base = _spawn(args, built.library_path, Path(tmp) / "base.json", [])
        print(f"\n## Baseline timing on {base['device']}: {len(base['timings'])} kernels in {base['seconds']:.1f} s "
              f"({args.repeats} samples each; {base['not_timed']} not timed)\n")
        print("| kernel | dtype | elements | median µs | IQR % | GB/s | of copy bandwidth |")
        print("|---|---|---:|---:|---:|---:|---:|")
        for t in base["timings"]:
            if t["error"]:
                print(f"| {t['kernel']} | {t['param_dtype']} | {t['size']} | error: {t['error'][:80]} | | | |")
                continue
            k, c = summarize(t["samples_s"]), summarize(t["copy_samples_s"])
            print(f"| {t['kernel']} | {t['param_dtype']} | {t['size']} | {k.median_s * 1e6:.2f} | "
                  f"{100 * k.relative_spread:.1f} | {t['bytes_moved'] / k.median_s / 1e9:.0f} | "
                  f"{100 * c.median_s / k.median_s:.0f} % |")
        baseline = _by_key(base)
        copy_bw = [t["bytes_moved"] / summarize(t["copy_samples_s"]).median_s for t in base["timings"]
                   if not t["error"] and t["size"] == max(args.sizes)]
        if copy_bw:
            print(f"\ncopy bandwidth at {max(args.sizes)} elements (same bytes as each kernel): "
                  f"{min(copy_bw) / 1e9:.0f}–{max(copy_bw) / 1e9:.0f} GB/s")

        reruns = []
        for index in range(args.reruns):
            if time.monotonic() - started > args.max_s:
                print(f"\n(stopped after {index} reruns: --max-s {args.max_s:g})")
                break
            again = _by_key(_spawn(args, built.library_path, Path(tmp) / f"rerun{index}.json", []))
            flagged = [(key, compare(again[key]["samples_s"], baseline[key]["samples_s"]))
                       for key in baseline if key in again]
            drift = [abs(summarize(again[key]["samples_s"]).median_s / summarize(baseline[key]["samples_s"]).median_s - 1)
                     for key in baseline if key in again and key[2] == max(args.sizes)]
            slower = [(key, c) for key, c in flagged if c.verdict == "slower"]
            reruns.append({"flagged": len(slower), "compared": len(flagged), "max_median_drift": max(drift, default=0.0),
                           "slower": [[*key, c.ratio, c.low, c.high] for key, c in slower]})
            print(f"rerun {index + 1}: {len(slower)} of {len(flagged)} kernels flagged slower; largest "
                  f"|median change| at {max(args.sizes)} elements {100 * max(drift, default=0.0):.2f} %"
                  + "".join(f"\n    flagged {k[0]} {k[1]} n={k[2]}: x{c.ratio:.3f} [{c.low:.3f}, {c.high:.3f}]"
                            for k, c in slower))
        unflagged = sum(1 for r in reruns if r["flagged"] == 0)
        print(f"\nno-change reruns with no kernel flagged: {unflagged} of {len(reruns)} "
              f"(threshold {SLOWDOWN_THRESHOLD:.0%}, {CONFIDENCE:.0%} bootstrap interval)")

        mutant_rows = []
        if args.mutant:
            slowed = _by_key(_spawn(args, built.library_path, Path(tmp) / "mutant.json", args.mutant))
            print(f"\n## Mutant: {', '.join(args.mutant)} with an extra pass over {args.mutant_fraction:.0%} of the parameter\n")
            print("| kernel | dtype | elements | ratio of medians | interval | verdict |")
            print("|---|---|---:|---:|---|---|")
            others_flagged = 0
            for key in baseline:
                if key not in slowed:
                    continue
                c = compare(slowed[key]["samples_s"], baseline[key]["samples_s"])
                if key[0] in args.mutant:
                    print(f"| {key[0]} | {key[1]} | {key[2]} | {c.ratio:.3f} | [{c.low:.3f}, {c.high:.3f}] | **{c.verdict}** |")
                    mutant_rows.append([*key, c.ratio, c.low, c.high, c.verdict])
                else:
                    others_flagged += c.verdict == "slower"
            print(f"\nunmutated kernels flagged in the mutant's run: {others_flagged}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"baseline": base, "reruns": reruns, "mutant": mutant_rows}))
    print(f"\ntotal {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
