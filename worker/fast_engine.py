"""The fast battery runner: the same CaseResults as worker.trajectory.run_case, bit for bit, with
far fewer launches and host round trips.

What is shared, and why each sharing gives the same bits:

* **Groups.** Cases with the same family, optimizer, parameter dtype, hyperparameters, gradient
  kind and step count run together. Their tensors live in padded [cases, width] buffers; width is
  a multiple of ALIGN elements, so every row starts at least 512-byte aligned (the kernel sees the
  alignment a fresh allocation has) and element j of row i sits at flat index i*width + j, the
  same position modulo ALIGN as in a tensor of its own.
* **The kernel under test is called per case**, through the family adapter exactly as run_case
  calls it, on contiguous row views of the case's own length. Nothing about the kernel is
  assumed: a kernel whose result depends on the tensor's length, blocks or tail sees the same
  length, blocks and tail as in run_case.
* **The float64 and float32 references run once per group** over the whole buffer. They are
  torch elementwise ops (torch.optim's single-tensor loops, the paper references) on types whose
  vectorised and scalar loops compute the same IEEE operations, so an element's value does not
  depend on where it sits. Padding holds parameter 0 and gradient 0, which stays exactly 0 under
  every reference optimizer, so padding never turns into NaN next to real values.
  **16-bit same-precision references run per case** on tensors of the case's own length: torch's
  CPU half/bfloat16 kernels give position-dependent bits (vector body vs scalar tail; measured: 145
  of 652 grouped cases differed when they were batched), so batching them is not exact.
* **Inputs are computed once.** Initial parameters, open-loop gradient values and zero masks
  depend only on (seed, size, step, ...): the same gradients.py functions make them once per
  process, and the same casts (on the CPU, as run_case does) give each case's rows.
* **Metrics and digests stay on the device**: per row maxima (the padding contributes 0 to
  max |p - r| and the relative error, and maxima are exact in any order), non-finite counts and
  the od2 digest lanes (integer sums, exact in any order; padding masked out) are written into
  [steps, cases] history tensors and copied to the host once per group.
* **CUDA graphs** capture that per-step observation (about a hundred small kernels per step) once
  per group and replay it every step. The kernel and reference steps stay eager: their scalars
  (step number, bias corrections) change every step and each group runs once, so a graph of them
  would be replayed only once.

A group whose kernel raises is re-run case by case with run_case, so the broken case is reported
exactly as the straightforward path reports it and its group mates are unaffected.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from service.results import CaseResult, CaseSpec, Trajectory
from worker import digest as od2
from worker.gradients import GradientStream, initial_parameters, zero_mask
from worker.references import make_reference
from worker.trajectory import FAMILY_ADAPTERS, RELATIVE_ERROR_FLOOR, TORCH_DTYPES, FamilyAdapter, run_case

ALIGN = 512  # elements; 2 KiB for float32 rows, 1 KiB for 16-bit rows, 512 B for uint8 codes
DEFAULT_MAX_GROUP_ELEMENTS = 1 << 23  # cases * width per group: bounds memory (steps x grads)


def group_key(case: CaseSpec) -> tuple:
    return (case.family, case.optimizer, case.param_dtype, tuple(sorted(case.hyper.items())),
            case.gradient.kind, case.steps)


def plan_groups(cases: list[CaseSpec], max_group_elements: int = DEFAULT_MAX_GROUP_ELEMENTS,
                max_group_cases: int = 64) -> list[list[int]]:
    """Indices of `cases` in groups that may share references; order within a group is battery
    order. Sizes are sorted so small cases are not padded to a huge one's width."""
    by_key: dict[tuple, list[int]] = defaultdict(list)
    for index, case in enumerate(cases):
        by_key[group_key(case)].append(index)
    groups: list[list[int]] = []
    for indices in by_key.values():
        current: list[int] = []
        for index in sorted(indices, key=lambda i: cases[i].size):
            width = _round_up(cases[index].size)
            if current and (len(current) + 1) * width > max_group_elements or len(current) >= max_group_cases:
                groups.append(current)
                current = []
            current.append(index)
        groups.append(current)
    return groups


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------- inputs, made once
class InputCache:
    """Initial parameters, open-loop gradient values and zero masks (CPU), by their arguments."""

    def __init__(self) -> None:
        self._init: dict[tuple, torch.Tensor] = {}
        self._open: dict[tuple, torch.Tensor] = {}
        self._masks: dict[tuple, torch.Tensor | None] = {}

    def initial(self, seed: int, size: int) -> torch.Tensor:
        key = (seed, size)
        if key not in self._init:
            self._init[key] = initial_parameters(seed, size)
        return self._init[key]

    def open_values(self, case: CaseSpec, step: int) -> torch.Tensor:
        key = (case.seed, case.size, case.gradient.scale, step)
        if key not in self._open:
            stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu",
                                    grad_dtype=torch.float32)
            self._open[key] = stream._open_values(step)
        return self._open[key]

    def mask(self, case: CaseSpec, step: int) -> torch.Tensor | None:
        key = (case.seed, case.size, case.gradient.zero_fraction, step)
        if key not in self._masks:
            self._masks[key] = zero_mask(case.seed, step, case.size, case.gradient.zero_fraction)
        return self._masks[key]

    def clear(self) -> None:
        self._init.clear(), self._open.clear(), self._masks.clear()


# ----------------------------------------------------------------------------- one group
@dataclass
class _Slot:
    """One tensor of every case of a group (the parameter or one state) in a padded buffer."""

    buffer: torch.Tensor                       # [cases, width]
    lengths: list[int]
    shapes: list[torch.Size]
    valid: torch.Tensor = field(init=False)    # bool [cases, width]: False on padding

    def __post_init__(self) -> None:
        columns = torch.arange(self.buffer.shape[1], device=self.buffer.device)
        lengths = torch.tensor(self.lengths, device=self.buffer.device)
        self.valid = columns.unsqueeze(0) < lengths.unsqueeze(1)

    def view(self, row: int) -> torch.Tensor:
        return self.buffer[row, :self.lengths[row]].view(self.shapes[row])


def _slot_from(tensors: list[torch.Tensor], device: torch.device) -> _Slot:
    width = _round_up(max(t.numel() for t in tensors))
    buffer = torch.zeros((len(tensors), width), dtype=tensors[0].dtype, device=device)
    for row, tensor in enumerate(tensors):
        buffer[row, :tensor.numel()] = tensor.reshape(-1)
    return _Slot(buffer, [t.numel() for t in tensors], [t.shape for t in tensors])


class _Group:
    def __init__(self, cases: list[CaseSpec], device: torch.device, inputs: InputCache, families):  # noqa: ANN001
        self.cases, self.device, self.inputs = cases, device, inputs
        first = cases[0]
        self.steps = first.steps
        self.dtype = TORCH_DTYPES[first.param_dtype]
        self.adapter = families[first.family]
        # The starting point exactly as run_case makes it: float32 init, cast on the CPU.
        params = [inputs.initial(c.seed, c.size).to(self.dtype) for c in cases]
        self.param = _slot_from(params, device)
        self.width = self.param.buffer.shape[1]
        per_case = [self.adapter.init_states(c, self.param.view(row)) for row, c in enumerate(cases)]
        self.state_names = list(per_case[0])
        self.states = [_slot_from([s[name] for s in per_case], device) for name in self.state_names]
        self.ref64 = make_reference(first, self.param.buffer.to(torch.float64))
        # 16-bit same-precision references: one per case, on its own tensor (see the docstring).
        self.same_per_case = self.dtype != torch.float32
        if self.same_per_case:
            self.ref_same_cases = [make_reference(c, self.param.view(row).clone()) for row, c in enumerate(cases)]
            self.ref_same = None
        else:
            self.ref_same = make_reference(first, self.param.buffer.clone())
        self.closed = first.gradient.kind == "closed"
        if self.closed:
            self._closed_constants()
        self.has_zeros = any(c.gradient.zero_fraction > 0 for c in cases)

    # -- gradients
    def _closed_constants(self) -> None:
        h = torch.zeros((len(self.cases), self.width), dtype=torch.float32)
        c = torch.zeros_like(h)
        for row, case in enumerate(self.cases):
            stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu",
                                    grad_dtype=self.dtype)
            h[row, :case.size] = stream.curvature32
            c[row, :case.size] = stream.centre32
        # Padding: h = c = 0, so the padded gradient h*(p - c) is exactly 0.
        self.h32, self.c32 = h.to(self.device), c.to(self.device)
        self.h64, self.c64 = self.h32.to(torch.float64), self.c32.to(torch.float64)
        self.h_same, self.c_same = self.h32.to(self.dtype), self.c32.to(self.dtype)

    def _step_masks(self, step: int) -> torch.Tensor | None:
        if not self.has_zeros:
            return None
        mask = torch.zeros((len(self.cases), self.width), dtype=torch.bool)
        for row, case in enumerate(self.cases):
            case_mask = self.inputs.mask(case, step)
            if case_mask is not None:
                mask[row, :case.size] = case_mask
        return mask

    def open_gradients(self) -> torch.Tensor:
        """[steps, cases, width] kernel gradients (grad dtype, zeros applied), one upload."""
        grads = torch.zeros((self.steps, len(self.cases), self.width), dtype=self.dtype)
        masks = torch.zeros((self.steps, len(self.cases), self.width), dtype=torch.bool) if self.has_zeros else None
        for step in range(1, self.steps + 1):
            for row, case in enumerate(self.cases):
                grads[step - 1, row, :case.size] = self.inputs.open_values(case, step).to(self.dtype)
            if masks is not None:
                masks[step - 1] = self._step_masks(step)
        grads = grads.to(self.device)
        if masks is not None:
            grads = grads.masked_fill(masks.to(self.device), 0.0)
        return grads

    # -- observation: metrics and digest lanes of the current step into the histories
    def allocate_histories(self) -> None:
        shape = (self.steps, len(self.cases))
        self.hist_f64 = torch.zeros((3,) + shape, dtype=torch.float64, device=self.device)
        self.hist_i64 = torch.zeros((3,) + shape, dtype=torch.int64, device=self.device)
        self.step_index = torch.zeros((1,), dtype=torch.int64, device=self.device)
        self.r64 = torch.zeros_like(self.ref64.param.detach())
        self.r_same = torch.zeros_like(self.param.buffer)
        self.salts = [od2.salts(slot, s.buffer.shape[1], self.device)
                      for slot, s in enumerate([self.param, *self.states])]

    def observe(self) -> None:
        p64 = self.param.buffer.to(torch.float64)
        delta = (p64 - self.r64).abs()
        abs64 = delta.amax(dim=1)
        rel64 = (delta / self.r64.abs().clamp_min(RELATIVE_ERROR_FLOOR)).amax(dim=1)
        same = (p64 - self.r_same.to(torch.float64)).abs().amax(dim=1)
        nonfinite = None
        lane_a = lane_b = None
        for slot, (tensors, (salt, odd)) in enumerate(zip([self.param, *self.states], self.salts)):
            count = (~torch.isfinite(tensors.buffer)).sum(dim=1)
            nonfinite = count if nonfinite is None else nonfinite + count
            a, b = od2.lanes(od2.element_bits(tensors.buffer), salt, odd, tensors.valid)
            lane_a = a if lane_a is None else lane_a + a
            lane_b = b if lane_b is None else lane_b + b
        self.hist_f64.index_copy_(1, self.step_index, torch.stack([abs64, rel64, same]).unsqueeze(1))
        self.hist_i64.index_copy_(1, self.step_index, torch.stack([nonfinite, lane_a, lane_b]).unsqueeze(1))
        self.step_index.add_(1)

    # -- the run
    def run(self, use_graph: bool) -> list[CaseResult]:
        started = time.perf_counter()
        self.allocate_histories()
        grads_all = None if self.closed else self.open_gradients()
        graph = None
        rows = range(len(self.cases))
        kernel_params = [self.param.view(r) for r in rows]
        kernel_states = [{n: s.view(r) for n, s in zip(self.state_names, self.states)} for r in rows]
        for step in range(1, self.steps + 1):
            if self.closed:
                grad = (self.h32 * (self.param.buffer.to(torch.float32) - self.c32)).to(self.dtype)
                masks = self._step_masks(step)
                if masks is not None:
                    grad = grad.masked_fill(masks.to(self.device), 0.0)
            else:
                grad = grads_all[step - 1]
            for row, case in enumerate(self.cases):
                self.adapter.step(case, kernel_params[row], grad[row, :case.size].view(kernel_params[row].shape),
                                  kernel_states[row], step)
            if self.closed:
                g64 = self.h64 * (self.ref64.param - self.c64)
                device_masks = masks.to(self.device) if masks is not None else None
                if device_masks is not None:
                    g64 = g64.masked_fill(device_masks, 0.0)
            else:
                g64 = grad.to(torch.float64)
            self.ref64.step(step, g64)
            self.r64.copy_(self.ref64.param.detach())
            if not self.same_per_case:
                if self.closed:
                    g_same = self.h_same * (self.ref_same.param - self.c_same)
                    if device_masks is not None:
                        g_same = g_same.masked_fill(device_masks, 0.0)
                else:
                    g_same = grad
                self.ref_same.step(step, g_same)
                self.r_same.copy_(self.ref_same.param.detach())
            else:
                for row, (case, reference) in enumerate(zip(self.cases, self.ref_same_cases)):
                    n = case.size
                    if self.closed:
                        g_same = self.h_same[row, :n] * (reference.param - self.c_same[row, :n])
                        if device_masks is not None:
                            g_same = g_same.masked_fill(device_masks[row, :n], 0.0)
                    else:
                        g_same = grad[row, :n]
                    reference.step(step, g_same)
                    self.r_same[row, :n] = reference.param.detach()
            if not use_graph:
                self.observe()
            elif graph is None:
                graph = self._capture()
            else:
                graph.replay()
        return self._results(time.perf_counter() - started)

    def _capture(self) -> torch.cuda.CUDAGraph:
        # Warm up on a side stream (as torch's capture rules ask), undo its effects, capture, then
        # replay once for this step: the capture itself does not execute the kernels.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self.observe()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.step_index.sub_(1)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.observe()
        graph.replay()
        return graph

    def _results(self, seconds: float) -> list[CaseResult]:
        f64 = self.hist_f64.cpu()
        i64 = self.hist_i64.cpu()
        results = []
        for row, case in enumerate(self.cases):
            trajectory = Trajectory(
                ref64_max_abs=f64[0, :, row].tolist(),
                ref64_max_rel=f64[1, :, row].tolist(),
                same_precision_max_abs=f64[2, :, row].tolist(),
                nonfinite_count=[int(n) for n in i64[0, :, row].tolist()],
                digests=[od2.format_digest(a, b) for a, b in zip(i64[1, :, row].tolist(), i64[2, :, row].tolist())],
            )
            results.append(CaseResult(case=case, status="ok", trajectory=trajectory,
                                      duration_s=seconds / len(self.cases)))
        return results


# ----------------------------------------------------------------------------- the battery
def run_cases_fast(cases: list[CaseSpec], device: torch.device, *, use_graphs: bool | None = None,
                   inputs: InputCache | None = None, on_result=None,  # noqa: ANN001
                   max_group_elements: int = DEFAULT_MAX_GROUP_ELEMENTS,
                   families: Mapping[str, FamilyAdapter] | None = None) -> list[CaseResult]:
    """Every case's result, in the order of `cases`. `use_graphs` defaults to True on CUDA.
    `on_result(index, result)` is called as each group finishes (groups finish out of order).
    `families`: the project adapter's family table, as run_case takes it (bundled by default)."""
    device = torch.device(device)
    use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
    inputs = inputs or InputCache()
    families = FAMILY_ADAPTERS if families is None else families
    unknown = sorted({c.family for c in cases} - set(families))
    if unknown:
        raise ValueError(f"kernel families {unknown} have no adapter (known: {sorted(families)})")
    results: list[CaseResult | None] = [None] * len(cases)
    for indices in plan_groups(cases, max_group_elements):
        group_cases = [cases[i] for i in indices]
        try:
            group_results = _Group(group_cases, device, inputs, families).run(use_graphs)
        except Exception as error:  # noqa: BLE001
            if device.type == "cuda" and ("CUDA" in str(error) or type(error).__name__ == "AcceleratorError"):
                raise  # the context is gone: the kernel host reports and restarts
            group_results = [_run_alone(case, device, families) for case in group_cases]
        for index, result in zip(indices, group_results):
            results[index] = result
            if on_result:
                on_result(index, result)
    return results


def _run_alone(case: CaseSpec, device: torch.device, families) -> CaseResult:  # noqa: ANN001
    try:
        return run_case(case, device, families=families)
    except Exception as error:  # noqa: BLE001 - the kernel host's rule: a kernel error breaks its case
        return CaseResult(case=case, status="broken", message=f"{type(error).__name__}: {error}")
