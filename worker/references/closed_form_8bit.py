"""One step of every 8-bit blockwise kernel from a zero state, against its closed form.

    python -m worker.references.closed_form_8bit [--csrc DIR] [--device cpu|cuda|all] [--json]

Builds `--csrc` (default: the bundled csrc; digest-cached in OPTDRIFT_BUILD_CACHE_DIR (or the older OPTDRIFT_BUILD_CACHE) or
.optdrift/test-build-cache), loads it into this process (one build per process) and prints, per
device and optimizer, at lr=0.1, wd=0.1, fp32, 4097 elements (16 full blocks and one of 1):
  distance   max |kernel - closed form|           (should be within `bound`)
  bound      max float32 rounding bound of the step (worker/references/blockwise8.py)
  ordering   max |decay-after-update - closed form| (adam/ademamix: the PR-2040 gap, lr·wd·|lr·u|)
  to_wrong   max |kernel - decay-after-update form|
  verdict    'ok' when every element is within its bound, else 'FLAGGED'
The acceptance test runs it on a mutated copy in a subprocess; on a GPU host it is the command
that records the CUDA figures of docs/KERNELS_8BIT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

OPTIMIZERS = ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]
SIZE = 4097
POINT = {"lr": 0.1, "weight_decay": 0.1}


def measure(kernels, optimizer: str, device: str, seed: int = 0) -> dict:
    from worker.references import blockwise8 as ref8
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS
    from worker.references.quant_map import dynamic_map

    h = {**OPTIMIZER_HYPER_DEFAULTS[optimizer], **POINT}
    generator = torch.Generator().manual_seed(seed)
    param0 = torch.randn(SIZE, generator=generator).to(device)
    grad = torch.randn(SIZE, generator=generator).to(device)
    signed_map, unsigned_map = dynamic_map(signed=True, device=device), dynamic_map(signed=False, device=device)
    states = kernels.new_states_8bit(optimizer, param0, signed_map, unsigned_map)
    reference = ref8.reference_step(optimizer, h, 1, param0, grad, [c for c, _ in states.values()],
                                    [a for _, a in states.values()], signed_map, unsigned_map)
    param = param0.clone()
    kernels.step_8bit(optimizer, param, grad, states, step=1, hyper=h, signed_map=signed_map,
                      unsigned_map=unsigned_map)
    closed = ref8.closed_form_first_step(optimizer, h, param0, grad)
    distance = (param.to(torch.float64) - closed).abs()
    row = {"device": device, "optimizer": optimizer, "distance": float(distance.max()),
           "bound": float(reference.param_bound.max()),
           "within_bound": bool((distance <= reference.param_bound).all()),
           "ordering": None, "to_wrong": None}
    if optimizer in ("adam", "ademamix"):
        wrong = ref8.decay_after_update_first_step(optimizer, h, param0, grad)
        row["ordering"] = float((wrong - closed).abs().max())
        row["to_wrong"] = float((param.to(torch.float64) - wrong).abs().max())
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--csrc", type=Path, default=Path(__file__).resolve().parents[2] / "csrc")
    parser.add_argument("--device", choices=["cpu", "cuda", "all"], default="all")
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    args = parser.parse_args(argv)

    from worker.adapters import bundled_ops
    from worker.build import build_extension

    cache = Path(os.environ.get("OPTDRIFT_BUILD_CACHE_DIR") or os.environ.get("OPTDRIFT_BUILD_CACHE")
                 or Path(__file__).resolve().parents[2] / ".optdrift" / "test-build-cache")
    build = build_extension(args.csrc, cache_dir=cache)
    if not build.ok:
        print(f"building {args.csrc} failed:\n{build.error}", file=sys.stderr)
        return 2
    bundled_ops.load_build(build.library_path)
    devices = ["cpu", "cuda"] if args.device == "all" else [args.device]
    devices = [d for d in devices if d == "cpu" or (torch.cuda.is_available() and build.cuda_archs)]
    rows = [measure(bundled_ops, optimizer, device) for device in devices for optimizer in OPTIMIZERS]
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"build {build.digest[:16]} ({'cuda ' + ','.join(build.cuda_archs) if build.cuda_archs else 'cpu only'}), "
          f"one step from zero at lr=0.1 wd=0.1, fp32, n={SIZE}")
    print(f"{'device':6} {'optimizer':9} {'distance':>24} {'bound':>24} {'ordering':>24} {'to_wrong':>24}  verdict")
    for r in rows:
        fmt = lambda v: "-" if v is None else repr(v)  # noqa: E731  (full precision)
        print(f"{r['device']:6} {r['optimizer']:9} {fmt(r['distance']):>24} {fmt(r['bound']):>24} "
              f"{fmt(r['ordering']):>24} {fmt(r['to_wrong']):>24}  {'ok' if r['within_bound'] else 'FLAGGED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
