"""The warm run's kernels-only pass by layout, and where its gradient phase goes (issue 18, round 10).

    python bench/kernels_only_layout.py [--battery standard] [--device auto] [--repeats 5]
                                        [--merge 0.75 0.0] [--json-out F]

In this process, on the loaded bundled build (as bench/warm_battery_profile.py's part 2): the
kernels-only pass of the whole battery (worker.engine.kernels_only.run_kernels_only, what a warm
commit's kernel host runs) for each `--merge`, the width classes' merge fraction
(worker.engine.fast.KERNELS_ONLY_MERGE_PADDING_FRACTION; 0.75 merged every row narrower than 64K
into the 64K class until round 9, 0.0 is round 10's). Each runs `--repeats` times, interleaved
(merge a, b, a, b, ...: a drift of the machine falls on both); the table gives the median wall
time (to the device's last result), the host's seconds per phase of the median run, and whether
every digest of every case equals the first run's (the bits must not depend on the layout). Then,
for each merge, one pass with the gradient phase split into its parts on the host clock (the
step's inputs taken, uploaded, the graph replayed, and the rest of the phase) and whether the
inputs were page-locked: an upload from pageable memory waits for the device to finish what was
queued before it.

Round 10 also measured a step's kernel calls shared out over 2-4 threads, each on its own CUDA
stream (commit d35c1e4, this bench's first form): slower at every count, so dropped
(docs/perf-log/2026-12-03-round-10.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402


def timed_pass(cases, device, families) -> tuple[float, dict, list]:  # noqa: ANN001
    import torch

    from worker.engine.kernels_only import run_kernels_only

    phases: dict[str, float] = {}
    started = time.perf_counter()
    results = run_kernels_only(cases, device, families=families, rerun_broken=False, profile=phases)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - started
    return wall, phases, [None if r is None else (r.status, tuple(r.trajectory.digests) if r.trajectory else None)
                          for r in results]


def gradient_parts(cases, device, families) -> dict[str, float]:  # noqa: ANN001
    """One pass with `_Wave.graphed_gradients`' parts timed on the host clock; "phase" is the
    whole phase as run_waves times it (the rest: the layout's first steps, the capture)."""
    import torch

    from worker.engine import fast

    parts = {"take_inputs": 0.0, "upload": 0.0, "replay": 0.0, "first_steps": 0.0, "steps": 0, "pinned": 0}
    real = fast._Wave.graphed_gradients

    def timed(self, step, inputs):  # noqa: ANN001, ANN202
        started = time.perf_counter()
        values, masks = inputs.get_host(step)
        taken = time.perf_counter()
        held = self.gradient_graphs.get(id(inputs.layout(step)))
        if held is None:  # the layout's first step: eager ops and the capture
            inputs._futures[step] = _done((values, masks))
            real(self, step, inputs)
            parts["first_steps"] += time.perf_counter() - started
            return
        graph, (value_buffer, mask_buffer) = held
        value_buffer.copy_(values, non_blocking=True)
        mask_buffer.copy_(masks, non_blocking=True)
        uploaded = time.perf_counter()
        graph.replay()
        done = time.perf_counter()
        parts["take_inputs"] += taken - started
        parts["upload"] += uploaded - taken
        parts["replay"] += done - uploaded
        parts["steps"] += 1
        parts["pinned"] += int(values.is_pinned() and masks.is_pinned())

    fast._Wave.graphed_gradients = timed
    try:
        _, phases, _ = timed_pass(cases, device, families)
    finally:
        fast._Wave.graphed_gradients = real
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    parts["phase"] = phases.get("gradients", 0.0)
    return parts


def _done(value):  # noqa: ANN001, ANN202
    from concurrent.futures import Future

    future: Future = Future()
    future.set_result(value)
    return future


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="standard")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--merge", type=float, nargs="+", default=[0.75, 0.0])
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    import torch

    from worker.adapters import get_adapter
    from worker.engine import fast, harness
    from worker.engine.environment import resolve_device

    device_name = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = resolve_device(device_name)
    cases = load_battery(args.battery).expand()
    build = build_extension(Path(__file__).resolve().parents[1] / "csrc", cuda_archs=[] if device.type == "cpu" else None)
    if not build.ok:
        raise SystemExit(f"the bundled kernels do not build: {build.error}")
    torch.set_num_threads(1)  # as the kernel host runs (worker/engine/host/child.py --threads)
    harness.ensure_loaded(device)
    adapter = get_adapter("bundled")
    adapter.load(build.library_path)
    families = adapter.families()
    print(f"{args.battery}: {len(cases)} cases on {device}", flush=True)
    timed_pass(cases, device, families)  # one-time work (allocator, first captures) paid here

    figures: dict = {"cases": len(cases)}
    runs: dict[float, list] = {merge: [] for merge in args.merge}
    default = dict(fast.KERNELS_ONLY_MERGE_PADDING_FRACTION)
    first_bits = None
    try:
        for _ in range(args.repeats):
            for merge in args.merge:
                fast.KERNELS_ONLY_MERGE_PADDING_FRACTION[device.type] = merge
                run = timed_pass(cases, device, families)
                first_bits = first_bits if first_bits is not None else run[2]
                runs[merge].append(run)
        parts = {}
        for merge in args.merge:
            fast.KERNELS_ONLY_MERGE_PADDING_FRACTION[device.type] = merge
            parts[merge] = gradient_parts(cases, device, families)
    finally:
        fast.KERNELS_ONLY_MERGE_PADDING_FRACTION.update(default)

    print(f"\n{'merge':>6} {'median s':>9} {'min s':>7} {'max s':>7} {'setup':>7} {'grads':>7} {'kernels':>8} "
          f"{'results':>8}  identical")
    ok = True
    for merge, merge_runs in runs.items():
        walls = [wall for wall, _, _ in merge_runs]
        _, phases, _ = sorted(merge_runs, key=lambda run: run[0])[len(merge_runs) // 2]
        identical = all(bits == first_bits for _, _, bits in merge_runs)
        ok = ok and identical
        label = f"merge{merge:g}"
        figures[f"{label}_wall_s"] = statistics.median(walls)
        figures[f"{label}_walls_s"] = walls
        figures[f"{label}_identical"] = int(identical)
        figures.update({f"{label}_host_{name.split(' ')[0]}_s": seconds for name, seconds in phases.items()})
        figures.update({f"{label}_gradient_part_{name}": value for name, value in parts[merge].items()})
        print(f"{merge:>6g} {statistics.median(walls):>9.3f} {min(walls):>7.3f} {max(walls):>7.3f} "
              f"{phases.get('setup', 0.0):>7.3f} {phases.get('gradients', 0.0):>7.3f} {phases.get('kernels', 0.0):>8.3f} "
              f"{phases.get('results (incl. waiting for the GPU)', 0.0):>8.3f}  {'yes' if identical else 'NO'}")
    for merge in args.merge:
        print(f"gradient phase, merge {merge:g}, host seconds:", json.dumps(parts[merge]), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(figures, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
