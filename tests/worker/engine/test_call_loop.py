"""The kernel-call loop in C++ (worker/engine/call_loop.py, the harness's PreparedCalls) makes the
calls Python makes: the fast engine with it gives run_case's results exactly, a call that raises
breaks only its case, and arguments it cannot make as Python makes them are refused up front.

Exactness, not tolerance: every per-step series through repr, every digest as a string. The CUDA
variant runs on a GPU and skips without one (bench/gpu/h200_warm_profile.sh runs it on the H200).
"""

from __future__ import annotations

import pytest
import torch

from worker.adapters import bundled_ops
from worker.engine import call_loop
from worker.engine.fast import run_cases_fast
from worker.engine.trajectory import run_case
from tests.worker.engine.test_fast_engine import GROUPED, _assert_identical
from tests.worker.engine.test_od2_op import DEVICES

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


def _adam(n: int, **hyper: float) -> tuple[bundled_ops.BoundOp, torch.Tensor]:
    param = torch.linspace(-1, 1, n)
    states = {name: torch.zeros(n) for name in bundled_ops.OPTIMIZER_STATES["adam"]}
    bound = bundled_ops.bind_step("adam", param, torch.full((n,), 0.5), states,
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
