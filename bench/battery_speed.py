"""The standard battery the straightforward way and the optimized way in one process: digests and
every per-step series compared bit for bit, both times and the ratio printed.

    python bench/battery_speed.py [--battery standard] [--device auto] [--straight-budget-s 60]

Straightforward = worker.engine.trajectory.run_case: eager, one case at a time, a host sync every step (the
digest's copy), as bitsandbytes' own test loop runs. Optimized = worker.engine.fast.run_cases_fast.

When the straightforward way of the whole battery would not fit in --straight-budget-s, it runs the
cases in a fixed random order (--sample-seed) until the budget is spent, and the full time is
extrapolated per stratum (kernel family x size: mean seconds per step of the sampled cases); the
output says so and also gives the ratio measured directly on the sampled cases (the fast way run on
exactly those cases too). Every sampled case is compared field by field with the fast result.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from worker.adapters import bundled_ops  # noqa: E402
from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine.environment import fingerprint, resolve_device  # noqa: E402
from worker.engine.fast import DEFAULT_MAX_WAVE_ELEMENTS, bundle_count, plan_waves, run_cases_fast  # noqa: E402
from worker.engine.trajectory import run_case  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mismatches(slow, fast) -> list[str]:  # noqa: ANN001
    out = []
    for s, f in zip(slow, fast):
        if s.status != f.status or s.message != f.message:
            out.append(f"{s.case.case_id}: status {s.status} vs {f.status}")
            continue
        if s.trajectory is None:
            continue
        a, b = s.trajectory.model_dump(), f.trajectory.model_dump()
        for field_name in a:
            if repr(a[field_name]) != repr(b[field_name]):  # repr: NaN == NaN, -0.0 != 0.0
                out.append(f"{s.case.case_id}: {field_name} differs")
                break
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "csrc")
    parser.add_argument("--straight-budget-s", type=float, default=60.0)
    parser.add_argument("--sample-seed", type=int, default=0)
    parser.add_argument("--floor-us", type=float, default=None,
                        help="graph-replayed optimizer step from bench/floors.py, to print the case-step ratio")
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()

    device = resolve_device(args.device)
    torch.set_num_threads(1)  # as the kernel host runs
    build = build_extension(args.source, cuda_archs=[] if device.type == "cpu" else None)
    if not build.ok:
        print(f"build failed:\n{build.error}", file=sys.stderr)
        return 1
    bundled_ops.load_build(build.library_path)
    battery = load_battery(args.battery)
    cases = battery.expand()
    total_steps = sum(c.steps for c in cases)
    env = fingerprint(device)
    print(f"battery {battery.name} v{battery.version}: {len(cases)} cases, {total_steps} case-steps, "
          f"{bundle_count(cases, device.type)} bundles (float64 reference objects), "
          f"{len(plan_waves(cases, DEFAULT_MAX_WAVE_ELEMENTS.get(device.type, DEFAULT_MAX_WAVE_ELEMENTS['cpu'])))} waves; "
          f"{env.class_key}")

    # Warm-up (CUDA context, allocator, cuBLAS-free kernels' first launches), not timed.
    warm = [c for c in cases if c.size <= 4097][:4]
    for case in warm:
        run_case(case, device)
    run_cases_fast(warm, device)
    _sync(device)

    profile: dict[str, float] = {}
    started = time.perf_counter()
    fast = run_cases_fast(cases, device, profile=profile)
    _sync(device)
    fast_s = time.perf_counter() - started
    print(f"optimized run: {fast_s:.2f} s; host seconds by phase: "
          + ", ".join(f"{name} {seconds:.2f}" for name, seconds in profile.items()), flush=True)

    order = list(range(len(cases)))
    random.Random(args.sample_seed).shuffle(order)
    sampled: list[int] = []
    slow_results = {}
    per_case_s = {}
    started = time.perf_counter()
    for index in order:
        if time.perf_counter() - started > args.straight_budget_s:
            break
        case_started = time.perf_counter()
        slow_results[index] = run_case(cases[index], device)
        _sync(device)
        per_case_s[index] = time.perf_counter() - case_started
        sampled.append(index)
    slow_sampled_s = time.perf_counter() - started
    complete = len(sampled) == len(cases)

    started = time.perf_counter()
    fast_subset = run_cases_fast([cases[i] for i in sampled], device)
    _sync(device)
    fast_subset_s = time.perf_counter() - started

    mismatches = _mismatches([slow_results[i] for i in sampled], [fast[i] for i in sampled])
    mismatches += _mismatches([slow_results[i] for i in sampled], fast_subset)

    if complete:
        slow_total_s, how = slow_sampled_s, "measured (whole battery)"
    else:
        per_step = defaultdict(list)
        for index in sampled:
            case = cases[index]
            per_step[(case.family, case.size)].append(per_case_s[index] / case.steps)
        mean = {key: sum(v) / len(v) for key, v in per_step.items()}
        slow_total_s, guessed = 0.0, set()
        for case in cases:
            key = (case.family, case.size)
            if key not in mean:  # nearest sampled size of the family, scaled by the size ratio
                guessed.add(key)
                near = min((k for k in mean if k[0] == case.family), key=lambda k: abs(k[1] - case.size))
                mean[key] = mean[near] * max(1.0, case.size / near[1])
            slow_total_s += mean[key] * case.steps
        how = (f"EXTRAPOLATED from a random {len(sampled)}-case sample ({slow_sampled_s:.1f} s measured), "
               f"per (family, size) mean seconds per step" + (f"; strata not sampled, scaled from the nearest "
               f"size: {sorted(guessed)}" if guessed else ""))

    per_case_step_us = fast_s / total_steps * 1e6
    print(f"{'way':40s} {'seconds':>10s}")
    print(f"{'straightforward, whole battery':40s} {slow_total_s:10.2f}  {how}")
    print(f"{'optimized (fast_engine), whole battery':40s} {fast_s:10.2f}  measured")
    print(f"ratio straightforward/optimized, whole battery: {slow_total_s / fast_s:.1f}x")
    print(f"same {len(sampled)} sampled cases: straightforward {slow_sampled_s:.2f} s, optimized {fast_subset_s:.2f} s, "
          f"ratio {slow_sampled_s / fast_subset_s:.1f}x (measured)")
    print(f"optimized: {per_case_step_us:.1f} us per case-step"
          + (f" = {per_case_step_us / args.floor_us:.1f}x the graph-replay floor ({args.floor_us:.2f} us)"
             if args.floor_us else ""))
    print(f"bit identity: {len(sampled)} cases compared (digests and every per-step series, both the full "
          f"and the subset fast run): {len(mismatches)} mismatches")
    for line in mismatches[:20]:
        print("  MISMATCH", line)
    if args.json_out:
        args.json_out.write_text(json.dumps({
            "battery": battery.name, "cases": len(cases), "case_steps": total_steps, "environment": env.class_key,
            "fast_s": fast_s, "straight_total_s": slow_total_s, "straight_how": how, "sampled_cases": len(sampled),
            "straight_sampled_s": slow_sampled_s, "fast_subset_s": fast_subset_s, "mismatches": mismatches,
            "per_case_step_us": per_case_step_us, "profile": profile}, indent=1))
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
