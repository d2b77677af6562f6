"""What one kernel call costs the host, by layer; prints a table (docs/perf-log/2026-12-02-round-8.md).

    python bench/op_call_cost.py [--device cuda] [--calls 20000]

The warm battery's kernel-call phase is ~87,000 calls of the bundled ops, one per case and step,
each through the op's Python API as the fast engine binds it (worker.adapters.bundled_ops.bind_step).
This times N back-to-back calls on the host clock (the device is synchronised before and after;
every kernel here runs for a few microseconds, so the device never holds the host back) for:

* an empty Python function (the loop and call floor);
* a 1-element in-place add as a tensor method, and the same aten op through torch.ops;
* the bound 32-bit adam_step and 8-bit adam step on 4097 elements (what the battery calls),
  with and without torch.inference_mode (which skips the autograd and view-tracking layers);
* the 32-bit op called through torch.ops' overload packet with every argument spelled out;
* both bound ops made by the harness's C++ loop (worker.engine.call_loop), 1000 calls per run,
  through the dispatcher's autograd layer and below it (as the loop makes them by default).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from worker.build import build_extension  # noqa: E402
from worker.adapters import bundled_ops  # noqa: E402
from worker.references.quant_map import dynamic_map  # noqa: E402


def per_call_us(fn, calls: int, device: torch.device) -> float:  # noqa: ANN001
    for step in range(1, 201):
        fn(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for step in range(1, calls + 1):
        fn(step)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - started) / calls * 1e6


def _per_run(calls, per_run: int) -> tuple:  # noqa: ANN001
    def run(step: int) -> None:
        if calls.run(step):
            raise RuntimeError("a prepared call raised")
    return run, per_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--size", type=int, default=4097)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(1)
    build = build_extension(Path(__file__).resolve().parents[1] / "csrc", cuda_archs=[] if device.type == "cpu" else None)
    if not build.ok:
        raise SystemExit(f"the bundled kernels do not build: {build.error}")
    bundled_ops.load_build(build.library_path)

    one = torch.zeros(1, device=device)
    param, grad = torch.zeros(args.size, device=device), torch.zeros(args.size, device=device)
    states = {name: torch.zeros(args.size, device=device) for name in bundled_ops.OPTIMIZER_STATES["adam"]}
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    bound = bundled_ops.bind_step("adam", param, grad, states, hyper=hyper)
    signed, unsigned = dynamic_map(signed=True, device=device), dynamic_map(signed=False, device=device)
    param8 = torch.zeros(args.size, device=device)
    states8 = bundled_ops.new_states_8bit("adam", param8, signed, unsigned)
    bound8 = bundled_ops.bind_step_8bit("adam", param8, torch.zeros_like(param8), states8, hyper=hyper,
                                      signed_map=signed, unsigned_map=unsigned)
    packet = torch.ops.optdrift.adam_step
    aten_add = torch.ops.aten.add_.Scalar

    def in_inference(fn):  # noqa: ANN001, ANN202
        def call(step: int) -> None:
            with torch.inference_mode():
                fn(step)
        return call

    rows = [
        ("empty Python function", lambda step: None),
        ("1-element add_ (tensor method)", lambda step: one.add_(1.0)),
        ("1-element add_ through torch.ops.aten", lambda step: aten_add(one, 1.0)),
        (f"adam_step, bound as the engine binds it (n = {args.size})", bound),
        ("adam_step through the overload packet, every argument", lambda step: packet(
            param, grad, states["exp_avg"], states["exp_avg_sq"], step, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, False)),
        ("adam_step, bound, each call in inference_mode", in_inference(bound)),
        (f"adam 8-bit blockwise, bound (n = {args.size})", bound8),
    ]
    from worker.engine import call_loop, harness

    if harness.ensure_loaded(device):  # the same calls from C++, 1000 prepared per run
        per_run = 1000
        for label, step_fn in (("adam_step", bound), ("adam 8-bit blockwise", bound8)):
            for below in (False, True):
                calls = call_loop.prepare([step_fn] * per_run, [1 << 30] * per_run, set(), below_autograd=below)
                where = "below autograd" if below else "through autograd"
                rows.append((f"{label}, C++ loop (call_loop), {where}", _per_run(calls, per_run)))
    else:
        print("the harness library is not available: no C++ loop rows")
    print(f"host microseconds per call, {args.calls} calls back to back on {device} "
          f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'})")
    for name, fn in rows:
        calls = args.calls
        if isinstance(fn, tuple):  # (run one step of many prepared calls, calls per run)
            fn, per_run = fn
            calls = max(1, args.calls // per_run)
            print(f"{name:<62} {per_call_us(fn, calls, device) / per_run:8.2f}", flush=True)
            continue
        print(f"{name:<62} {per_call_us(fn, calls, device):8.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
