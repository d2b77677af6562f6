"""Layout cases (issue 45): one optimizer over several tensors in param groups.

The battery format, the flat vector with its guard elements, the references against torch.optim
run directly, both engines, the per-tensor verdict rows and an adapter without a group lifecycle.
"""

from __future__ import annotations

import io

import pytest
import torch
from pydantic import ValidationError

from service.core.results import LAYOUT_ALIGN, CaseResult, ParamLayout, TensorGroupSpec
from service.core.verdicts import compare_case
from worker.adapters.base import FamilyAdapter, HandedOverStates
from worker.battery import BatterySpec, load_battery
from worker.engine.fast import run_cases_fast
from worker.engine.gradients import GradientStream, initial_parameters
from worker.engine.trajectory import run_case, run_params
from worker.references.optimizers import LayoutReference, torch_optim_class

CPU = torch.device("cpu")
# Two groups as a model has them: weights with weight decay, and a group without it (biases, norms)
# at another lr; sizes 1, odd, a block multiple and a larger one.
LAYOUT = {"groups": [{"sizes": [1, 257, 4096]}, {"sizes": [1031], "point": {"weight_decay": 0.0, "lr": 0.01}}]}


def _battery(optimizers, *, steps=6, gradients=({"kind": "open"},), dtypes=("float32",)) -> BatterySpec:  # noqa: ANN001
    return BatterySpec.model_validate({"name": "layouts", "version": 1, "groups": [{
        "optimizers": list(optimizers), "layouts": [LAYOUT], "steps": steps, "param_dtypes": list(dtypes),
        "points": [{"lr": 0.1, "weight_decay": 0.1}], "gradients": list(gradients)}]})


# ----------------------------------------------------------------------------- the format
def test_a_layout_expands_to_one_case_whose_groups_carry_their_hyperparameters():
    (case,) = _battery(["adam"]).expand()
    assert case.layout is not None and case.size == case.layout.flat_size
    assert "L[1+257+4096|1031:lr=0.01,wd=0.0]" in case.case_id
    assert [g.hyper["weight_decay"] for g in case.layout.groups] == [0.1, 0.0]
    assert [g.hyper["lr"] for g in case.layout.groups] == [0.1, 0.01]
    assert case.hyper == case.layout.groups[0].hyper  # the case's own hyper is its first group's
    slots = case.tensor_slots()
    assert [(s.group, s.size) for s in slots] == [(0, 1), (0, 257), (0, 4096), (1, 1031)]
    # Aligned starts, at least one guard element after every tensor (the last included).
    assert all(s.offset % LAYOUT_ALIGN == 0 for s in slots)
    assert all(b.offset > a.stop for a, b in zip(slots, slots[1:])) and case.size > slots[-1].stop


def test_cases_without_a_layout_serialise_and_hash_as_before():
    # A one-tensor case's id (its hash of the body) and the JSON of cases and battery groups carry no
    # layout key: stored baselines, reference-cache keys and battery digests stay valid.
    ci = load_battery("ci")
    one_tensor = [c for c in ci.expand() if c.layout is None]
    assert one_tensor[0].case_id == "adagrad.32bit.fp32.lr=0.1.wd=0.1.open+z0.25.n1.s0.t4#53905564"
    assert "layout" not in one_tensor[0].model_dump(mode="json")
    assert "layouts" not in _battery(["adam"]).model_copy(update={"groups": ci.groups[:1]}).model_dump()["groups"][0]


@pytest.mark.parametrize("group, problem", [
    ({"sizes": [4], "layouts": [LAYOUT]}, "either `sizes`"),
    ({}, "either `sizes`"),
    ({"layouts": [{"groups": [{"sizes": [0, 3]}]}]}, "bad sizes [0]"),
    ({"layouts": [{"groups": [{"sizes": [1] * 65}]}]}, "at most 64"),
    ({"layouts": [{"groups": [{"sizes": [1]}, {"sizes": [2], "point": {"momentum": 0.5}}]}]}, "momentum"),
])
def test_a_bad_layout_is_refused_with_what_is_wrong(group, problem):
    with pytest.raises(ValidationError) as caught:
        BatterySpec.model_validate({"name": "x", "version": 1,
                                    "groups": [{"optimizers": ["adam"], "steps": 2, **group}]})
    assert problem in str(caught.value)


def test_a_layout_case_size_must_be_its_flat_length():
    (case,) = _battery(["adam"]).expand()
    with pytest.raises(ValidationError, match="flat vector"):
        type(case).model_validate({**case.model_dump(mode="json"), "size": case.size + 1})


# ----------------------------------------------------------------------------- references
@pytest.mark.parametrize("optimizer", ["adam", "momentum", "rmsprop", "adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("foreach", [False, True])
def test_the_reference_is_torch_optim_with_the_same_param_groups_to_the_bit(optimizer, dtype, foreach):
    # torch.optim built as a training loop builds it (separate tensors, param groups, one step() a
    # step), single-tensor and foreach paths: our reference over views of the flat vector must give
    # the same bits on the CPU (tolerance 0: the same torch ops on the same values), closed loop
    # included, so the reference is torch's own answer for the layout.
    _assert_reference_is_torch_optim(optimizer, dtype, foreach, CPU)


def _assert_reference_is_torch_optim(optimizer: str, dtype: torch.dtype, foreach: bool, device: torch.device) -> None:
    (case,) = _battery([optimizer], steps=15, gradients=({"kind": "closed"},)).expand()
    init = initial_parameters(case.seed, case.size).to(dtype).to(device)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device=device, grad_dtype=dtype)
    ours = LayoutReference(case, init, foreach=foreach)
    slots = case.tensor_slots()
    params = [torch.nn.Parameter(init[s.offset:s.stop].clone()) for s in slots]
    groups = []
    for index in range(len(case.layout.groups)):
        _, kwargs = torch_optim_class(optimizer, case.group_hyper(index), foreach=foreach)
        groups.append({"params": [p for s, p in zip(slots, params) if s.group == index], **kwargs})
    optim_class, defaults = torch_optim_class(optimizer, case.group_hyper(0), foreach=foreach)
    theirs = optim_class(groups, **defaults)
    flat = init.clone()
    for step in range(1, case.steps + 1):
        ours.step(step, stream.reference_gradient(step, ours.param))
        grad = stream.reference_gradient(step, flat)
        for s, p in zip(slots, params):
            p.grad = grad[s.offset:s.stop].clone()
        theirs.step()
        for s, p in zip(slots, params):
            flat[s.offset:s.stop] = p.detach()
        assert torch.equal(ours.param, flat), (optimizer, step)
    assert len(ours.optim.param_groups) == 2
    # The guards are never stepped.
    covered = torch.zeros(case.size, dtype=torch.bool, device=device)
    for s in slots:
        covered[s.offset:s.stop] = True
    assert torch.equal(ours.param[~covered], init[~covered])


def test_the_papers_references_step_each_tensor_with_its_groups_hyperparameters():
    # Lion and AdEMAMix have no torch.optim: the layout reference is the one-tensor reference per
    # tensor. Group 1 (lr 0.01, no decay) must move its tensor differently from a group-0 copy.
    for optimizer in ("lion", "ademamix"):
        (case,) = _battery([optimizer]).expand()
        init = initial_parameters(case.seed, case.size)
        stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device=CPU, grad_dtype=torch.float64)
        ours = LayoutReference(case, init.double())
        from worker.references.optimizers import make_reference

        last = case.tensor_slots()[-1]
        alone = make_reference(case.tensor_case(last), init.double()[last.offset:last.stop])
        for step in range(1, case.steps + 1):
            grad = stream.reference_gradient(step, ours.param)
            ours.step(step, grad)
            alone.step(step, grad[last.offset:last.stop])
        assert torch.equal(ours.param[last.offset:last.stop], alone.param)


# ----------------------------------------------------------------------------- engines
def test_both_engines_run_layout_cases_with_the_same_digests(kernels):
    cases = _battery(["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"],
                     gradients=({"kind": "open"}, {"kind": "closed"})).expand()
    plain = load_battery("ci").expand()[:2]  # one-tensor cases in the same run keep their waves
    fast = run_cases_fast(cases + plain, CPU)
    for case, result in zip(cases + plain, fast):
        alone = run_case(case, CPU)
        assert result.status == alone.status == "ok", result.message
        assert result.trajectory.digests == alone.trajectory.digests, case.case_id
        assert result.trajectory.tensor_digests == alone.trajectory.tensor_digests
        if case.layout is not None:
            assert len(alone.trajectory.tensor_digests[0]) == case.layout.tensor_count + 1
            # fp32 against float64 after 6 steps at lr 0.1: rounding only (a few ulps of values ~1),
            # plus for Adam / AdEMAMix the multi-tensor op's float32 beta powers (csrc/multi_tensor.h,
            # as DeepSpeed keeps them): 1 - 0.999f is 1.3e-5 relative off 1 - 0.999, ~1e-5 here.
            assert max(alone.trajectory.ref64_max_abs) < 3e-5
    params = io.BytesIO()
    result = run_params(cases[0], CPU, params)
    assert result.trajectory.digests == run_case(cases[0], CPU).trajectory.digests


class _WritesPastTheEnd(HandedOverStates):
    """A per-tensor SGD step that, like a chunk loop off by one, also writes the element after each
    tensor (the view's storage goes on into the guard)."""

    def init_states(self, case, param):  # noqa: ANN001, ANN201
        return {}

    def step_states(self, case, param, grad, states, step) -> None:  # noqa: ANN001
        torch.as_strided(param, (param.numel() + 1,), (1,)).sub_(0.01)  # one element too many
        param.sub_(case.hyper["lr"] * grad)


class _CorrectSgd(_WritesPastTheEnd):
    def step_states(self, case, param, grad, states, step) -> None:  # noqa: ANN001
        param.sub_(0.01)
        param.sub_(case.hyper["lr"] * grad)


def test_a_write_past_a_tensors_end_is_reported_on_the_guard_elements():
    (case,) = _battery(["momentum"]).expand()
    good = run_case(case, CPU, families={"32bit": _CorrectSgd()})
    bad = run_case(case, CPU, families={"32bit": _WritesPastTheEnd()})
    comparison = compare_case(bad, good)
    assert comparison.verdict == "changed" and comparison.first_divergent_step == 1
    rows = {row.index: row for row in comparison.tensors}
    assert rows[None].first_divergent_step == 1  # the guards
    assert all(rows[i].first_divergent_step is None for i in range(4))  # every tensor's own elements as before
    assert "guard elements between tensors WRITTEN from step 1" in comparison.message


def test_a_change_in_one_group_is_confined_to_its_tensors_in_the_verdict(kernels):
    (case,) = _battery(["adam"]).expand()
    groups = case.layout.groups
    other = case.model_copy(update={"layout": ParamLayout(groups=[
        groups[0], TensorGroupSpec(sizes=groups[1].sizes, hyper={**groups[1].hyper, "eps": 1e-6})])})
    commit, baseline = run_case(case, CPU), run_case(other, CPU)
    comparison = compare_case(commit, baseline.model_copy(update={"case": case}))
    steps = [row.first_divergent_step for row in comparison.tensors]
    assert steps == [None, None, None, 1, None]
    assert comparison.message.startswith("1 of 4 tensors changed: t3 (group 1, n=1031) from step 1")


class _NoGroups(FamilyAdapter):
    def open(self, case, param, device):  # noqa: ANN001, ANN201
        return object()

    def step(self, handle, param, grad, step) -> None:  # noqa: ANN001
        param.sub_(grad)

    def state_for_digest(self, handle):  # noqa: ANN001, ANN201
        return []


def test_an_adapter_without_a_group_lifecycle_reads_not_applicable_in_both_engines():
    (case,) = _battery(["adam"]).expand()
    families = {"32bit": _NoGroups()}
    for result in (run_case(case, CPU, families=families), run_cases_fast([case], CPU, families=families)[0],
                   run_params(case, CPU, io.BytesIO(), families=families)):
        assert isinstance(result, CaseResult) and result.status == "not_applicable"
        assert "has no group lifecycle" in result.message and "_NoGroups" in result.message


# ----------------------------------------------------------------------------- CUDA (skipped without a GPU)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_layout_cases_on_cuda_reproduce_themselves_and_agree_on_both_engines(kernels):
    # The determinism a layout verdict rests on, on the GPU: two runs of one build give the same
    # digests (per tensor too), and the fast engine's result is run_case's.
    device = torch.device("cuda")
    cases = _battery(["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"],
                     gradients=({"kind": "open"}, {"kind": "closed"}), dtypes=("float32", "bfloat16")).expand()
    fast = run_cases_fast(cases, device)
    for case, result in zip(cases, fast):
        first, second = run_case(case, device), run_case(case, device)
        assert first.status == "ok", first.message
        assert first.trajectory.digests == second.trajectory.digests == result.trajectory.digests, case.case_id
        assert first.trajectory.tensor_digests == second.trajectory.tensor_digests


@cuda
@pytest.mark.parametrize("foreach", [False, True])
def test_the_reference_on_cuda_is_torch_optim_with_the_same_param_groups_to_the_bit(foreach):
    for optimizer in ("adam", "momentum", "rmsprop", "adagrad"):
        _assert_reference_is_torch_optim(optimizer, torch.float32, foreach, torch.device("cuda"))


def test_check_prints_which_tensors_of_a_changed_layout_case_changed(kernels):
    from rich.console import Console

    from service.core.results import RunResult
    from service.core.verdicts import compare_runs
    from service.cli.check import print_verdict

    (case,) = _battery(["adam"]).expand()
    groups = case.layout.groups
    other = case.model_copy(update={"layout": ParamLayout(groups=[
        groups[0], TensorGroupSpec(sizes=groups[1].sizes, hyper={**groups[1].hyper, "eps": 1e-6})])})
    commit, baseline = run_case(case, CPU), run_case(other, CPU).model_copy(update={"case": case})
    runs = [RunResult(battery_name="layouts", battery_version=1, battery_digest="d", cases=[r]) for r in (commit, baseline)]
    console = Console(width=120, record=True)
    print_verdict(compare_runs(*runs), console)
    text = console.export_text()
    assert "1 of 4 tensors changed: t3 (group 1, n=1031) from step 1" in text
    assert "bit-identical: t0 t1 t2" in text
