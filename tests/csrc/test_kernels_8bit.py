"""8-bit blockwise kernels against the float64 quantization-aware reference, step by step.

Teacher-forced: before every step the reference takes the kernel's own codes, absmax and
parameter, so each step is judged on its own. Tolerances are the per-element float32 rounding
bounds derived in worker/references/blockwise8.py (no fixed epsilon): the parameter within its bound,
each absmax within its bound, each code one a correct kernel may pick (the nearest code to some
value inside the state's bound). Runs on CPU, and on CUDA when there is one.
"""

from __future__ import annotations

import pytest
import torch

from worker.references import blockwise8 as ref8
from worker.battery import OPTIMIZER_HYPER_DEFAULTS
from worker.references.quant_map import dynamic_map

OPTIMIZERS = ["adam", "ademamix", "lion", "momentum", "rmsprop", "adagrad"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def hyper(optimizer: str, **overrides) -> dict:
    values = dict(OPTIMIZER_HYPER_DEFAULTS[optimizer])
    values.update(overrides)
    return values


def run_checked(kernels, optimizer, h, *, dtype, device, size, steps, seed=0, poison=()):
    """Step the kernel `steps` times, checking each step against the teacher-forced reference."""
    generator = torch.Generator().manual_seed(seed)
    signed_map, unsigned_map = dynamic_map(signed=True, device=device), dynamic_map(signed=False, device=device)
    param = torch.randn(size, generator=generator).to(dtype).to(device)
    states = kernels.new_states_8bit(optimizer, param, signed_map, unsigned_map)
    checks = []
    for step in range(1, steps + 1):
        grad = torch.randn(size, generator=generator).to(dtype)
        for index, value in poison:
            grad[index % size] = value
        grad = grad.to(device)
        codes = [c.clone() for c, _ in states.values()]
        absmax = [a.clone() for _, a in states.values()]
        before = param.clone()
        reference = ref8.reference_step(optimizer, h, step, before, grad, codes, absmax, signed_map, unsigned_map)
        kernels.step_8bit(optimizer, param, grad, states, step=step, hyper=h,
                          signed_map=signed_map, unsigned_map=unsigned_map)
        check = ref8.check_step(reference, param, [c for c, _ in states.values()], [a for _, a in states.values()])
        assert check.ok, f"{optimizer} {dtype} {device} step {step}: {check}"
        checks.append(check)
    return param, states, checks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_steps_match_quantization_aware_reference(kernels, optimizer, dtype, device):
    # lr=0.1/wd=0.1 (the discriminating point); 700 = two full blocks and a partial one.
    run_checked(kernels, optimizer, hyper(optimizer, lr=0.1, weight_decay=0.1), dtype=dtype,
                device=device, size=700, steps=8)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("size", [1, 255, 256, 257, 4097])
def test_sizes_not_a_multiple_of_the_block(kernels, size, device):
    for optimizer in ("adam", "rmsprop"):
        run_checked(kernels, optimizer, hyper(optimizer, lr=1e-2, weight_decay=1e-2, gnorm_scale=0.5),
                    dtype=torch.float32, device=device, size=size, steps=4, seed=size)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_skip_zeros_and_typical_point(kernels, device):
    run_checked(kernels, "adam", hyper("adam", lr=1e-3, weight_decay=1e-2, skip_zeros=True),
                dtype=torch.float32, device=device, size=600, steps=5, poison=[(3, 0.0), (400, 0.0)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_nonfinite_gradient_leaves_its_parameter_and_block_intact(kernels, optimizer, device):
    poison = [(5, float("nan")), (300, float("inf")), (301, float("-inf"))]
    param, states, _ = run_checked(kernels, optimizer, hyper(optimizer, lr=0.1, weight_decay=0.1),
                                   dtype=torch.float32, device=device, size=600, steps=3, poison=poison)
    assert bool(torch.isfinite(param).all())
    for codes, absmax in states.values():
        assert bool(torch.isfinite(absmax).all()) and bool((absmax > 0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_first_step_matches_closed_form(kernels, optimizer, dtype, device):
    """One step from a zero state at lr=0.1, wd=0.1: within the float32 bound of the closed form,
    and the decay-after-update ordering (adam/ademamix) is far outside it."""
    h = hyper(optimizer, lr=0.1, weight_decay=0.1)
    generator = torch.Generator().manual_seed(7)
    size = 1000
    param0 = torch.randn(size, generator=generator).to(dtype).to(device)
    grad = torch.randn(size, generator=generator).to(dtype).to(device)
    signed_map, unsigned_map = dynamic_map(signed=True, device=device), dynamic_map(signed=False, device=device)
    states = kernels.new_states_8bit(optimizer, param0, signed_map, unsigned_map)
    reference = ref8.reference_step(optimizer, h, 1, param0, grad, [c for c, _ in states.values()],
                                    [a for _, a in states.values()], signed_map, unsigned_map)
    param = param0.clone()
    kernels.step_8bit(optimizer, param, grad, states, step=1, hyper=h, signed_map=signed_map,
                      unsigned_map=unsigned_map)
    closed = ref8.closed_form_first_step(optimizer, h, param0, grad)
    # The reference's float64 value is the closed form (the zero state is exact), to float64 rounding.
    assert float((reference.param - closed).abs().max()) <= 1e-14
    distance = (param.reshape(-1).to(torch.float64) - closed).abs()
    assert bool((distance <= reference.param_bound).all()), float((distance - reference.param_bound).max())
    if optimizer in ("adam", "ademamix") and dtype == torch.float32:
        wrong = ref8.decay_after_update_first_step(optimizer, h, param0, grad)
        gap = (wrong - closed).abs()
        assert float(gap.max()) > 100 * float(reference.param_bound.max())


def _states_and_maps(device="cpu", size=300):
    signed_map, unsigned_map = dynamic_map(signed=True), dynamic_map(signed=False)
    param = torch.zeros(size)
    return param, signed_map, unsigned_map


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_bad_hyperparameter_is_named_by_the_8bit_op(kernels, optimizer, device):
    # The 8-bit ops share each optimizer's hyperparameter checks with its 32-bit op
    # (csrc/checks_impl.h): -1 is out of range for every one of them, and step 0 for the step.
    signed_map, unsigned_map = dynamic_map(signed=True, device=device), dynamic_map(signed=False, device=device)
    param = torch.zeros(300, device=device)
    op = f"optdrift::{optimizer}_8bit_blockwise_step"
    bad = {name: -1.0 for name, value in OPTIMIZER_HYPER_DEFAULTS[optimizer].items() if not isinstance(value, bool)}
    for name, value in bad.items():
        states = kernels.new_states_8bit(optimizer, param, signed_map, unsigned_map)
        with pytest.raises(RuntimeError, match=f"{op}.*'{name}'"):
            kernels.step_8bit(optimizer, param, torch.ones_like(param), states, step=1,
                              hyper=hyper(optimizer, **{name: value}), signed_map=signed_map,
                              unsigned_map=unsigned_map)
    if optimizer in kernels.STEP_DEPENDENT:
        states = kernels.new_states_8bit(optimizer, param, signed_map, unsigned_map)
        with pytest.raises(RuntimeError, match=f"{op}.*'step'"):
            kernels.step_8bit(optimizer, param, torch.ones_like(param), states, step=0, hyper=hyper(optimizer),
                              signed_map=signed_map, unsigned_map=unsigned_map)
    assert torch.equal(param, torch.zeros_like(param))  # a refused call changes nothing


def test_bad_inputs_name_the_argument(kernels):
    op = torch.ops.optdrift.adam_8bit_blockwise_step
    param, signed_map, unsigned_map = _states_and_maps()
    grad = torch.ones_like(param)

    def call(**changes):
        args = {"exp_avg_codes": torch.zeros(300, dtype=torch.uint8), "exp_avg_absmax": torch.zeros(2),
                "exp_avg_sq_codes": torch.zeros(300, dtype=torch.uint8), "exp_avg_sq_absmax": torch.zeros(2),
                "signed_map": signed_map, "unsigned_map": unsigned_map}
        args.update(changes)
        op(param, grad, args["exp_avg_codes"], args["exp_avg_absmax"], args["exp_avg_sq_codes"],
           args["exp_avg_sq_absmax"], args["signed_map"], args["unsigned_map"], 1, 0.1, 0.9, 0.999,
           1e-8, 0.0, 1.0, False)

    call()  # the good call passes
    cases = [
        ({"exp_avg_codes": torch.zeros(300)}, "'exp_avg_codes' has dtype"),
        ({"exp_avg_sq_codes": torch.zeros(299, dtype=torch.uint8)}, "'exp_avg_sq_codes' has 299 elements"),
        ({"exp_avg_absmax": torch.zeros(3)}, "'exp_avg_absmax' has 3 elements"),
        ({"exp_avg_sq_absmax": torch.zeros(2, dtype=torch.float64)}, "'exp_avg_sq_absmax' has dtype"),
        ({"signed_map": signed_map[:255]}, "'signed_map' has shape"),
        ({"signed_map": signed_map.double()}, "'signed_map' has dtype"),
        ({"signed_map": signed_map.flip(0)}, "'signed_map' is not sorted"),
        ({"unsigned_map": signed_map}, "'unsigned_map' has value"),
        ({"unsigned_map": unsigned_map + 1e-3}, "'unsigned_map'"),
    ]
    for changes, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call(**changes)


def test_one_state_op_rejects_a_map_without_zero(kernels):
    param = torch.zeros(10)
    shifted = dynamic_map(signed=False)
    shifted[0] = 1e-9  # still sorted and in range, but no exact 0
    with pytest.raises(RuntimeError, match="'unsigned_map' has no exact 0"):
        torch.ops.optdrift.adagrad_8bit_blockwise_step(param, param.clone(), torch.zeros(10, dtype=torch.uint8),
                                                       torch.zeros(1), shifted, 0.1, 1e-10, 0.0, 1.0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_checked_map_changed_in_place_is_checked_again(kernels, device):
    # The op remembers maps whose values passed (reading a CUDA map back synchronises), keyed by
    # the tensor and its version counter: an in-place change must bring the check back.
    param = torch.zeros(10, device=device)
    unsigned_map = dynamic_map(signed=False).to(device)

    def call():
        torch.ops.optdrift.adagrad_8bit_blockwise_step(param, param.clone(),
                                                       torch.zeros(10, dtype=torch.uint8, device=device),
                                                       torch.zeros(1, device=device), unsigned_map, 0.1, 1e-10,
                                                       0.0, 1.0)

    call()
    call()  # remembered: passes again without reading the values
    unsigned_map[0] = 1e-9  # in place, through the same tensor: the version counter moves
    with pytest.raises(RuntimeError, match="'unsigned_map' has no exact 0"):
        call()
    unsigned_map[0] = 0.0
    call()
    view = unsigned_map[:1]
    view.fill_(-0.5)  # through a view: views share the version counter
    with pytest.raises(RuntimeError, match="'unsigned_map' has value -0.5"):
        call()


def test_opcheck_adam_and_lion(kernels):
    signed_map, unsigned_map = dynamic_map(signed=True), dynamic_map(signed=False)
    param = torch.randn(300)
    states = kernels.new_states_8bit("adam", param, signed_map, unsigned_map)
    (c1, a1), (c2, a2) = states.values()
    torch.library.opcheck(torch.ops.optdrift.adam_8bit_blockwise_step,
                          (param, torch.randn(300), c1, a1, c2, a2, signed_map, unsigned_map, 1, 0.1,
                           0.9, 0.999, 1e-8, 0.1, 1.0, False))
    (c, a), = kernels.new_states_8bit("lion", param, signed_map, unsigned_map).values()
    torch.library.opcheck(torch.ops.optdrift.lion_8bit_blockwise_step,
                          (param, torch.randn(300), c, a, signed_map, 1e-4, 0.9, 0.99, 0.1, 1.0))
