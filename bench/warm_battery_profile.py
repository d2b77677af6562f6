"""Where a warm-reference battery's time goes (issue 18: the standard battery with warm references).

    python bench/warm_battery_profile.py [--battery standard] [--device auto] [--top 25]

Builds the bundled kernels, fills an empty reference cache with one run, then times the warm run
three ways, each printed as a table of phases and, with --top, the heaviest functions (cProfile):

1. through the kernel host, as the pipeline runs it (worker.engine.reference_cache.run_many):
   the cache lookup, the host's answers arriving, the parent's checks and the store;
2. the host's half in this process (worker.engine.kernels_only.run_cases_known on the loaded
   build, no sandbox, no protocol): what the kernels-only pass itself costs; then, on its own,
   the kernels-only pass without cProfile (its host seconds per wave phase), and on CUDA under
   torch.profiler: the GPU's kernel time and launches against the wall clock (is the pass
   waiting on the GPU, or the GPU on the pass?);
1a. as the worker runs a warm commit: on a spare host that waited `--spare-idle-s` for its build,
   once without and once with the gradient inputs it made meanwhile (worker.engine.step_inputs);
1b. the same, split over 2, 3, 4 kernel hosts running at once (`--split`): whether the
   case-by-case kernel calls, which are host CPU time, spread over processes;
3. the protocol alone: the host's answers for the whole battery encoded and parsed as the
   parent parses them (worker.engine.host.parse_answer / checked_result).

Nothing here changes a result: it reads the same code paths the worker runs.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine import reference_cache  # noqa: E402
from worker.engine.host import KernelHost, checked_result, parse_answer, result_line  # noqa: E402


def top(profile: cProfile.Profile, count: int) -> str:
    if count <= 0:
        return ""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(count)
    return "\n".join(line for line in out.getvalue().splitlines() if line.strip())[-6000:]


def kernels_only_phases(cases, device, known, families, figures: dict, top_count: int) -> None:  # noqa: ANN001
    """The warm run's kernels-only pass (every case here is known) without cProfile: its wall time
    and host seconds per wave phase, then on CUDA once more under torch.profiler."""
    import torch

    from worker.engine.kernels_only import run_kernels_only

    import os

    from worker.engine import fast, od2_op

    subset = [cases[i] for i in sorted(known)]

    def timed_pass(label: str) -> None:
        phases: dict[str, float] = {}
        started = time.perf_counter()
        run_kernels_only(subset, device, families=families, rerun_broken=False, profile=phases)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        figures[f"{label}_wall_s"] = time.perf_counter() - started
        for name, seconds in phases.items():
            figures[f"{label}_host_{name.split(' ')[0]}_s"] = seconds

    figures["od2_fused"] = int(od2_op.fused_for(device))
    timed_pass("kernels_only")
    # Each phase on its own: the device waited for at every phase boundary, so the kernel calls'
    # seconds are their launches (and their own GPU work), not a wait behind the observation's.
    fast.SYNCHRONIZE_PHASES = True
    try:
        timed_pass("kernels_only_synchronized")
    finally:
        fast.SYNCHRONIZE_PHASES = False
    # The same pass with each step's gradients made eagerly (no gradient graph).
    fast.GRAPHED_GRADIENTS = False
    try:
        timed_pass("kernels_only_eager_gradients")
    finally:
        fast.GRAPHED_GRADIENTS = True
    # The same pass with every kernel call made from Python (no C++ loop).
    os.environ["OPTDRIFT_CALL_LOOP"] = "0"
    try:
        timed_pass("kernels_only_python_calls")
    finally:
        del os.environ["OPTDRIFT_CALL_LOOP"]
    if figures["od2_fused"]:  # the same pass with digest.py's torch ops in place of the fused op
        os.environ["OPTDRIFT_OD2_FUSED"] = "0"
        try:
            timed_pass("kernels_only_torch_ops")
        finally:
            del os.environ["OPTDRIFT_OD2_FUSED"]
    setup_profile(subset, device, families, top_count, figures)
    if device.type != "cuda":
        return
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
        started = time.perf_counter()
        run_kernels_only(subset, device, families=families, rerun_broken=False)
        torch.cuda.synchronize(device)
        figures["profiled_wall_s"] = time.perf_counter() - started
    averages = traced.key_averages()
    kernels = [a for a in averages if getattr(a, "device_type", None) == torch.autograd.DeviceType.CUDA]
    figures["gpu_kernel_s"] = sum(a.self_device_time_total for a in kernels) / 1e6
    figures["gpu_kernel_launches"] = sum(a.count for a in kernels)
    print(averages.table(sort_by="self_device_time_total", row_limit=top_count), flush=True)


def setup_profile(cases, device, families, top_count: int, figures: dict) -> None:  # noqa: ANN001
    """The kernels-only waves' setup alone (made, then closed without running): timed with and
    without the gradient threads' prefetch running beside it, then without it under cProfile."""
    import torch

    from worker.engine import fast
    from worker.engine.kernels_only import _KernelsOnlyWave

    def make_all() -> float:
        started = time.perf_counter()
        initial: dict = {}
        closed: dict = {}
        for indices in fast.plan_waves(cases, fast.DEFAULT_MAX_WAVE_ELEMENTS.get(device.type, 1 << 23)):
            wave = _KernelsOnlyWave([cases[i] for i in indices], device, families, initial, closed, None)
            made = time.perf_counter()
            wave.inputs.close()
            wave.close_handles()
            del wave
            started += time.perf_counter() - made  # closing is not setup
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    figures["setup_alone_s"] = make_all()
    prefetch = fast.StepInputs.prefetch
    fast.StepInputs.prefetch = lambda self, step: None
    try:
        figures["setup_alone_no_prefetch_s"] = make_all()
        # cProfile without the gradient threads, so that the table holds the setup's own calls
        profile = cProfile.Profile()
        started = time.perf_counter()
        profile.enable()
        make_all()
        profile.disable()
    finally:
        fast.StepInputs.prefetch = prefetch
    print(f"wave setup alone (no gradient prefetch), under cProfile: {time.perf_counter() - started:.3f} s",
          flush=True)
    print(top(profile, top_count), flush=True)


def _answers(results) -> list[str]:  # noqa: ANN001
    """Every result but its duration, as text: equal texts are equal bits (repr of each float)."""
    return [repr(r.model_dump(exclude={"duration_s"})) for r in results]


def spare_run(library_path, device: str, cases, cache, prepare, idle_s: float, label: str,  # noqa: ANN001
              figures: dict, ready_waves: bool = True, expected: list[str] | None = None) -> None:
    """A spare host started, left waiting `idle_s` (a worker's time between runs), given the build
    and run on the warm cache: the wall clock from the build's hand-over to the last answer.
    `ready_waves`: whether a prepared spare also sets its kernels-only waves up while it waits."""
    spare = KernelHost.spare(device=device, prepare=prepare, ready_waves=ready_waves)
    try:
        time.sleep(idle_s)
        started = time.perf_counter()
        spare.adopt_build(library_path, case_timeout_s=600)
        figures[f"{label}_adopt_s"] = time.perf_counter() - started
        results = reference_cache.run_many(spare, cases, cache, profile=True)
        figures[f"{label}_warm_s"] = time.perf_counter() - started
        if expected is not None:  # the cold run's results, bit for bit
            figures[f"{label}_mismatches"] = sum(a != b for a, b in zip(_answers(results), expected))
        figures[f"{label}_run_many_s"] = figures[f"{label}_warm_s"] - figures[f"{label}_adopt_s"]
        figures[f"{label}_inputs_taken"] = spare.last_inputs_taken
        for name, seconds in spare.last_phases.items():  # the host's clock, its first run
            figures[f"{label}_host_{name.split(' ')[0]}_s"] = seconds
        for name, seconds in spare.last_parent_marks.items():  # the parent's clock, from run_many's call
            figures[f"{label}_parent_{name.replace(' ', '_')}_s"] = seconds
        print(f"{label} startup phases:", json.dumps(spare.startup_s), flush=True)
    finally:
        spare.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--split", type=int, nargs="*", default=[2, 3, 4],
                        help="also run the warm battery split over this many hosts at once")
    parser.add_argument("--spare-idle-s", type=float, default=20.0,
                        help="how long the spare hosts of 1a wait before their build comes")
    parser.add_argument("--prepared-repeats", type=int, default=1,
                        help="how many prepared spares of 1a to time, one after another (the spread "
                             "of issue 18's figure within one machine)")
    parser.add_argument("--unready-repeats", type=int, default=0,
                        help="how many prepared spares that set no waves up ahead to time, interleaved "
                             "with the prepared ones (the A/B of round 13)")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    cases = load_battery(args.battery).expand()
    build = build_extension(Path(__file__).resolve().parents[1] / "csrc", cuda_archs=[] if device == "cpu" else None)
    if not build.ok:
        raise SystemExit(f"the bundled kernels do not build: {build.error}")
    figures: dict[str, float] = {"cases": len(cases)}
    print(f"{args.battery}: {len(cases)} cases on {device}", flush=True)

    with tempfile.TemporaryDirectory(prefix="optdrift-warm-profile-") as folder:
        cache = reference_cache.ReferenceCache(Path(folder), writable=True)
        with KernelHost(build.library_path, device=device, case_timeout_s=600) as host:
            started = time.perf_counter()
            host.start()
            figures["host_start_s"] = time.perf_counter() - started
            print("host startup phases (s since its module started; spawn to ready on the parent's clock):",
                  json.dumps(host.startup_s), flush=True)
            started = time.perf_counter()
            cold = _answers(reference_cache.run_many(host, cases, cache))
            figures["cold_fill_s"] = time.perf_counter() - started
            # 1. the pipeline's way, timed by phase
            environment = host.environment
            started = time.perf_counter()
            held = cache.lookup(environment, cases)
            figures["lookup_s"] = time.perf_counter() - started
            arrivals: list[float] = []
            started = time.perf_counter()
            results = reference_cache.run_many(host, cases, cache, profile=True,
                                               on_result=lambda i, r: arrivals.append(time.perf_counter()))
            figures["warm_run_many_s"] = time.perf_counter() - started
            for name, seconds in host.last_phases.items():  # the host's clock, its second run
                figures[f"warm_host_{name.split(' ')[0]}_s"] = seconds
            figures["warm_first_answer_s"] = arrivals[0] - started if arrivals else float("nan")
            figures["warm_last_answer_s"] = arrivals[-1] - started if arrivals else float("nan")
            # Once more under cProfile, for the table of the parent's heaviest functions (cProfile
            # slows the parent's share, so this run's time is reported apart).
            profile = cProfile.Profile()
            started = time.perf_counter()
            profile.enable()
            reference_cache.run_many(host, cases, cache)
            profile.disable()
            figures["warm_run_many_under_cprofile_s"] = time.perf_counter() - started
            started = time.perf_counter()
            cache.store(environment, [], [(r.case, reference_cache.series_key(r.trajectory.digests))
                                          for r in results if r.trajectory])
            figures["store_reused_s"] = time.perf_counter() - started
            print(top(profile, args.top), flush=True)

        # 1a. as the worker runs a warm commit: on a spare host that waited for its build, without
        # and with the gradient inputs it prepared while waiting (worker.engine.step_inputs)
        # (a spare that prepared its inputs but set no wave up ahead, round 12's way, interleaved
        # with the prepared ones for an A/B on the same machine: --unready-repeats)
        prepared = ["spare_prepared"] + [f"spare_prepared_r{k}" for k in range(2, args.prepared_repeats + 1)]
        unready = [f"spare_unready_r{k}" for k in range(1, args.unready_repeats + 1)]
        order = [("spare", None, True)]
        for k, label in enumerate(prepared):
            order.append((label, cases, True))
            if k < len(unready):
                order.append((unready[k], cases, False))
        for label, prepare, ready_waves in order:
            spare_run(build.library_path, device, cases, cache, prepare, args.spare_idle_s, label, figures,
                      ready_waves=ready_waves, expected=cold)
        print("spares' results differing from the cold run's:",
              sum(figures[f"{label}_mismatches"] for label, _, _ in order), flush=True)
        for name, labels in (("prepared spare", prepared), ("prepared spare, no waves set up ahead", unready)):
            walls = [figures[f"{label}_warm_s"] for label in labels]
            if walls:
                print(f"{name}, hand-over to last result, {len(walls)} run(s): "
                      + ", ".join(f"{w:.3f}" for w in walls) + f" s (median {statistics.median(walls):.3f} s)",
                      flush=True)

        # 1b. the same warm run split over N hosts at once (cases dealt by cost, largest first)
        for count in args.split:
            shares: list[list] = [[] for _ in range(count)]
            loads = [0] * count
            for case in sorted(cases, key=lambda c: -c.size * c.steps):
                lightest = loads.index(min(loads))
                shares[lightest].append(case)
                loads[lightest] += case.size * case.steps
            hosts = [KernelHost(build.library_path, device=device, case_timeout_s=600) for _ in range(count)]
            try:
                started = time.perf_counter()
                with ThreadPoolExecutor(count) as pool:
                    list(pool.map(lambda h: h.start(), hosts))
                figures[f"split{count}_starts_s"] = time.perf_counter() - started
                started = time.perf_counter()
                with ThreadPoolExecutor(count) as pool:
                    split = list(pool.map(lambda pair: reference_cache.run_many(pair[0], pair[1], cache),
                                          zip(hosts, shares)))
                figures[f"split{count}_warm_s"] = time.perf_counter() - started
                by_id = {r.case.case_id: r for share in split for r in share}
                figures[f"split{count}_identical"] = int(all(
                    repr(by_id[r.case.case_id].trajectory) == repr(r.trajectory) for r in results))
            finally:
                for host in hosts:
                    host.close()

        # 2. the host's half in this process
        from worker.adapters import get_adapter
        from worker.engine.environment import resolve_device
        from worker.engine.kernels_only import run_cases_known

        torch.set_num_threads(1)  # as the kernel host runs (worker/engine/host/child.py --threads)
        from worker.engine import harness

        harness.ensure_loaded(resolve_device(device))  # as the kernel host loads it
        adapter = get_adapter("bundled")
        adapter.load(build.library_path)
        families = adapter.families()
        known = {index: set(series) for index, series in held.items()}
        torch_device = resolve_device(device)
        for attempt in range(2):  # the first pays one-time work (graph capture, allocator): reported apart
            profile = cProfile.Profile()
            started = time.perf_counter()
            profile.enable()
            answers = run_cases_known(cases, torch_device, known, families=families)
            if torch_device.type == "cuda":
                torch.cuda.synchronize(torch_device)
            profile.disable()
            figures[f"in_process_known_{attempt + 1}_s"] = time.perf_counter() - started
        print(top(profile, args.top), flush=True)
        kernels_only_phases(cases, torch_device, known, families, figures, args.top)

        # 3. the protocol alone
        started = time.perf_counter()  # as the host writes them (worker.engine.host.result_line)
        lines = [result_line(r, index=i).encode() for i, r in enumerate(answers)]
        figures["protocol_encode_s"] = time.perf_counter() - started
        started = time.perf_counter()  # as it wrote them until round 12, for comparison
        [json.dumps({"index": i, "result": r.model_dump(mode="json")}).encode() + b"\n" for i, r in enumerate(answers)]
        figures["protocol_encode_json_dumps_s"] = time.perf_counter() - started
        started = time.perf_counter()
        for case, line in zip(cases, lines):
            checked_result(parse_answer(line), case)
        figures["protocol_parse_s"] = time.perf_counter() - started
        figures["protocol_bytes"] = sum(len(line) for line in lines)

    width = max(len(k) for k in figures)
    print("\n".join(f"{k:<{width}}  {v:10.3f}" if isinstance(v, float) else f"{k:<{width}}  {v:>10}"
                    for k, v in figures.items()), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
