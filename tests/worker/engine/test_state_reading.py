"""States read as they are (issue 37): tensor subclasses, DTensor-like wrappers and containers are
digested as their plain inner tensors with no adapter code, plain tensors digest as before, and a
declared state that silently fell back reads not_applicable with the reason.

The library stand-in is tests/fixtures/lowbit (a pure-PyTorch 8-bit blockwise AdamW whose states
are a tensor subclass that refuses every op, as torchao's do, and which keeps float32 states below
4096 elements or for sizes that are not a multiple of the block, as torchao does)."""

from __future__ import annotations

import io

import pytest
import torch

from service.core.results import GradientStreamSpec
from tests.fixtures.lowbit.adapter import LowBitAdamWFamily
from tests.fixtures.lowbit.lowbit_adamw import Blockwise8State
from worker.adapters.base import AdapterContractError, FamilyAdapter, StateDeclaration
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine import lifecycle
from worker.engine.digest import digest_tensors, plain_tensors
from worker.engine.fast import run_cases_fast
from worker.engine.trajectory import run_case, run_params

CPU = torch.device("cpu")


def _case(size: int, steps: int = 3, optimizer: str = "adam"):  # noqa: ANN202
    hyper = dict(OPTIMIZER_HYPER_DEFAULTS[optimizer], lr=1e-2, weight_decay=0.01)
    return make_case(optimizer=optimizer, family="8bit_blockwise", param_dtype="float32", hyper=hyper,
                     gradient=GradientStreamSpec(kind="open"), seed=3, size=size, steps=steps)


def _quantized(n: int = 512) -> Blockwise8State:
    values = torch.linspace(-1, 1, n)
    return Blockwise8State.quantize(values, 256, signed=True, rounding="nearest")


class LocalWrapper:
    """A DTensor-like wrapper that is not a tensor: only to_local() gives its shard."""

    def __init__(self, local: torch.Tensor) -> None:
        self._local = local

    def to_local(self) -> torch.Tensor:
        return self._local


# ----------------------------------------------------------------------------- the digest
def test_a_plain_tensor_digests_as_before():
    # Pinned: the od2 digest of these plain tensors made by digest.py before states were read as
    # they are (HEAD 5e4ffb7). A change here would change every recorded digest.
    tensors = [torch.arange(7, dtype=torch.float32), torch.tensor(3.0), torch.ones(4, dtype=torch.uint8)]
    assert digest_tensors(tensors) == "od2:7c28690a386dc43a80e6613531c7659e"
    assert plain_tensors(tensors[0], "p") == [("p", tensors[0])]
    parameter = torch.nn.Parameter(tensors[0].clone(), requires_grad=False)
    assert plain_tensors(parameter, "p")[0][1] is parameter  # a Parameter is a plain tensor


def test_a_tensor_subclass_is_its_inner_tensors_in_its_own_order():
    state = _quantized()
    with pytest.raises(NotImplementedError):  # what digesting it as a tensor used to hit
        state.contiguous().view(torch.uint8)
    param = torch.randn(512)
    assert [name for name, _ in plain_tensors(state, "exp_avg")] == ["exp_avg.codes", "exp_avg.scale"]
    assert digest_tensors([param, state]) == digest_tensors([param, state.codes, state.scale])
    moved = Blockwise8State(state.codes.clone(), state.scale.clone(), 256, True)
    moved.codes[3] += 1  # one code
    assert digest_tensors([param, moved]) != digest_tensors([param, state])


def test_containers_and_dtensor_like_wrappers_are_their_leaves():
    a, b, c = torch.randn(5), torch.randn(3), torch.tensor(2.0)
    nested = {"moments": [a, (b, LocalWrapper(c))]}
    assert [n for n, _ in plain_tensors(nested, "s")] == ["s.moments.0", "s.moments.1.0", "s.moments.1.1"]
    assert digest_tensors([a, nested]) == digest_tensors([a, a, b, c])
    with pytest.raises(TypeError, match="s.moments.0 is a float"):
        plain_tensors({"moments": [1.5]}, "s")


# ----------------------------------------------------------------------------- through the engines
def test_a_library_owned_quantized_state_runs_with_no_adapter_flattening():
    case = _case(4096)
    family = LowBitAdamWFamily()
    result = run_case(case, CPU, families={"8bit_blockwise": family})
    assert result.status == "ok", result.message
    # The digest is the parameter, the step counter and both states' codes and scales.
    handle = lifecycle.open_case(family, case, torch.zeros(4096), CPU)
    assert lifecycle.digest_states(family, handle) == []  # lazy: nothing before the first step
    family.step(handle, handle.param.data, torch.linspace(-1, 1, 4096), 1)
    names = [name for name, _ in lifecycle.digest_states(family, handle)]
    assert names == ["step", "exp_avg.codes", "exp_avg.scale", "exp_avg_sq.codes", "exp_avg_sq.scale"]
    lifecycle.close_case(family, handle)


def test_a_quantizer_change_shows_in_the_state_digest_while_the_parameters_agree():
    # Rounding codes down instead of to nearest: step 1's parameter is the same (it is updated from
    # the float32 states before they are requantized), the digest differs from step 1 (the codes).
    case = _case(4096)
    outputs, digests = [], []
    for rounding in ("nearest", "down"):
        out = io.BytesIO()
        result = run_params(case, CPU, out, families={"8bit_blockwise": LowBitAdamWFamily(rounding=rounding)})
        outputs.append(out.getvalue())
        digests.append(result.trajectory.digests)
    first = 4096 * 4
    assert outputs[0][:first] == outputs[1][:first]
    assert digests[0][0] != digests[1][0]


@pytest.mark.parametrize("size", [4097, 1024])
def test_a_silent_fp32_fallback_reads_not_applicable_with_the_reason(size):
    # 4097 is not a multiple of the block, 1024 is below 4096 elements: the library keeps float32
    # states, which the adapter's declaration (uint8 codes, blocks of 256) names.
    case = _case(size)
    families = {"8bit_blockwise": LowBitAdamWFamily()}
    for result in (run_case(case, CPU, families=families), run_params(case, CPU, io.BytesIO(), families=families)):
        assert result.status == "not_applicable"
        assert "declares 8bit_blockwise state" in result.message
        assert f"float32[{size}], with no uint8 codes" in result.message
        assert "fell back" in result.message
    # Undeclared, the same case runs (as whatever the library did): the declaration is what refuses it.
    assert run_case(case, CPU, families={"8bit_blockwise": LowBitAdamWFamily(declare=False)}).status == "ok"


def test_a_block_size_other_than_the_declared_one_reads_not_applicable():
    class DeclaresSmallerBlocks(LowBitAdamWFamily):
        def declared_state(self, case):  # noqa: ANN001, ANN202
            return StateDeclaration(family="8bit_blockwise", code_dtype="uint8", block_size=128)

    result = run_case(_case(4096), CPU, families={"8bit_blockwise": DeclaresSmallerBlocks()})
    assert result.status == "not_applicable"
    assert "blocks of 128 (32 scales for n=4096)" in result.message and "16 scale values" in result.message


def test_the_fast_engine_reports_a_fallback_as_run_case_does():
    class OnTheFastEngine(LowBitAdamWFamily):
        fast_engine = True  # its lazy layout breaks the wave; the case is then run alone

    families = {"8bit_blockwise": OnTheFastEngine()}
    cases = [_case(4096), _case(4097)]
    fast = run_cases_fast(cases, CPU, families=families)
    slow = [run_case(case, CPU, families=families) for case in cases]
    assert [r.status for r in fast] == ["ok", "not_applicable"]
    assert [(r.status, r.message) for r in fast] == [(r.status, r.message) for r in slow]
    assert fast[0].trajectory.digests == slow[0].trajectory.digests


def test_handed_over_states_must_be_plain():
    from worker.adapters.base import HandedOverStates

    class HandsOverASubclass(HandedOverStates):
        def init_states(self, case, param):  # noqa: ANN001, ANN202
            return {"exp_avg": _quantized(case.size)}

        def step_states(self, case, param, grad, states, step):  # noqa: ANN001
            pass

    family = HandsOverASubclass()
    handle = lifecycle.open_case(family, _case(512), torch.zeros(512), CPU)
    with pytest.raises(AdapterContractError, match="handed-over states are plain tensors"):
        lifecycle.digest_states(family, handle)
    lifecycle.close_case(family, handle)
    assert isinstance(family, FamilyAdapter)
