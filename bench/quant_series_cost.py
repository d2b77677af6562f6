"""What the quantization-aware references cost the fast engine (issue 37: direction for quantized
states), and what they measure on a correct build.

    python bench/quant_series_cost.py [--battery quick] [--device cpu|cuda|auto] [--repeats 2]

Builds the bundled kernels (cached by digest), loads them into this process and runs the battery
through worker.engine.fast.run_cases_fast with its per-phase profile, once as the engine runs it
(every 8-bit case of an optimizer in blockwise_quant.QUANT_AWARE_OPTIMIZERS steps its
quantization-aware reference: worker/engine/quant_series.py) and once with none (the set emptied
for this process). Prints a table: the cases that record the figures, their element-steps, the
"quantized references" phase's seconds, the whole run's seconds with and without (best of
--repeats), and the largest figure a correct build records (quant_ref_steps, in quantization
steps). Nothing here changes a result.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from worker.adapters import bundled_ops  # noqa: E402
from worker.battery import load_battery  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine import quant_series  # noqa: E402
from worker.engine.fast import run_cases_fast  # noqa: E402


def _timed(cases, device: torch.device, repeats: int) -> tuple[float, dict[str, float], list]:  # noqa: ANN001
    best, best_profile, results = float("inf"), {}, []
    for _ in range(repeats):
        profile: dict[str, float] = {}
        started = time.perf_counter()
        results = run_cases_fast(cases, device, profile=profile)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - started
        if seconds < best:
            best, best_profile = seconds, profile
    return best, best_profile, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--battery", default="quick")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))

    build = build_extension(Path(__file__).resolve().parent.parent / "csrc",
                            cuda_archs=None if device.type == "cuda" else [])
    if not build.ok:
        print(f"build failed:\n{build.error}", file=sys.stderr)
        return 1
    bundled_ops.load_build(build.library_path)
    cases = load_battery(args.battery).expand()

    with_seconds, with_profile, results = _timed(cases, device, args.repeats)
    recorded = [r for r in results if r.trajectory is not None and r.trajectory.quant_ref_steps is not None]
    measured_optimizers = quant_series.QUANT_AWARE_OPTIMIZERS
    quant_series.QUANT_AWARE_OPTIMIZERS = frozenset()  # this process only: the run without them
    try:
        without_seconds, _, _ = _timed(cases, device, args.repeats)
    finally:
        quant_series.QUANT_AWARE_OPTIMIZERS = measured_optimizers

    table = Table(title=f"quantization-aware references in the fast engine: battery {args.battery}, {device}")
    for column in ("cases", "with figures", "element-steps", "phase s", "run s (with)", "run s (without)",
                   "largest figure"):
        table.add_column(column, justify="right")
    element_steps = sum(r.case.size * r.case.steps for r in recorded)
    largest = max((max(r.trajectory.quant_ref_steps) for r in recorded), default=float("nan"))
    table.add_row(str(len(cases)), str(len(recorded)), f"{element_steps:,}",
                  f"{with_profile.get('quantized references', 0.0):.3f}", f"{with_seconds:.2f}",
                  f"{without_seconds:.2f}", f"{largest:.2e}")
    Console(width=140).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
