"""Run one case on the loaded build: the kernel's trajectory beside its references, step by step.

Per step (after the step, steps 1-based) it records, at full precision:
  * max |p - r64| and max relative error against the float64 reference,
  * max |p - r| against the same-precision reference,
  * the NaN/Inf count over parameters and states,
  * a digest of the parameter and state bytes (the bitwise fingerprint),
  * for a quantized case whose adapter names its codec: the states' mean distance to the
    quantization-aware float64 reference in quantization steps and the parameters' max distance to
    it (worker.engine.quant_series; the fast engine records the same).
The scalar metrics stay on the device as 0-d tensors and are copied to the host once per case, so
a GPU run does not synchronise on every metric. Digests are worker.engine.digest's `od2` scheme (integer
lanes computed on the device; this straightforward path copies two integers per step), the same
definition worker.engine.fast computes batched, so both paths give the same digests.

Kernel families are dispatched through a project adapter's family table (worker.adapters): a family
adapter creates the family's states and performs one kernel step. The bundled kernels' families live
with the bundled adapter (worker/adapters/bundled.py) and are the default.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import BinaryIO

import torch

from service.core.results import CaseResult, CaseSpec, Trajectory
from worker.adapters.base import FamilyAdapter  # noqa: F401 - re-exported: the engines' family type
from worker.adapters.base import GroupLifecycleMissing, StateNotAsDeclared
from worker.engine import lifecycle, states_file
from worker.engine.digest import digest_tensors
from worker.engine.gradients import GradientStream, initial_parameters
from worker.engine.quant_series import QuantRefSeries
from worker.references.optimizers import make_reference

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Relative error denominators are floored at the smallest normal float32 so exact zeros stay finite.
RELATIVE_ERROR_FLOOR = 2.0 ** -126


def bundled_families() -> Mapping[str, "FamilyAdapter"]:
    """The bundled csrc kernels' families, the default of the engines (worker.adapters.bundled)."""
    from worker.adapters.bundled import FAMILIES

    return FAMILIES


# The per-case lifecycle both engines follow (open -> step* -> state_for_digest -> close) is
# written down with the base class, worker.adapters.base.FamilyAdapter (docs/PROJECTS.md, "The
# adapter contract"); it is imported above and re-exported, where the engines take family tables.


def _nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    # torch has no isfinite for the float8 dtypes (FP8 state families' values): widened, exactly.
    return sum((~torch.isfinite(t.float() if t.is_floating_point() and t.element_size() == 1 else t)).sum()
               for t in tensors)


def _start(case: CaseSpec, device: torch.device, families: Mapping[str, FamilyAdapter] | None):  # noqa: ANN202
    """(family adapter, parameters, gradient stream) of a case before its first step."""
    families = bundled_families() if families is None else families
    family = lifecycle.family_for(families, case)
    dtype = TORCH_DTYPES[case.param_dtype]
    param = initial_parameters(case.seed, case.size).to(dtype).to(device)
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device=device, grad_dtype=dtype)
    return family, param, stream


class _CaseDriver:
    """Opens, steps and closes one case through its family adapter: the per-case lifecycle, or for
    a layout case the group lifecycle over views of the flat parameter vector (one optimizer over
    every tensor; its gradients are the same views of the flat gradient)."""

    def __init__(self, family: FamilyAdapter, case: CaseSpec, param: torch.Tensor, device: torch.device) -> None:
        self.family, self.case, self.param = family, case, param
        if case.layout is None:
            self.views = None
            self.handle = lifecycle.open_case(family, case, param, device)
        else:
            # The slots once: a step takes the same slices of the flat gradient.
            self.spans = [(slot.offset, slot.stop) for slot in case.tensor_slots()]
            self.views = [param[start:stop] for start, stop in self.spans]
            self.handle = lifecycle.open_group_case(family, case, self.views, device)

    def step(self, grad: torch.Tensor, step: int) -> None:
        if self.views is None:
            self.family.step(self.handle, self.param, grad, step)
        else:
            self.family.step_group(self.handle, self.views, [grad[start:stop] for start, stop in self.spans], step)

    def close(self) -> None:
        lifecycle.close_all([(self.family, self.handle)])


class _TensorSeries:
    """A layout case's per-tensor series (Trajectory.tensor_digests / tensor_ref64_max_abs): after
    each step, a digest per tensor of its parameter slice and its own "t<i>." states, then one of
    the guard elements; and each tensor's max |p - r64|."""

    def __init__(self, case: CaseSpec, param: torch.Tensor) -> None:
        self.slots = case.tensor_slots()
        covered = torch.zeros(case.size, dtype=torch.bool)
        for slot in self.slots:
            covered[slot.offset:slot.stop] = True
        self.guards = (~covered).nonzero().flatten().to(param.device)
        self.digests: list[list[str]] = []
        self.distances: list[torch.Tensor] = []

    def observe(self, param: torch.Tensor, named: list[tuple[str, torch.Tensor]]) -> None:
        row = []
        for slot in self.slots:
            prefix = f"t{slot.index}."
            own = [tensor for name, tensor in named if name.startswith(prefix)]
            row.append(digest_tensors([param[slot.offset:slot.stop], *own]))
        row.append(digest_tensors([param.index_select(0, self.guards)]))
        self.digests.append(row)

    def observe_distance(self, delta: torch.Tensor) -> None:
        self.distances.append(torch.stack([delta[slot.offset:slot.stop].max() for slot in self.slots]))

    def series(self) -> dict:
        distances = torch.stack(self.distances).cpu().tolist() if self.distances else None
        return {"tensor_digests": self.digests, "tensor_ref64_max_abs": distances}


def _not_as_declared(case: CaseSpec, error: StateNotAsDeclared | GroupLifecycleMissing, started: float) -> CaseResult:
    """A state that is not the declared one (a silent fallback): set aside, never judged as the
    family it claims. Both engines end here (the fast engine hands a case that raised to run_case)."""
    return CaseResult(case=case, status="not_applicable", message=str(error),
                      duration_s=time.perf_counter() - started)


def run_params(case: CaseSpec, device: torch.device, params_out: BinaryIO, *,
               families: Mapping[str, FamilyAdapter] | None = None, states_out: BinaryIO | None = None) -> CaseResult:
    """The kernels alone: the parameters after each step into `params_out` (float32) and the
    per-step digests — what a baseline co-run needs (per-step |commit - baseline|, and proof that it
    reproduced the stored trajectory), without the float64 and same-precision references that make
    run_case slow. The trajectory's metric series are left empty. `states_out`: every step's state
    leaves as well, for attribution (worker.engine.states_file)."""
    started = time.perf_counter()
    family, param, stream = _start(case, device, families)
    try:
        driver = _CaseDriver(family, case, param, device)
    except GroupLifecycleMissing as error:
        return _not_as_declared(case, error, started)
    handle = driver.handle
    tensors = _TensorSeries(case, param) if case.layout is not None else None
    try:
        digests = []
        lifecycle.check_declared_state_now(family, handle)  # a state made at open is checked before step 1
        for step in range(1, case.steps + 1):
            driver.step(stream.kernel_gradient(step, param), step)
            named = lifecycle.digest_states(family, handle)
            digests.append(digest_tensors([param, *(tensor for _, tensor in named)]))
            if tensors is not None:
                tensors.observe(param, named)
            params_out.write(param.detach().to(torch.float32).cpu().numpy().tobytes())
            if states_out is not None:
                states_file.write_step(states_out, named)
    except (StateNotAsDeclared, GroupLifecycleMissing) as error:
        return _not_as_declared(case, error, started)
    finally:
        driver.close()
    trajectory = Trajectory(ref64_max_abs=[], ref64_max_rel=[], nonfinite_count=[], digests=digests,
                            tensor_digests=tensors.digests if tensors is not None else None)
    return CaseResult(case=case, status="ok", trajectory=trajectory, duration_s=time.perf_counter() - started)


def run_case(case: CaseSpec, device: torch.device, params_out: BinaryIO | None = None, *,
             families: Mapping[str, FamilyAdapter] | None = None) -> CaseResult:
    """Run `case` on the build loaded in this process. Errors raised by the kernel propagate (the
    kernel host turns them into a `broken` case); `params_out` receives the parameters after each
    step as float32 bytes (exact for fp32/fp16/bf16), for the co-run comparison. `families` is the
    project adapter's family table (worker.adapters, issue 9); the bundled kernels' by default."""
    started = time.perf_counter()
    family, param, stream = _start(case, device, families)
    # Both references start from the kernel's exact starting point (upcast exactly for float64).
    ref64 = make_reference(case, param.to(torch.float64))
    ref_same = make_reference(case, param.clone())

    # A quantized family whose adapter names its codec: the quantization-aware float64 reference,
    # for the direction in quantization steps (worker.engine.quant_series).
    # (Not for a layout case: its codec is per tensor; its direction is judged on float64.)
    quant = QuantRefSeries.for_case(case, family, param) if case.layout is None else None

    abs64, rel64, abs_same, nonfinite, digests = [], [], [], [], []
    try:
        driver = _CaseDriver(family, case, param, device)
    except GroupLifecycleMissing as error:
        return _not_as_declared(case, error, started)
    handle = driver.handle
    tensors = _TensorSeries(case, param) if case.layout is not None else None
    try:
        lifecycle.check_declared_state_now(family, handle)  # a state made at open is checked before step 1
        for step in range(1, case.steps + 1):
            grad = stream.kernel_gradient(step, param)
            driver.step(grad, step)
            named = lifecycle.digest_states(family, handle)
            digested = [param, *(tensor for _, tensor in named)]
            digests.append(digest_tensors(digested))
            if tensors is not None:
                tensors.observe(param, named)
            ref64.step(step, stream.reference_gradient(step, ref64.param))
            ref_same.step(step, stream.reference_gradient(step, ref_same.param))

            p64 = param.to(torch.float64)
            r64 = ref64.param.detach()
            delta = (p64 - r64).abs()
            abs64.append(delta.max())
            if tensors is not None:
                tensors.observe_distance(delta)
            rel64.append((delta / r64.abs().clamp_min(RELATIVE_ERROR_FLOOR)).max())
            abs_same.append((p64 - ref_same.param.detach().to(torch.float64)).abs().max())
            nonfinite.append(_nonfinite(digested))
            if quant is not None:
                quant.observe(step, handle, param)
            if params_out is not None:
                params_out.write(param.detach().to(torch.float32).cpu().numpy().tobytes())
    except (StateNotAsDeclared, GroupLifecycleMissing) as error:
        return _not_as_declared(case, error, started)
    finally:
        driver.close()

    quant_steps, quant_abs = quant.series() if quant is not None else (None, None)
    trajectory = Trajectory(
        ref64_max_abs=torch.stack(abs64).cpu().tolist(),
        ref64_max_rel=torch.stack(rel64).cpu().tolist(),
        same_precision_max_abs=torch.stack(abs_same).cpu().tolist(),
        nonfinite_count=[int(n) for n in torch.stack(nonfinite).cpu().tolist()],
        digests=digests,
        quant_ref_steps=quant_steps,
        quant_ref_max_abs=quant_abs,
        **(tensors.series() if tensors is not None else {}),
    )
    return CaseResult(case=case, status="ok", trajectory=trajectory, duration_s=time.perf_counter() - started)
