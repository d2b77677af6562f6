"""Bandwidth of one CUDA Adam step of the bundled kernels on 2^26 fp32 parameters; prints a table.

    python bench/adam_bandwidth.py [--library path/to/optdrift_kernels_*.so] [--log2-numel 26]

Without --library it builds csrc/ for the GPU present through worker.build. The Adam update reads
param, grad, exp_avg, exp_avg_sq and writes param, exp_avg, exp_avg_sq: 28 bytes a parameter. The
yardstick is torch's device-to-device copy measured in the same run (read + write: 8 bytes a
float32), and torch's fused AdamW on the same tensors for scale. Each figure is the median of
CUDA-event-timed repetitions after warm-up. Target (issue 2): Adam >= 80 % of the copy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.adapters import bundled_ops  # noqa: E402

ADAM_BYTES_PER_PARAM = 28
COPY_BYTES_PER_ELEMENT = 8


def median_ms(run, repetitions: int, warmup: int = 5) -> float:
    for _ in range(warmup):
        run()
    torch.cuda.synchronize()
    times = []
    for _ in range(repetitions):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def build_library() -> str:
    from worker.build import build_extension

    result = build_extension(Path(__file__).resolve().parents[1] / "csrc")
    if not result.ok:
        raise SystemExit(f"building csrc failed:\n{result.error}\n(log: {result.log_path})")
    print(f"built {result.library_path} (archs {result.cuda_archs}, cached={result.cached}, "
          f"{result.duration_s:.1f} s)")
    return result.library_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--library", help="a built optdrift_kernels_*.so (default: build csrc)")
    parser.add_argument("--log2-numel", type=int, default=26)
    parser.add_argument("--repetitions", type=int, default=50)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    bundled_ops.load_build(args.library or build_library())

    numel = 1 << args.log2_numel
    device = torch.device("cuda")
    param = torch.randn(numel, device=device)
    grad = torch.randn(numel, device=device)
    exp_avg = torch.zeros(numel, device=device)
    exp_avg_sq = torch.zeros(numel, device=device)
    step = [0]

    def adam_step():
        step[0] += 1
        bundled_ops.adam_step(param, grad, exp_avg, exp_avg_sq, step=step[0], lr=1e-3,
                             weight_decay=1e-2)

    copy_source, copy_target = torch.randn(numel, device=device), torch.empty(numel, device=device)
    torch_param = torch.nn.Parameter(torch.randn(numel, device=device))
    torch_param.grad = torch.randn(numel, device=device)
    fused = torch.optim.AdamW([torch_param], lr=1e-3, weight_decay=1e-2, fused=True)

    rows = []
    copy_ms = median_ms(lambda: copy_target.copy_(copy_source), args.repetitions)
    copy_gbs = COPY_BYTES_PER_ELEMENT * numel / copy_ms / 1e6
    rows.append(("device-to-device copy", copy_ms, copy_gbs))
    adam_ms = median_ms(adam_step, args.repetitions)
    rows.append(("optdrift adam_step (fp32)", adam_ms, ADAM_BYTES_PER_PARAM * numel / adam_ms / 1e6))
    fused_ms = median_ms(fused.step, args.repetitions)
    rows.append(("torch AdamW fused=True", fused_ms,
                 ADAM_BYTES_PER_PARAM * numel / fused_ms / 1e6))

    print(f"\n{torch.cuda.get_device_name()}  numel 2^{args.log2_numel} = {numel}  "
          f"median of {args.repetitions}  torch {torch.__version__}")
    print(f"{'what':<30} {'ms':>10} {'GB/s':>10} {'% of copy':>10}")
    for name, ms, gbs in rows:
        print(f"{name:<30} {ms:>10.4f} {gbs:>10.1f} {100 * gbs / copy_gbs:>9.1f}%")
    if not torch.isfinite(param).all():
        raise SystemExit("the Adam step produced non-finite parameters")


if __name__ == "__main__":
    main()
