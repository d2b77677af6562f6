"""Effective bandwidth of the bundled kernels' multi-tensor Adam (csrc/multi_tensor.h; issue 45)
beside the one-tensor op, on one layout of many tensors of mixed sizes.

Three ways to step the same elements (fp32 params and grads, fp32 states):
  multi      adam_multi_step: ONE op call over every tensor (one kernel launch on CUDA);
  looped     adam_step once per tensor (what a per-tensor optimizer loop does: a launch each);
  flat       adam_step once over one flat tensor of the same total (the bandwidth ceiling: one
             tensor, no per-tensor cost at all).
Effective GB/s counts the bytes Adam must move: per element it reads param, grad, exp_avg and
exp_avg_sq and writes param, exp_avg and exp_avg_sq (28 bytes for fp32). On CUDA each variant is
timed with CUDA events around `--iters` back-to-back steps after `--warmup` steps, repeated
`--repeats` times (the median is printed); on the CPU with perf_counter.

    python bench/multi_tensor_bandwidth.py                          # CUDA: 100 tensors, ~256M elements
    python bench/multi_tensor_bandwidth.py --device cpu --total 2e6 --tensors 40   # CPU smoke check
    python bench/multi_tensor_bandwidth.py --library path/to/optdrift_kernels_*.so

Without --library the kernels are built from csrc/ through worker.build (cached).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
HYPER = (1e-3, 0.9, 0.999, 1e-8, 1e-2, 1.0, False)  # lr, beta1, beta2, eps, weight_decay, gnorm_scale, skip_zeros


def load_kernels(library: str | None, device: str) -> None:
    if library is None:
        sys.path.insert(0, str(REPO))
        from worker.build import build_extension

        built = build_extension(REPO / "csrc", cuda_archs=None if device == "cuda" else [])
        if not built.ok:
            raise SystemExit(f"building csrc failed: {built.error}")
        library = str(built.library_path)
    torch.ops.load_library(library)


def layout_sizes(tensors: int, total: int, seed: int = 0) -> list[int]:
    """`tensors` sizes, log-uniform over 1 .. total/4 (biases to large weight matrices, odd ones
    included), scaled to sum to about `total`."""
    generator = torch.Generator().manual_seed(seed)
    logs = torch.rand(tensors, generator=generator, dtype=torch.float64) * torch.log(torch.tensor(total / 4.0))
    raw = torch.exp(logs)
    sizes = [max(1, int(v)) for v in (raw / raw.sum() * total).tolist()]
    return sizes


def bytes_moved(elements: int, dtype: torch.dtype) -> int:
    # reads: param, grad (dtype), exp_avg, exp_avg_sq (fp32); writes: param (dtype), exp_avg, exp_avg_sq
    width = torch.tensor([], dtype=dtype).element_size()
    return elements * (3 * width + 4 * 4)


def timed(step, device: str, warmup: int, iters: int, repeats: int) -> float:
    """Median seconds per step."""
    for _ in range(warmup):
        step()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                step()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0 / iters)
        else:
            started = time.perf_counter()
            for _ in range(iters):
                step()
            samples.append((time.perf_counter() - started) / iters)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--total", type=float, default=256e6, help="elements over all tensors")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--library", help="a built optdrift_kernels_*.so (default: build csrc/)")
    args = parser.parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    load_kernels(args.library, device)
    ops = torch.ops.optdrift
    sizes = layout_sizes(args.tensors, int(args.total))
    total = sum(sizes)

    def tensors(n_list):  # noqa: ANN001, ANN202
        params = [torch.randn(n, device=device).to(dtype) for n in n_list]
        grads = [torch.randn(n, device=device).to(dtype) for n in n_list]
        states = [[torch.zeros(n, device=device) for n in n_list] for _ in range(2)]
        return params, grads, states

    rows = []
    params, grads, (exp_avgs, exp_avg_sqs) = tensors(sizes)
    steps = torch.zeros(len(sizes), dtype=torch.int64)
    beta_powers = torch.zeros(1, 3)
    group_of = [0] * len(sizes)
    lists = [[value] for value in HYPER]
    rows.append(("multi (1 call)", timed(lambda: ops.adam_multi_step(
        params, grads, exp_avgs, exp_avg_sqs, steps, beta_powers, group_of, *lists), device, args.warmup, args.iters,
        args.repeats)))
    counter = [0]

    def looped() -> None:
        counter[0] += 1
        for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
            ops.adam_step(p, g, m, v, counter[0], *HYPER)

    rows.append((f"looped ({len(sizes)} calls)", timed(looped, device, args.warmup, args.iters, args.repeats)))
    del params, grads, exp_avgs, exp_avg_sqs
    (flat,), (flat_grad,), ((m,), (v,)) = tensors([total])
    flat_counter = [0]

    def flat_step() -> None:
        flat_counter[0] += 1
        ops.adam_step(flat, flat_grad, m, v, flat_counter[0], *HYPER)

    rows.append(("flat (1 tensor)", timed(flat_step, device, args.warmup, args.iters, args.repeats)))

    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"Adam {args.dtype}, {len(sizes)} tensors, {total:,} elements ({min(sizes):,} .. {max(sizes):,}), {name}")
    print(f"{'variant':<22}{'ms/step':>10}{'GB/s':>10}{'vs flat':>10}")
    flat_seconds = rows[-1][1]
    for label, seconds in rows:
        gbps = bytes_moved(total, dtype) / seconds / 1e9
        print(f"{label:<22}{seconds * 1e3:>10.3f}{gbps:>10.1f}{flat_seconds / seconds:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
