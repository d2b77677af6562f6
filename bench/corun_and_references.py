"""The fast co-run and the reference cache, each against the battery's own time, in one call.

    python bench/corun_and_references.py [--battery standard] [--device auto] [--json-out F]

Builds the bundled kernels (the baseline) and the decay-after-update copy (the commit,
worker.mutations), then:

1. the battery on both builds through the kernel host's fast engine, without a reference cache
   (the commit's run is "the battery's own time"; host start excluded, as bench/corun_speed.py);
2. the fast co-run of the changed cases (worker.engine.corun, fast=True; host start included) and
   its ratio to the battery; then the one-case co-run of a sample of those cases
   (`--identity-sample`), whose per-step diffs must equal the fast co-run's (repr);
3. the baseline's battery with an empty reference cache (computed and stored), then warm, and the
   commit warm against the baseline's series (its unchanged cases from the cache): times, the
   cache's size, and every series and digest compared with the runs of step 1.

Each step prints what it measured as it goes; a step that fails says so and the rest still run;
the summary at the end holds whatever was measured. Exit 1 when a bit-identity check failed or a
step could not run.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corun_builds import resolve_device  # noqa: E402  (bench/, this script's folder)

from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine import reference_cache  # noqa: E402
from worker.engine.corun import corun_battery  # noqa: E402
from worker.engine.host import KernelHost  # noqa: E402
from worker.mutations import copy_tree, decay_after_update  # noqa: E402

summary: dict[str, object] = {}
failures: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)


def step(name: str):  # noqa: ANN201
    """Run the decorated function now; a failure is printed and recorded, never raised."""
    def run(function):  # noqa: ANN001, ANN202
        say(f"\n== {name}")
        try:
            function()
        except Exception:  # noqa: BLE001 - a bench step reports and the next one runs
            failures.append(name)
            say(f"FAILED: {name}\n{traceback.format_exc()}")
        return function
    return run


def series(results) -> list:  # noqa: ANN001
    return [(r.case.case_id, r.status, repr(r.trajectory.model_dump()) if r.trajectory else r.message)
            for r in results]


def timed_run(library: str, cases, device: str, cache=None):  # noqa: ANN001, ANN201
    """(results, seconds without the host's start) of `cases` on one build, fast engine."""
    with KernelHost(library, device=device, case_timeout_s=600) as host:
        host.start()
        started = time.perf_counter()
        results = reference_cache.run_many(host, cases, cache)
        return results, time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--identity-sample", type=int, default=12,
                        help="changed cases co-run the one-case way too and compared (0: none)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    device = resolve_device(args.device)
    archs = [] if device == "cpu" else None
    root = Path(__file__).resolve().parents[1] / "csrc"
    battery = load_battery(args.battery)
    cases = battery.expand()
    builds: dict = {}
    runs: dict = {}
    state: dict = {}
    say(f"{args.battery} battery ({len(cases)} cases), device {device}")

    @step("build the baseline (csrc) and the commit (decay after update)")
    def _builds() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            mutant = decay_after_update(copy_tree(root, Path(tmp) / "mutant"))
            for name, tree in (("baseline", root), ("commit", mutant)):
                started = time.perf_counter()
                builds[name] = build_extension(tree, cuda_archs=archs)
                if not builds[name].ok:
                    raise RuntimeError(f"{name} does not build: {builds[name].error}")
                say(f"{name}: {'cached' if builds[name].cached else 'built'} in {time.perf_counter() - started:.1f} s")

    @step("the battery on both builds, no reference cache")
    def _batteries() -> None:
        for name in ("baseline", "commit"):
            runs[name], seconds = timed_run(builds[name].library_path, cases, device)
            summary[f"battery_{name}_s"] = round(seconds, 3)
            say(f"{name}: {seconds:.2f} s")
        state["changed"] = [c for c, a, b in zip(cases, runs["commit"], runs["baseline"])
                            if a.trajectory and b.trajectory and a.trajectory.digests != b.trajectory.digests]
        summary["changed_cases"] = len(state["changed"])
        say(f"changed cases: {len(state['changed'])}")

    @step("fast co-run of the changed cases")
    def _corun() -> None:
        started = time.perf_counter()
        commit, baseline, diffs = corun_battery(battery, builds["commit"].library_path,
                                                builds["baseline"].library_path, device=device,
                                                cases=state["changed"], fast=True, case_timeout_s=600)
        seconds = time.perf_counter() - started
        state["diffs"] = diffs
        ratio = seconds / summary["battery_commit_s"]
        summary.update(corun_fast_s=round(seconds, 3), corun_over_battery=round(ratio, 3), corun_diffs=len(diffs))
        say(f"co-run: {seconds:.2f} s for {len(state['changed'])} cases, {len(diffs)} with diffs; "
            f"{ratio:.2f}x the battery ({summary['battery_commit_s']:.2f} s; issue 14's target: <= 2x)")
        stored = {r.case.case_id: r.trajectory.digests for r in runs["commit"] if r.trajectory}
        reproduced = sum(r.trajectory is not None and r.trajectory.digests == stored.get(r.case.case_id)
                         for r in commit.cases)
        summary["corun_reproduced_battery_digests"] = f"{reproduced}/{len(commit.cases)}"
        say(f"co-run digests equal to the battery run's: {reproduced} of {len(commit.cases)}")
        if reproduced != len(commit.cases) or len(diffs) != len(state["changed"]):
            raise RuntimeError("the co-run did not reproduce the battery's trajectories")

    @step("one-case co-run of a sample, compared with the fast co-run")
    def _identity() -> None:
        sample = random.Random(0).sample(state["changed"], min(args.identity_sample, len(state["changed"])))
        started = time.perf_counter()
        _, _, slow = corun_battery(battery, builds["commit"].library_path, builds["baseline"].library_path,
                                   device=device, cases=sample, params_only=True, case_timeout_s=600)
        seconds = time.perf_counter() - started
        mismatches = [c.case_id for c in sample if repr(slow.get(c.case_id)) != repr(state["diffs"].get(c.case_id))]
        summary.update(identity_sample=len(sample), identity_mismatches=len(mismatches),
                       corun_one_case_sample_s=round(seconds, 3))
        say(f"{len(sample)} cases the one-case way in {seconds:.2f} s; per-step diffs differing: {len(mismatches)}")
        if mismatches:
            raise RuntimeError(f"fast and one-case co-runs differ: {mismatches[:5]}")

    @step("references: empty cache, warm cache, the commit warm")
    def _references() -> None:
        with tempfile.TemporaryDirectory(prefix="optdrift-bench-references-") as folder:
            cache = reference_cache.ReferenceCache(Path(folder), writable=True)
            checks = {}
            for label, name in (("cold_store", "baseline"), ("warm", "baseline"), ("commit_warm", "commit")):
                results, seconds = timed_run(builds[name].library_path, cases, device, cache)
                same = series(results) == series(runs[name])
                checks[label] = same
                summary[f"references_{label}_s"] = round(seconds, 3)
                say(f"{label} ({name}): {seconds:.2f} s; every series and digest equal to the run without "
                    f"a cache: {same}")
            count, size = cache.size()
            summary.update(reference_cache_series=count, reference_cache_bytes=size,
                           warm_over_cold=round(summary["references_warm_s"] / summary["battery_baseline_s"], 3))
            say(f"cache: {count} series, {size / 1e6:.1f} MB; warm / cold (no cache) = {summary['warm_over_cold']:.2f}")
            if not all(checks.values()):
                raise RuntimeError(f"a warm run differs from the cold one: {checks}")

    say("\n== summary\n" + json.dumps(summary, indent=1))
    if failures:
        say(f"failed steps: {failures}")
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "failed": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
