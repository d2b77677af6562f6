"""The fused od2 observation (optdrift_od2::observe_rows, worker/engine/od2_op.py, in the harness library) gives digest.py's
bits exactly, and the fast engine gives run_case's results with it.

Exactness, not tolerance: the op's sums are integers modulo 2^64, so they are compared with
torch.equal, and every per-step series of a case through repr. Tests named *cuda* run on a GPU and
skip without one (bench/gpu/h200_warm_profile.sh runs them on the H200).
"""

from __future__ import annotations

import pytest
import torch

from worker.battery import load_battery
from worker.engine import digest as od2
from worker.engine import od2_op
from worker.engine.fast import run_cases_fast
from worker.engine.trajectory import run_case
from tests.worker.engine.test_fast_engine import GROUPED, _assert_identical

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


def _torch_ops(data: torch.Tensor, lengths: torch.Tensor, slot: int, case_index: torch.Tensor,
               cases: int) -> torch.Tensor:
    """What the fast engine computed before the op: digest.py's lanes over the padded rows."""
    counts = torch.zeros((3, cases), dtype=torch.int64, device=data.device)
    valid = torch.arange(data.shape[1], device=data.device).unsqueeze(0) < lengths.unsqueeze(1)
    salt, odd = od2.salts(slot, data.shape[1], data.device)
    counts[0].index_add_(0, case_index, (~torch.isfinite(data)).sum(dim=1))
    lane_a, lane_b = od2.lanes(od2.element_bits(data), salt, odd, valid)
    counts[1].index_add_(0, case_index, lane_a)
    counts[2].index_add_(0, case_index, lane_b)
    return counts


def _rows(dtype: torch.dtype, rows: int, width: int, generator: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        data = (torch.randn(rows, width, generator=generator) * 100).to(dtype)
        data[0, min(3, width - 1)], data[1, width - 1], data[rows - 1, 0] = float("nan"), float("inf"), float("-inf")
        return data
    return torch.randint(0, 256 if dtype == torch.uint8 else 1 << 30, (rows, width), generator=generator).to(dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.uint8, torch.int32, torch.int64])
def test_observe_rows_equals_digest_lanes(harness_loaded, device: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(11)
    # Widths below, at and above one CUDA block's tile (4096), several tiles; lengths of 0, 1, a
    # part, the whole row and more than the row (clamped); rows 0 and 3 feed the same case, and a
    # non-finite value sits in row 1's padding (counted, as torch.isfinite over the row counts it,
    # but not digested).
    for width in (1, 512, 4097, 3 * 4096 + 5):
        data = _rows(dtype, 5, width, generator).to(device)
        lengths = torch.tensor([width, max(width - 1, 0), 0, 1, width + 9], dtype=torch.int64, device=device)
        case_index = torch.tensor([2, 0, 1, 2, 3], dtype=torch.int64, device=device)
        for slot in (0, 1, 4):
            fused = torch.zeros((3, 4), dtype=torch.int64, device=device)
            fused[1, 2] = -5  # the op adds to what is there
            od2_op.observe_rows(data, lengths, slot, case_index, fused)
            expected = _torch_ops(data, lengths.clamp(max=width), slot, case_index, 4)
            expected[1, 2] -= 5
            assert torch.equal(fused.cpu(), expected.cpu()), (dtype, width, slot, fused, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_observe_rows_says_what_is_wrong(harness_loaded, device: str) -> None:
    data = torch.zeros((2, 8), device=device)
    lengths = torch.tensor([8, 8], device=device)
    index = torch.tensor([0, 1], device=device)
    counts = torch.zeros((3, 2), dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match="'lengths' must be a contiguous int64 vector of 2"):
        od2_op.observe_rows(data, lengths[:1], 0, index, counts)
    with pytest.raises(RuntimeError, match="cannot digest complex dtype"):
        od2_op.observe_rows(data.to(torch.complex64), lengths, 0, index, counts)
    with pytest.raises(RuntimeError, match=r"'counts' must be a contiguous int64 \[3, cases\]"):
        od2_op.observe_rows(data, lengths, 0, index, counts[:2])
    with pytest.raises(RuntimeError, match="'data' must be \\[rows, width\\]"):
        od2_op.observe_rows(data.reshape(-1), lengths, 0, index, counts)
    if device == "cpu":  # on CUDA the range is not checked (it would read the indices back every step)
        with pytest.raises(RuntimeError, match=r"case_index\[1\] = 7 is outside the 2 cases"):
            od2_op.observe_rows(data, lengths, 0, torch.tensor([0, 7]), counts)


@pytest.mark.parametrize("device", DEVICES)
def test_fast_engine_with_the_fused_observation_equals_run_case(harness_loaded, kernels, device: str,
                                                                 monkeypatch) -> None:
    assert od2_op.fused_for(torch.device(device))
    calls = []
    real = od2_op.observe_rows

    def counted(*args) -> None:  # noqa: ANN002
        calls.append(args[0].dtype)
        real(*args)

    monkeypatch.setattr(od2_op, "observe_rows", counted)
    cases = GROUPED.expand()
    fused = run_cases_fast(cases, torch.device(device))
    assert calls, "the fast engine did not use the fused observation"
    assert {torch.uint8, torch.float32, torch.bfloat16, torch.float16} <= set(calls)  # 8-bit codes, states, params
    _assert_identical([run_case(c, torch.device(device)) for c in cases], fused)


def test_turning_the_fused_observation_off_gives_the_same_results(harness_loaded, kernels, monkeypatch) -> None:
    cases = load_battery("quick").expand()[:40]
    fused = run_cases_fast(cases, torch.device("cpu"))
    monkeypatch.setenv("OPTDRIFT_OD2_FUSED", "0")
    assert not od2_op.fused_for(torch.device("cpu"))
    _assert_identical(run_cases_fast(cases, torch.device("cpu")), fused)


def test_a_kernel_host_loads_the_harness_library(kernels_build) -> None:
    from worker.engine.host import KernelHost

    with KernelHost(kernels_build.library_path, device="cpu") as host:
        host.start()
        assert "harness load" in host.startup_s, host.startup_s
