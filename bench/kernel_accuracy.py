"""Max error of every 32-bit op against its float64 reference, per dtype and hyperparameter point.

    python bench/kernel_accuracy.py [--device cuda] [--size 65536] [--steps 50]

Builds csrc (digest-cached), loads it in this process, runs each op for `--steps` steps on an
open-loop gradient stream through the engine (worker.engine.trajectory.run_case) and prints, per op,
dtype and point, the largest max |p - p_float64| and relative error over all steps. These are the
figures docs/KERNELS.md records for the CPU and the H200.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from service.core.results import GradientStreamSpec  # noqa: E402
from worker.adapters import bundled_ops  # noqa: E402
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case  # noqa: E402
from worker.build import build_extension  # noqa: E402
from worker.engine.trajectory import run_case  # noqa: E402

OPTIMIZERS = ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]
DTYPES = ["float32", "float16", "bfloat16"]
POINTS = {"lr=1e-3 wd=1e-2": (1e-3, 1e-2), "lr=1e-1 wd=1e-1": (1e-1, 1e-1), "lr=1e-3 wd=0": (1e-3, 0.0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--source", type=Path, default=REPO / "csrc")
    args = parser.parse_args()

    archs = None if args.device == "cuda" else []
    build = build_extension(args.source, cuda_archs=archs)
    if not build.ok:
        raise SystemExit(f"build failed:\n{build.error}")
    bundled_ops.load_build(build.library_path)
    device = torch.device(args.device)

    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    table = Table(title=f"max error vs float64 over {args.steps} steps, n={args.size}, {name}")
    for column in ("op", "dtype", "point", "max |Δ|", "max rel"):
        table.add_column(column, justify="right" if column.startswith("max") else "left")
    for optimizer in OPTIMIZERS:
        for dtype in DTYPES:
            for label, (lr, wd) in POINTS.items():
                case = make_case(optimizer=optimizer, family="32bit", param_dtype=dtype,
                                 hyper={**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": lr, "weight_decay": wd}, gradient=GradientStreamSpec(),
                                 seed=0, size=args.size, steps=args.steps)
                result = run_case(case, device)
                trajectory = result.trajectory
                table.add_row(optimizer, dtype, label, f"{max(trajectory.ref64_max_abs):.3e}",
                              f"{max(trajectory.ref64_max_rel):.3e}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
