"""The group lifecycle of the project adapters (docs/PROJECTS.md "The group lifecycle"): a layout
case (several tensors in param groups) runs as ONE optimizer of the library's own class with the
case's param groups, stepped by its own step(); both engines give the same digests; a group's
hyperparameters reach that group's tensors and no other; the library's updates land in the
engine's views of the flat vector (the guards untouched); the opaque_steps fixture's unreadable
state is what it declares.

bitsandbytes (CPU backend) and lion-pytorch run here; each skips where its library is absent
(the [test] extra pins both). torchao compiles every tensor's step (inductor): its tests are slow.
Digests are compared as strings (exact, no tolerance).
"""

from __future__ import annotations

import pytest
import torch

from service.core.results import CaseSpec, GradientStreamSpec, ParamLayout, TensorGroupSpec
from worker.adapters import get_adapter
from worker.adapters.param_groups import OptimizerGroupCase
from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case
from worker.engine import lifecycle
from worker.engine.conformance import engine_results, mismatches
from worker.engine.gradients import GradientStream, initial_parameters
from worker.engine.trajectory import run_case

CPU = torch.device("cpu")
OPAQUE = "tests.fixtures.adapters.opaque_steps"
SIZES = ([1, 257, 4096], [1031])  # one element, odd past a 256-block, a block multiple, odd again


def layout_case(optimizer: str, family: str, *, second_wd: float = 0.0, steps: int = 4,
                dtype: str = "float32") -> CaseSpec:
    """Two param groups: the first with weight decay 0.1, the second with `second_wd` and half the lr."""
    first = {**OPTIMIZER_HYPER_DEFAULTS[optimizer], "lr": 0.01, "weight_decay": 0.1}
    second = {**first, "lr": 0.005, "weight_decay": second_wd}
    layout = ParamLayout(groups=[TensorGroupSpec(sizes=SIZES[0], hyper=first),
                                 TensorGroupSpec(sizes=SIZES[1], hyper=second)])
    return make_case(optimizer=optimizer, family=family, param_dtype=dtype, hyper=first,
                     gradient=GradientStreamSpec(kind="open"), seed=0, size=layout.flat_size, steps=steps,
                     layout=layout)


def _loaded(name: str):  # noqa: ANN202
    module = {"bitsandbytes": "bitsandbytes", "lion_pytorch": "lion_pytorch", "torchao": "torchao"}.get(name)
    if module is not None:
        pytest.importorskip(module)
    adapter = get_adapter(name)
    adapter.load("installed")
    return adapter


def _opened(adapter, case: CaseSpec):  # noqa: ANN001, ANN202
    """(family, flat parameter, its views, the group handle) of `case`, opened as the engines open it."""
    family = adapter.families()[case.family]
    flat = initial_parameters(case.seed, case.size)
    views = lifecycle.tensor_views(case, flat)
    return family, flat, views, lifecycle.open_group_case(family, case, views, CPU)


BNB_CLASSES = {("adam", "32bit"): "AdamW", ("adam", "8bit_blockwise"): "AdamW8bit",
               ("ademamix", "32bit"): "AdEMAMix", ("ademamix", "8bit_blockwise"): "AdEMAMix8bit",
               ("lion", "32bit"): "Lion", ("lion", "8bit_blockwise"): "Lion8bit",
               ("momentum", "32bit"): "SGD", ("momentum", "8bit_blockwise"): "SGD8bit",
               ("rmsprop", "32bit"): "RMSprop", ("rmsprop", "8bit_blockwise"): "RMSprop8bit",
               ("adagrad", "32bit"): "Adagrad", ("adagrad", "8bit_blockwise"): "Adagrad8bit"}
CASES = [("bitsandbytes", optimizer, family) for optimizer, family in BNB_CLASSES] + \
    [("lion_pytorch", "lion", "32bit")]


# ----------------------------------------------------------------------------- one optimizer, its groups
@pytest.mark.parametrize("name,optimizer,family", CASES)
def test_one_library_optimizer_holds_every_tensor_in_the_case_s_param_groups(name, optimizer, family):
    adapter = _loaded(name)
    case = layout_case(optimizer, family)
    family_adapter, flat, views, handle = _opened(adapter, case)
    try:
        assert isinstance(handle, OptimizerGroupCase)
        expected = {"bitsandbytes": BNB_CLASSES.get((optimizer, family)), "lion_pytorch": "Lion"}[name]
        assert type(handle.optimizer).__name__ == expected
        assert type(handle.optimizer).__module__.split(".")[0] == name
        groups = handle.optimizer.param_groups
        assert len(groups) == 2
        assert [len(g["params"]) for g in groups] == [3, 1]
        assert [g["lr"] for g in groups] == [0.01, 0.005]
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        # Every Parameter the library holds is over the engine's view of the flat vector.
        held = [p for g in groups for p in g["params"]]
        assert [p.data_ptr() for p in held] == [v.data_ptr() for v in views]
        stream = GradientStream(case.gradient, seed=0, size=case.size, device=CPU, grad_dtype=torch.float32)
        before = flat.clone()
        family_adapter.step_group(handle, views, lifecycle.tensor_views(case, stream.kernel_gradient(1, flat)), 1)
        # The library's update landed in the views, and nowhere else: the guard elements kept their values.
        changed = flat != before
        covered = torch.zeros(case.size, dtype=torch.bool)
        for slot in case.tensor_slots():
            covered[slot.offset:slot.stop] = True
            assert changed[slot.offset:slot.stop].any(), f"tensor {slot.index} did not move"
        assert not changed[~covered].any()
        state = family_adapter.state_for_digest(handle)
        assert {name.split(".")[0] for name in state} >= {"t0", "t1", "t2", "t3", "g0", "g1"}
    finally:
        lifecycle.close_all([(family_adapter, handle)])


@pytest.mark.parametrize("name,optimizer,family", CASES)
def test_a_layout_case_gives_the_same_digests_on_both_engines(name, optimizer, family):
    adapter = _loaded(name)
    cases = [layout_case(optimizer, family), layout_case(optimizer, family, second_wd=0.05)]
    pairs = engine_results(cases, CPU, adapter.families())
    assert all(r.status == "ok" and len(r.trajectory.digests) == r.case.steps for pair in pairs for r in pair), \
        [(r.status, r.message) for pair in pairs for r in pair]
    assert mismatches(pairs) == []


@pytest.mark.parametrize("name,optimizer,family", CASES)
def test_the_second_group_s_weight_decay_reaches_its_tensor_and_no_other(name, optimizer, family):
    adapter = _loaded(name)
    plain, decayed = (run_case(layout_case(optimizer, family, second_wd=wd), CPU, families=adapter.families())
                      for wd in (0.0, 0.05))
    assert plain.status == decayed.status == "ok", (plain.message, decayed.message)
    assert all(a != b for a, b in zip(plain.trajectory.digests, decayed.trajectory.digests))
    for step, (a, b) in enumerate(zip(plain.trajectory.tensor_digests, decayed.trajectory.tensor_digests), start=1):
        # [t0, t1, t2 | t3, guards]: only the second group's tensor moves.
        assert a[:3] == b[:3] and a[4] == b[4], f"step {step}: a tensor of the first group or a guard changed"
        assert a[3] != b[3], f"step {step}: the second group's tensor did not change"


def test_bitsandbytes_8bit_layout_quantizes_the_large_tensor_and_keeps_fp32_below_its_minimum():
    """bnb's own min_8bit_size (4096): the 4096-element tensor has uint8 codes, the others fp32
    states, as bnb's users get; declared, so a layout bnb would run all in fp32 reads not_applicable."""
    adapter = _loaded("bitsandbytes")
    case = layout_case("adam", "8bit_blockwise")
    family, flat, views, handle = _opened(adapter, case)
    try:
        stream = GradientStream(case.gradient, seed=0, size=case.size, device=CPU, grad_dtype=torch.float32)
        family.step_group(handle, views, lifecycle.tensor_views(case, stream.kernel_gradient(1, flat)), 1)
        state = family.state_for_digest(handle)
        assert state["t2.state1"].dtype == torch.uint8 and state["t2.absmax1"].numel() == 16
        assert all(state[f"t{i}.state1"].dtype == torch.float32 for i in (0, 1, 3))
        assert all(int(state[f"t{i}.step"]) == 1 for i in range(4))
    finally:
        lifecycle.close_all([(family, handle)])
    small = make_case(optimizer="adam", family="8bit_blockwise", param_dtype="float32", hyper=case.hyper,
                      gradient=case.gradient, seed=0, size=ParamLayout(groups=[TensorGroupSpec(
                          sizes=[1, 257], hyper=case.hyper)]).flat_size, steps=2,
                      layout=ParamLayout(groups=[TensorGroupSpec(sizes=[1, 257], hyper=case.hyper)]))
    result = run_case(small, CPU, families=adapter.families())
    assert result.status == "not_applicable" and "fell back" in result.message, (result.status, result.message)


def test_bitsandbytes_layout_cases_with_a_gradient_scale_or_skip_zeros_are_unsupported():
    adapter = _loaded("bitsandbytes")
    case = layout_case("adam", "32bit")
    for change in ({"gnorm_scale": 0.5}, {"skip_zeros": True}):
        groups = [case.layout.groups[0], TensorGroupSpec(sizes=SIZES[1], hyper={**case.layout.groups[1].hyper, **change})]
        changed = case.model_copy(update={"layout": ParamLayout(groups=groups)})
        assert "optimizer classes take no" in adapter.unsupported(changed, CPU)
    assert adapter.unsupported(case, CPU) is None


# ----------------------------------------------------------------------------- torchao (compiled)
@pytest.mark.slow
def test_torchao_8bit_layout_is_one_optimizer_with_its_groups_on_both_engines():
    adapter = _loaded("torchao")
    case = layout_case("adam", "8bit_blockwise", steps=3)
    family, flat, views, handle = _opened(adapter, case)
    try:
        assert type(handle.optimizer).__name__ == "AdamW8bit"
        # torchao holds each group's lr as a float32 tensor (its add_param_group): compared as one.
        f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731
        assert [(float(g["lr"]), g["weight_decay"]) for g in handle.optimizer.param_groups] == \
            [(f32(0.01), 0.1), (f32(0.005), 0.0)]
    finally:
        lifecycle.close_all([(family, handle)])
    cases = [case, layout_case("adam", "8bit_blockwise", second_wd=0.05, steps=3)]
    pairs = engine_results(cases, CPU, adapter.families())
    assert all(r.status == "ok" for pair in pairs for r in pair), [(r.status, r.message) for p in pairs for r in p]
    assert mismatches(pairs) == []
    plain, decayed = pairs[0][0].trajectory, pairs[1][0].trajectory
    assert all(a[:3] == b[:3] and a[3] != b[3] for a, b in zip(plain.tensor_digests, decayed.tensor_digests))


# ----------------------------------------------------------------------------- unreadable state
def _opaque(version: str):  # noqa: ANN202
    adapter = get_adapter(OPAQUE)
    adapter.load(version)
    return adapter


def test_the_deepspeed_0_19_0_pattern_moves_only_the_parameters_and_only_from_step_3():
    """What opaque_steps declares about its op's beta powers holds: the 0.19.0 op (running powers
    kept on a second call at the same step) gives the same digests for a one-tensor case at every
    step; for a layout case, the same until step 2 and other digests from step 3, where every
    readable state is still equal and only the parameters differ."""
    one_tensor = make_case(optimizer="adam", family="32bit", param_dtype="float32",
                           hyper={**OPTIMIZER_HYPER_DEFAULTS["adam"], "lr": 0.01, "weight_decay": 0.1},
                           gradient=GradientStreamSpec(kind="open"), seed=0, size=4096, steps=6)
    before, after = (run_case(one_tensor, CPU, families=_opaque(v).families()) for v in ("installed", "deepspeed-0.19.0"))
    assert before.trajectory.digests == after.trajectory.digests

    case = layout_case("adam", "32bit", steps=6)
    runs = {}
    for version in ("installed", "deepspeed-0.19.0"):
        family, flat, views, handle = _opened(_opaque(version), case)
        stream = GradientStream(case.gradient, seed=0, size=case.size, device=CPU, grad_dtype=torch.float32)
        series = []
        try:
            for step in range(1, case.steps + 1):
                family.step_group(handle, views, lifecycle.tensor_views(case, stream.kernel_gradient(step, flat)), step)
                series.append((flat.clone(), {k: v.clone() for k, v in family.state_for_digest(handle).items()}))
        finally:
            lifecycle.close_all([(family, handle)])
        runs[version] = series
    declared = {entry.name: entry for entry in _opaque("installed").families()["32bit"].unreadable_state(case)}
    powers = next(entry for name, entry in declared.items() if "beta1**t" in name)
    assert powers.seen_through == ("parameters",) and powers.from_step == 3
    for step, ((p_old, s_old), (p_new, s_new)) in enumerate(zip(runs["installed"], runs["deepspeed-0.19.0"]), start=1):
        assert s_old.keys() == s_new.keys()
        assert all(torch.equal(s_old[k], s_new[k]) for k in s_old), f"step {step}: a readable state changed"
        assert torch.equal(p_old, p_new) == (step < powers.from_step), f"step {step}"


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["32bit", "8bit_blockwise"])
@pytest.mark.parametrize("optimizer", ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"])
def test_bitsandbytes_layout_cases_on_cuda(optimizer, family):
    """bnb's CUDA library behind its optimizer classes: the layout case runs on both engines with
    the same digests, the second group's weight decay moves its tensor alone, and an fp32 32-bit
    case follows the float64 torch.optim reference (param groups and all) to float32 rounding: its
    updates landed in the engine's views."""
    adapter = _loaded("bitsandbytes")
    cuda = torch.device("cuda")
    cases = [layout_case(optimizer, family), layout_case(optimizer, family, second_wd=0.05)]
    pairs = engine_results(cases, cuda, adapter.families())
    assert all(r.status == "ok" for pair in pairs for r in pair), [(r.status, r.message) for p in pairs for r in p]
    assert mismatches(pairs) == []
    plain, decayed = pairs[0][0].trajectory, pairs[1][0].trajectory
    assert all(a[:3] == b[:3] and a[3] != b[3] and a[4] == b[4]
               for a, b in zip(plain.tensor_digests, decayed.tensor_digests))
    if family == "32bit":
        # 4 steps at lr 0.01 move parameters by ~0.04; float32 rounding leaves ~1e-6 (measured on
        # the CPU backend: at most 5e-6). 1e-4 is far below what an update that did not land makes.
        assert plain.ref64_max_abs[-1] < 1e-4, plain.ref64_max_abs
