"""The kernel-call loop in C++ (worker/engine/call_loop.py, the harness's PreparedCalls) makes the
calls Python makes: the fast engine with it gives run_case's results exactly, a call that raises
breaks only its case, and arguments it cannot make as Python makes them are refused up front. A
step's calls shared out over threads (side streams on CUDA) give the same results, with the failures
in case order, and only families that declare `concurrent_steps` are shared out.

Exactness, not tolerance: every per-step series through repr, every digest as a string. The CUDA
variant runs on a GPU and skips without one (bench/gpu/h200_warm_profile.sh runs it on the H200).
"""

from __future__ import annotations

import pytest
import torch

from worker.adapters.bundled import ThirtyTwoBitAdapter
from worker.adapters.bundled_8bit import EightBitBlockwiseAdapter
from worker.engine import call_loop, fast, kernel_ops
from worker.engine.fast import run_cases_fast
from worker.engine.kernels_only import run_kernels_only
from worker.engine.trajectory import run_case
from tests.test_fast_engine import GROUPED, _assert_identical
from tests.test_od2_op import DEVICES


def _side_streams(device: str, count: int) -> list:
    if device == "cuda":
        return [torch.cuda.Stream() for _ in range(count)]
    return [torch.Stream(device="cpu") for _ in range(count)]


def _count_shares(monkeypatch) -> list[int]:  # noqa: ANN001
    """Records, for every step the C++ loop makes, how many side streams it shares the calls over."""
    seen: list[int] = []
    real = call_loop.WaveCalls.run

    def counted(self, step):  # noqa: ANN001, ANN202
        seen.append(len(self.side_streams))
        return real(self, step)

    monkeypatch.setattr(call_loop.WaveCalls, "run", counted)
    return seen

@pytest.mark.parametrize("device", DEVICES)
def test_fast_engine_with_the_call_loop_equals_run_case(harness_loaded, kernels, device: str, monkeypatch) -> None:
    steps_run = []
    real = call_loop.WaveCalls.run

    def counted(self, step):  # noqa: ANN001, ANN202
        steps_run.append(step)
        return real(self, step)

    monkeypatch.setattr(call_loop.WaveCalls, "run", counted)
    cases = GROUPED.expand()
    looped = run_cases_fast(cases, torch.device(device))
    assert steps_run, "the fast engine did not make its kernel calls through the C++ loop"
    _assert_identical([run_case(c, torch.device(device)) for c in cases], looped)


def _adam(n: int, **hyper: float) -> tuple[kernel_ops.BoundOp, torch.Tensor]:
    param = torch.linspace(-1, 1, n)
    states = {name: torch.zeros(n) for name in kernel_ops.OPTIMIZER_STATES["adam"]}
    bound = kernel_ops.bind_step("adam", param, torch.full((n,), 0.5), states,
                                 hyper={"lr": 0.1, "weight_decay": 0.1, **hyper})
    return bound, param


def test_the_loop_makes_python_s_call_and_drops_a_call_that_raised(harness_loaded, kernels) -> None:
    looped, looped_param = _adam(1031)
    direct, direct_param = _adam(1031)
    broken, _ = _adam(7, beta1=1.5)  # the kernel's argument check refuses beta1 >= 1
    calls = call_loop.prepare([looped, None, broken], last_steps=[3, 3, 3], skip=set())
    assert calls is not None and calls.cases == [0, 2]
    for step in (1, 2, 3):
        failed = calls.run(step)
        direct(step)
        assert torch.equal(looped_param, direct_param)
        assert [index for index, _ in failed] == ([2] if step == 1 else [])  # raised once, then dropped
        if step == 1:
            assert "beta1" in failed[0][1]
    assert calls.run(4) == [] and torch.equal(looped_param, direct_param)  # past last_step: no call


def test_arguments_the_loop_cannot_make_as_python_does_are_refused(harness_loaded, kernels) -> None:
    bound, _ = _adam(8)
    arguments, step_at = bound.arguments()
    prepared = harness_loaded.PreparedCalls()
    schema = bound.op._schema
    with pytest.raises(ValueError, match="argument 'lr' \\(float\\) cannot be prepared from a Python str"):
        prepared.add(schema.name, schema.overload_name, [*arguments[:step_at + 1], "0.1", *arguments[step_at + 2:]],
                     step_at, 3)
    with pytest.raises(ValueError, match="takes 12 arguments, 11 were given"):
        prepared.add(schema.name, schema.overload_name, arguments[:-1], step_at, 3)
    with pytest.raises(ValueError, match="step number's place 5 is not an int argument"):
        prepared.add(schema.name, schema.overload_name, arguments, 5, 3)
    assert len(prepared) == 0


def test_a_wave_with_a_python_step_or_the_loop_switched_off_stays_in_python(harness_loaded, kernels, monkeypatch) -> None:
    bound, _ = _adam(8)
    assert call_loop.prepare([bound, lambda step: None], [1, 1], set()) is None  # not every call is a BoundOp
    assert call_loop.prepare([bound], [1], set()) is not None
    monkeypatch.setenv("OPTDRIFT_CALL_LOOP", "0")
    assert call_loop.prepare([bound], [1], set()) is None


@pytest.mark.parametrize("device", DEVICES)
def test_calls_shared_over_threads_are_python_s_calls_with_failures_in_case_order(
        harness_loaded, kernels, device: str) -> None:
    # 8 calls over 3 threads (shares of 2, 3 and 3 calls): two calls that raise, in different shares.
    sizes = [1031, 7, 4097, 1, 257, 7, 1031, 65]
    refused = {1, 4}
    looped = [_on(device, sizes[i], i in refused) for i in range(len(sizes))]
    direct = [_on(device, sizes[i], i in refused) for i in range(len(sizes))]
    calls = call_loop.prepare([b for b, _ in looped], last_steps=[3] * len(sizes), skip=set(),
                              side_streams=_side_streams(device, 2))
    assert calls is not None
    for step in (1, 2, 3):
        failed = calls.run(step)
        for index, (bound, _) in enumerate(direct):
            if index not in refused:
                bound(step)
        if device == "cuda":
            torch.cuda.synchronize()
        assert [index for index, _ in failed] == (sorted(refused) if step == 1 else [])
        assert all("beta1" in message for _, message in failed)
        for index in set(range(len(sizes))) - refused:
            assert torch.equal(looped[index][1], direct[index][1]), (step, index)


def _on(device: str, n: int, refused: bool) -> tuple[kernel_ops.BoundOp, torch.Tensor]:
    param = torch.linspace(-1, 1, n, device=device)
    states = {name: torch.zeros(n, device=device) for name in kernel_ops.OPTIMIZER_STATES["adam"]}
    hyper = {"lr": 0.1, "weight_decay": 0.1, **({"beta1": 1.5} if refused else {})}
    return kernel_ops.bind_step("adam", param, torch.full((n,), 0.5, device=device), states, hyper=hyper), param


@pytest.mark.parametrize("device", DEVICES)
def test_the_engines_with_calls_shared_over_threads_equal_run_case(harness_loaded, kernels, device: str,
                                                                   monkeypatch) -> None:
    monkeypatch.setitem(fast.KERNEL_THREADS, device, 3)
    shares = _count_shares(monkeypatch)
    cases = GROUPED.expand()
    shared = run_cases_fast(cases, torch.device(device))
    assert shares and set(shares) == {2}, "the calls were not shared out over three threads"
    _assert_identical([run_case(c, torch.device(device)) for c in cases], shared)
    kernels_only = run_kernels_only(cases, device)
    assert [r.trajectory.digests for r in kernels_only] == [r.trajectory.digests for r in shared]


def test_a_family_that_does_not_declare_concurrent_steps_is_called_from_one_thread(
        harness_loaded, kernels, monkeypatch) -> None:
    monkeypatch.setitem(fast.KERNEL_THREADS, "cpu", 3)
    monkeypatch.setattr(EightBitBlockwiseAdapter, "concurrent_steps", False)
    shares = _count_shares(monkeypatch)
    cases = [c for c in GROUPED.expand() if c.seed == 0 and c.steps == 3]  # one wave, both families
    run_cases_fast(cases, torch.device("cpu"))
    assert shares and set(shares) == {0}  # its 8-bit cases keep the whole wave in one thread
    monkeypatch.setattr(EightBitBlockwiseAdapter, "concurrent_steps", True)
    shares.clear()
    run_cases_fast(cases, torch.device("cpu"))
    assert set(shares) == {2} and ThirtyTwoBitAdapter.concurrent_steps
