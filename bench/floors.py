"""The floors a battery step cannot beat on this GPU; prints a table (docs/PERFORMANCE.md).

    python bench/floors.py [--source csrc] [--size 4097]

* one eager launch: a 1-element in-place add, launched N times back to back, then one sync
  (the cost of one kernel launch from Python through torch's dispatcher);
* one graph-replayed optimizer step: the build's adam_step on SIZE fp32 elements captured once in
  a CUDA graph (G copies of the launch in one graph), replayed; per launch inside the graph;
* the same adam_step eager, for comparison;
* device-to-device copy bandwidth (1 GiB, bytes read + written per second).
Times are CUDA-event times over the loop, after warm-up.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _time(fn, repeats: int) -> float:  # noqa: ANN001
    """Seconds per call of fn over `repeats` calls, CUDA events, after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0 / repeats


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parents[1] / "csrc")
    parser.add_argument("--size", type=int, default=4097)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: the floors are GPU figures", file=sys.stderr)
        return 2
    from worker.adapters import bundled_ops
    from worker.build import build_extension

    build = build_extension(args.source)
    if not build.ok:
        print(f"build failed:\n{build.error}", file=sys.stderr)
        return 1
    bundled_ops.load_build(build.library_path)
    device = torch.device("cuda")
    rows = []

    one = torch.zeros(1, device=device)
    rows.append(("eager launch (1-element add_)", _time(lambda: one.add_(1.0), 2000), "per launch"))

    param = torch.randn(args.size, device=device)
    grad = torch.randn(args.size, device=device)
    m, v = torch.zeros_like(param), torch.zeros_like(param)

    def adam() -> None:
        torch.ops.optdrift.adam_step(param, grad, m, v, 1, 1e-3, 0.9, 0.999, 1e-8, 1e-2, 1.0, False)

    rows.append((f"adam_step eager, n={args.size}", _time(adam, 2000), "per step"))
    per_graph = 100
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        adam()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            adam()
    rows.append((f"adam_step graph-replayed, n={args.size}", _time(graph.replay, 50) / per_graph, "per step"))

    big = torch.empty(1 << 28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(big)
    seconds = _time(lambda: dst.copy_(big), 20)
    bandwidth = 2 * big.numel() * 4 / seconds / 1e12

    name = torch.cuda.get_device_name(device)
    print(f"floors on {name}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"{'what':45s} {'microseconds':>14s}")
    for what, seconds_each, unit in rows:
        print(f"{what:45s} {seconds_each * 1e6:14.3f}  {unit}")
    print(f"{'device-to-device copy, 1 GiB':45s} {seconds * 1e6:14.1f}  = {bandwidth:.2f} TB/s (read + write)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
