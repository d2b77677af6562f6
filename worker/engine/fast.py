"""The fast battery runner: the same CaseResults as worker.engine.trajectory.run_case, bit for bit, with
the per-step work of a whole battery done in a few hundred launches instead of tens of thousands.

Layout. A *wave* of cases (the whole standard battery is two) is laid out in padded row arenas:

* **Width classes.** Every case gets a row of width W: its size rounded up to ALIGN (512)
  elements, then merged upwards into a wider class while the padding that costs stays small
  (`width_classes`; on a GPU, where fewer bundles save reference launches; a kernels-only wave
  has no bundles and merges nothing: KERNELS_ONLY_MERGE_PADDING_FRACTION). A row starts at a multiple of ALIGN elements, so the kernel sees the
  alignment a fresh allocation has and element j sits at the same position modulo ALIGN.
* **Bundles** are the cases of one width class that share the reference optimizer and its
  hyperparameters, whatever their parameter dtype, kernel family, gradient kind, seed or size.
  Their rows are contiguous in the width class's float64 reference arena, so one float64
  reference object (torch.optim, or the papers' Lion/AdEMAMix) steps the whole bundle at once;
  within the bundle, the rows of one dtype are contiguous in that dtype's arena, so one
  same-precision reference steps them.
* **Kernel parameters** live in one arena per (dtype, W), states in one arena per (slot, state
  dtype, width): the kernel under test writes into contiguous row views of the case's own length
  and shape.

Why the bits stay run_case's:

* **The kernel under test is called per case**, with exactly run_case's op and arguments
  (the adapter's `bind`, which checks once and then makes the same call), on a tensor of the
  case's own length; where every bound call is a registered op (bundled_ops.BoundOp), the
  harness's C++ loop makes those same calls (worker.engine.call_loop). Nothing about the
  kernel is assumed, so a kernel whose result depends on the length, blocks or tail sees the
  same length, blocks and tail as in run_case.
* **States** are what each case's handle gives as `state_for_digest` (docs/PROJECTS.md, "The
  adapter contract"): handed-over states move into the state arenas and the adapter steps them
  there; library-owned ones stay with the library and are copied into their arena rows after
  each step, so the arenas digest what the library updated, as run_case does.
* **References** are torch elementwise ops; an element's value does not depend on where it sits
  on CUDA, nor for float32/float64 on the CPU. Padding holds parameter 0 and gradient 0, which
  stays exactly 0 under every reference optimizer. On the CPU, float16/bfloat16 kernels give
  position-dependent bits (vector body vs scalar tail: 145 of 652 grouped cases differed when
  batched), so there the 16-bit same-precision references run per case on tensors of the case's
  own length and are copied into the arena. On CUDA they are batched; the CUDA test compares
  every series with run_case's, 16-bit cases of several sizes included.
* **Gradients** are gradients.py's values: each open-loop stream (seed, size, scale, step) and
  each zero mask is made once, in a thread pool ahead of the step that needs it (torch releases
  the GIL) or before the run came (a spare host's, worker.engine.step_inputs), concatenated into
  one upload per step, and gathered into the arenas by precomputed indices; closed-loop
  gradients h*(p - c) are the same two float32 (or reference-dtype) ops as run_case, over the
  whole arena.
* **Metrics and digests** are per-row maxima and integer sums, exact in any order; padding adds 0
  to the maxima and is masked out of the od2 lanes (one pass per arena through the harness's
  optdrift_od2::observe_rows where it is loaded, worker.engine.od2_op). The whole observation of
  a step is one CUDA graph, captured at step 1 and replayed.

A case whose kernel (or binding) raises is re-run alone with run_case after the wave, so a broken
case is reported exactly as the straightforward path reports it; its arena row is left alone.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from service.core.results import CaseResult, CaseSpec, Trajectory
from worker.adapters.base import AdapterContractError
from worker.engine import digest as od2
from worker.engine.cuda_errors import context_lost
from worker.engine import call_loop, lifecycle, od2_op
from worker.engine import step_inputs
from worker.engine.wave_plan import (  # noqa: F401  (the plan's names are the fast engine's too)
    ALIGN, MERGE_PADDING_FRACTION, plan_wave_indices, plan_waves, reference_key, round_up as _round_up, width_classes,
)
from worker.engine.quant_series import QuantRefSeries
from worker.engine.step_inputs import StepInputs, mask_key, stream_key
from worker.references.optimizers import make_reference
from worker.engine.trajectory import RELATIVE_ERROR_FLOOR, TORCH_DTYPES, FamilyAdapter, bundled_families, run_case

# Elements of parameter rows per wave (padding included): bounds memory. The standard battery's
# ~73M elements make two waves on a GPU; the float64 arenas cost ~8 bytes x 8 per element.
DEFAULT_MAX_WAVE_ELEMENTS = {"cuda": 1 << 26, "cpu": 1 << 23}
# A wave without references (worker.engine.kernels_only: the warm run, the co-run) has no bundles,
# so merging saves it nothing and its padding costs every step's gradient ops and observation:
# unmerged, the standard battery's 100-step wave holds about half the elements.
KERNELS_ONLY_MERGE_PADDING_FRACTION = {"cuda": 0.0, "cpu": 0.0}
# thread_local, not CUDA's default global mode: see _Wave._capture.
CAPTURE_ERROR_MODE = "thread_local"
# Profiling only (bench/warm_battery_profile.py): wait for the device at each phase boundary, so a
# phase's host seconds are its own launches plus its own GPU work, never a wait behind the GPU's
# backlog from another phase. Never set in a real run: it serialises host and device.
SYNCHRONIZE_PHASES = False
# Profiling only (bench/warm_battery_profile.py): False makes each step's gradients eagerly on CUDA
# too, to compare against their graph (`_Wave.graphed_gradients`) in one run.
GRAPHED_GRADIENTS = True


# ----------------------------------------------------------------------------- gradient inputs
def _gather_index(cases: list[CaseSpec], width: int, offsets: dict, sentinel: int, key_of, step: int,  # noqa: ANN001
                  device: torch.device) -> torch.Tensor:
    """[rows, width] int64 into a step's layout, made on the device: offset + j for j < size
    where the row's stream is active this step; the sentinel everywhere else."""
    starts, lengths = [], []
    for case in cases:
        key = key_of(case) if case.steps >= step else None
        active = key is not None and key in offsets
        starts.append(offsets[key] if active else 0)
        lengths.append(case.size if active else 0)
    columns = torch.arange(width, dtype=torch.int64, device=device).unsqueeze(0)
    start = torch.tensor(starts, dtype=torch.int64, device=device).unsqueeze(1)
    length = torch.tensor(lengths, dtype=torch.int64, device=device).unsqueeze(1)
    return torch.where(columns < length, start + columns, torch.full_like(columns, sentinel))


# ----------------------------------------------------------------------------- arenas
class _ParamArena:
    """The kernel parameters of one (dtype, width class), rows in bundle order, with their
    gradients, the same-precision reference values and (closed loop) the quadratic's constants."""

    def __init__(self, dtype: torch.dtype, width: int, cases: list[CaseSpec], wave_index: list[int],
                 device: torch.device, initial: dict, with_references: bool = True) -> None:
        self.dtype, self.width, self.cases, self.wave_index = dtype, width, cases, wave_index
        self.param = torch.zeros((len(cases), width), dtype=dtype, device=device)
        rows, starts = [], []
        for row, case in enumerate(cases):
            key = (case.seed, case.size, dtype)
            if key not in initial:
                # run_case's start: the float32 init cast on the CPU, then moved (once per key); the
                # float32 values made once per (seed, size), or taken from a spare's preparation.
                if (case.seed, case.size) not in initial:
                    initial[(case.seed, case.size)] = step_inputs.initial_parameters(case.seed, case.size)
                initial[key] = initial[(case.seed, case.size)].to(dtype).to(device)
            rows.append(self.param[row, :case.size])
            starts.append(initial[key])
        torch._foreach_copy_(rows, starts)  # one call for every row: the setup is ~10,000 small calls
        self.grad = torch.zeros_like(self.param)
        self.has_closed = any(c.gradient.kind == "closed" for c in cases)
        self.has_zeros = any(c.gradient.zero_fraction > 0 for c in cases)
        # The same-precision reference's values and gradients (none in a kernels-only wave).
        self.same = self.param.clone() if with_references else None
        self.same_grad = torch.zeros_like(self.param) if self.has_closed and with_references else self.grad
        self.r64_rows: torch.Tensor | None = None            # rows of the width class's float64 arena
        self.closed_rows = _row_flags(cases, device)
        self.h32 = self.c32 = self.h_same = self.c_same = None

    def view(self, tensor: torch.Tensor, row: int) -> torch.Tensor:
        return tensor[row, :self.cases[row].size]


def _row_flags(cases: list[CaseSpec], device: torch.device) -> torch.Tensor:
    """[rows, 1] bool: True on closed-loop rows."""
    return torch.tensor([[c.gradient.kind == "closed"] for c in cases], dtype=torch.bool, device=device)


def _closed_constants(cases: list[CaseSpec], width: int, cache: dict,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, width] float32 curvature and centre on the device (0 on padding and open-loop rows),
    each stream's constants made once on the CPU (as run_case makes them) and moved once."""
    h = torch.zeros((len(cases), width), dtype=torch.float32, device=device)
    c = torch.zeros_like(h)
    for row, case in enumerate(cases):
        if case.gradient.kind != "closed":
            continue
        key = (case.seed, case.size, case.gradient.scale)
        if key not in cache:  # GradientStream's constants, prepared by a spare or made now
            curvature, centre = step_inputs.closed_constants(case)
            cache[key] = (curvature.to(device), centre.to(device))
        h[row, :case.size].copy_(cache[key][0])
        c[row, :case.size].copy_(cache[key][1])
    return h, c


class _WidthClass:
    """One width class: its dtype arenas and the float64 reference arena over all of its rows."""

    def __init__(self, width: int, order: list[int], cases: list[CaseSpec], arenas: dict,
                 device: torch.device, closed_cache: dict, with_references: bool = True) -> None:
        self.width, self.order, self.arenas = width, order, arenas
        self.cases = [cases[i] for i in order]
        position = {index: row for row, index in enumerate(order)}
        # The float64 reference arena and its gradients: none in a kernels-only wave, where they
        # were the largest part of its setup (8 bytes an element, filled and never read).
        self.r64 = self.g64 = None
        if with_references:
            self.r64 = torch.zeros((len(order), width), dtype=torch.float64, device=device)
            self.g64 = torch.zeros_like(self.r64)
        for arena in arenas.values():
            arena.r64_rows = torch.tensor([position[i] for i in arena.wave_index], dtype=torch.int64, device=device)
            if with_references:
                self.r64.index_copy_(0, arena.r64_rows, arena.param.to(torch.float64))
        self.has_closed = any(c.gradient.kind == "closed" for c in self.cases)
        self.has_zeros = any(c.gradient.zero_fraction > 0 for c in self.cases)
        if self.has_closed:
            h32, c32 = _closed_constants(self.cases, width, closed_cache, device)
            self.closed_rows = _row_flags(self.cases, device)
            if with_references:
                self.h64 = h32.to(device=device, dtype=torch.float64)
                self.c64 = c32.to(device=device, dtype=torch.float64)
            for arena in arenas.values():
                arena.h32 = h32.index_select(0, arena.r64_rows)
                arena.c32 = c32.index_select(0, arena.r64_rows)
                if with_references:
                    arena.h_same, arena.c_same = arena.h32.to(arena.dtype), arena.c32.to(arena.dtype)
        self.index_cache: dict[tuple, dict] = {}


@dataclass
class _Bundle:
    """The rows of one reference key in one width class: one float64 reference over its
    contiguous rows of the float64 arena, and same-precision references per dtype."""

    width_class: _WidthClass
    rows64: slice
    ref64: object
    # (arena, its contiguous rows, a batched reference or None, per-case [(row, reference)])
    same: list[tuple[_ParamArena, slice, object | None, list]] = field(default_factory=list)


@dataclass
class _Observed:
    """One arena the observation digests: [rows, W] `tensor`, its od2 slot (0: parameters), the wave
    case of each row; for the fused op each row's length, else the valid mask and the salts."""

    tensor: torch.Tensor
    slot: int
    case_index: torch.Tensor
    lengths: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    salts: tuple[torch.Tensor, torch.Tensor] | None = None


class _StateArena:
    """One state slot (by slot number, dtype and width) of many cases."""

    def __init__(self, slot: int, buffer: torch.Tensor, lengths: list[int], wave_index: list[int]) -> None:
        self.slot, self.buffer, self.wave_index = slot, buffer, wave_index
        self.lengths = lengths



def _staged_step(family: FamilyAdapter, handle: object, step_fn: Callable[[int], None],
                 rows: list[tuple[str, torch.Tensor]]) -> Callable[[int], None]:
    """For library-owned state: the library's step, then what it updated (state_for_digest, read
    anew: a library may replace its tensors) copied into the case's digest arena rows. A layout
    that changes breaks the case here, and run_case, which needs no fixed layout, runs it."""
    def step_and_stage(step: int) -> None:
        step_fn(step)
        current = lifecycle.digest_states(family, handle)
        if [(n, t.dtype, t.numel()) for n, t in current] != [(n, r.dtype, r.numel()) for n, r in rows]:
            raise RuntimeError(f"adapter {lifecycle.adapter_name(family)}: state_for_digest changed its layout "
                               f"at step {step}; the fast engine needs a fixed one (run_case runs this case)")
        for (_, row), (_, tensor) in zip(rows, current):
            row.copy_(tensor.reshape(row.shape))
    return step_and_stage


# ----------------------------------------------------------------------------- one wave
# The profile (host seconds per phase) of the wave being set up, when one is asked for: run_waves
# sets it around make_wave, so the wave's setup reports its parts without a new argument.
_setup_profile: list[dict[str, float] | None] = [None]


def _timed(part: str, started: float) -> float:
    """Adds the seconds since `started` to the setup part `part` of the profile asked for; now."""
    now = time.perf_counter()
    profile = _setup_profile[0]
    if profile is not None:
        profile[part] = profile.get(part, 0.0) + now - started
    return now


class _Wave:
    # False in worker.engine.kernels_only's waves: no reference gradients, steps or metrics.
    with_references = True
    merge_padding_fraction = MERGE_PADDING_FRACTION

    def __init__(self, cases: list[CaseSpec], device: torch.device, families: Mapping[str, FamilyAdapter],
                 batch_low_precision_refs: bool, initial: dict, closed_cache: dict, *, bind: bool = True) -> None:
        """The wave set up: its arenas, every case opened with its states laid out, and (`bind`)
        each case's step bound to the loaded build. `bind=False` stops before the build is needed
        (a spare host's waves set up ahead, worker.engine.kernels_only.ReadyWaves): `bind_steps()`
        finishes it once the build is loaded."""
        self.cases, self.device, self.families = cases, device, families
        self.steps = max(c.steps for c in cases)
        self.broken: set[int] = set()
        started = time.perf_counter()
        # Gradient making starts now, in its threads, while the arenas are built; a wave set up
        # ahead (bind=False) leaves any prepared steps where they are until a run takes it, so a
        # run that does not keeps them for its own waves.
        self.inputs = StepInputs(cases, device)
        if bind:
            self.inputs.prefetch(1)
        started = _timed("setup_inputs", started)
        dtype_order = list(TORCH_DTYPES.values())
        merge = self.merge_padding_fraction
        classes = width_classes([c.size for c in cases], merge.get(device.type, merge["cpu"]))
        by_class: dict[int, list[int]] = defaultdict(list)
        for index, case in enumerate(cases):
            by_class[classes[_round_up(case.size)]].append(index)

        self.classes: list[_WidthClass] = []
        self.param_arenas: list[_ParamArena] = []
        self.bundles: list[_Bundle] = []
        for width, members in sorted(by_class.items()):
            # Row order: reference key (first appearance), then dtype, then battery order.
            key_rank: dict[tuple, int] = {}
            for index in members:
                key_rank.setdefault(reference_key(cases[index]), len(key_rank))
            order = sorted(members, key=lambda i: (key_rank[reference_key(cases[i])],
                                                   dtype_order.index(TORCH_DTYPES[cases[i].param_dtype]), i))
            arenas = {}
            for dtype in dtype_order:
                rows = [i for i in order if TORCH_DTYPES[cases[i].param_dtype] == dtype]
                if rows:
                    arenas[dtype] = _ParamArena(dtype, width, [cases[i] for i in rows], rows, device, initial,
                                                self.with_references)
                    self.param_arenas.append(arenas[dtype])
            started = _timed("setup_arenas", started)
            width_class = _WidthClass(width, order, cases, arenas, device, closed_cache, self.with_references)
            self.classes.append(width_class)
            started = _timed("setup_constants", started)
            self._make_bundles(width_class, batch_low_precision_refs)
            started = _timed("setup_bundles", started)
        self.gradient_graphs: dict[int, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        # Host seconds of graphed_gradients' parts (the run's profile: bench/warm_battery_profile.py)
        self.gradient_seconds = {"inputs": 0.0, "uploads": 0.0, "replay": 0.0, "capture": 0.0}
        self._open_kernels()
        started = _timed("setup_open", started)
        self._allocate_observation()
        started = _timed("setup_observation", started)
        if bind:
            self.bind_steps()
            _timed("setup_bind", started)

    def _make_bundles(self, width_class: _WidthClass, batch_low_precision_refs: bool) -> None:
        order, start = width_class.order, 0
        while start < len(order):
            key = reference_key(self.cases[order[start]])
            stop = start
            while stop < len(order) and reference_key(self.cases[order[stop]]) == key:
                stop += 1
            first = self.cases[order[start]]
            bundle = _Bundle(width_class, slice(start, stop), make_reference(first, width_class.r64[start:stop].clone()))
            members = set(order[start:stop])
            for arena in width_class.arenas.values():
                rows = [row for row, index in enumerate(arena.wave_index) if index in members]
                if not rows:
                    continue
                rows_slice = slice(rows[0], rows[-1] + 1)
                if arena.dtype in (torch.float32, torch.float64) or batch_low_precision_refs:
                    batched = make_reference(first, arena.same[rows_slice].clone())
                    bundle.same.append((arena, rows_slice, batched, []))
                else:
                    per_case = [(row, make_reference(arena.cases[row], arena.view(arena.same, row).clone()))
                                for row in rows]
                    bundle.same.append((arena, rows_slice, None, per_case))
            self.bundles.append(bundle)
            start = stop

    def _open_kernels(self) -> None:
        """Open every case through its family adapter (worker.engine.lifecycle) and lay out what
        each digests (state_for_digest) in state arenas by (slot, dtype, width). Handed-over
        states (`states_movable`) move into the arenas and the adapter steps the arena views from
        then on; library-owned states stay in the library and are copied into their arena rows
        after each step (_staged_step, made by bind_steps). A family declaring
        `fast_engine = False`, like a case whose open raises, is left to run_case. Every opened
        handle is closed by close_handles, also when this raises. Nothing here calls the build:
        the adapters' open, state_for_digest and adopt_states only make and hand over tensors."""
        self.bound: list[Callable[[int], None] | None] = [None] * len(self.cases)
        self.opened: list[tuple[FamilyAdapter, object]] = []
        self.prepared_calls = None
        try:
            self._open_states()
        except BaseException:
            self.close_handles(quiet=True)
            raise

    def bind_steps(self) -> None:
        """Bind each opened case's step (family.bind, on the build now loaded), and prepare the
        calls for C++ where they allow it (worker.engine.call_loop). A binding that raises leaves
        its case to run_case."""
        try:
            for index, (family, handle, rows) in self._to_bind.items():
                try:
                    step_fn = family.bind(handle, self._params[index], self._grads[index])
                    self.bound[index] = step_fn if family.states_movable else _staged_step(family, handle, step_fn, rows)
                except AdapterContractError:
                    raise
                except Exception:  # noqa: BLE001 - the run_case re-run reports it
                    self.broken.add(index)
        except BaseException:
            self.close_handles(quiet=True)
            raise
        self._to_bind = {}
        self.prepared_calls = call_loop.prepare(self.bound, [c.steps for c in self.cases], self.broken)

    def _open_states(self) -> None:
        params: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        family_of: dict[int, FamilyAdapter] = {}
        handle_of: dict[int, object] = {}
        states_of: dict[int, list[tuple[str, torch.Tensor]]] = {}
        by_slot: dict[tuple, list[tuple[int, str, torch.Tensor]]] = defaultdict(list)
        for arena in self.param_arenas:
            for row, case in enumerate(arena.cases):
                index = arena.wave_index[row]
                family = lifecycle.family_for(self.families, case)
                if not lifecycle.runs_on_fast_engine(family):
                    self.broken.add(index)  # the adapter says so: run_case runs it after the wave
                    continue
                params[index], grads[index] = arena.view(arena.param, row), arena.view(arena.grad, row)
                try:
                    handle = lifecycle.open_case(family, case, params[index], self.device)
                except AdapterContractError:
                    raise
                except Exception:  # noqa: BLE001 - the run_case re-run reports it
                    self.broken.add(index)
                    continue
                self.opened.append((family, handle))
                family_of[index], handle_of[index] = family, handle
                try:
                    states_of[index] = lifecycle.digest_states(family, handle)
                except AdapterContractError:
                    raise
                except Exception:  # noqa: BLE001 - the run_case re-run reports it
                    self.broken.add(index)
                    continue
                for slot, (name, tensor) in enumerate(states_of[index], start=1):
                    by_slot[(slot, str(tensor.dtype), _round_up(tensor.numel()))].append((index, name, tensor))
        lifecycle.check_unshared(family_of, states_of, self.cases)
        views: dict[int, dict[str, torch.Tensor]] = defaultdict(dict)
        self.state_arenas: list[_StateArena] = []
        for (slot, _dtype, width), entries in sorted(by_slot.items()):
            buffer = torch.zeros((len(entries), width), dtype=entries[0][2].dtype, device=self.device)
            rows = [buffer[row, :tensor.numel()] for row, (_, _, tensor) in enumerate(entries)]
            torch._foreach_copy_(rows, [tensor.reshape(-1) for _, _, tensor in entries])
            for row, (index, name, tensor) in zip(rows, entries):
                views[index][name] = row.view(tensor.shape)
            self.state_arenas.append(_StateArena(slot, buffer, [e[2].numel() for e in entries], [e[0] for e in entries]))
        # What bind_steps needs: each case's family, handle and state rows (the adapter's order)
        self._params, self._grads = params, grads
        self._to_bind: dict[int, tuple[FamilyAdapter, object, list[tuple[str, torch.Tensor]]]] = {}
        for index, named in states_of.items():
            family, handle = family_of[index], handle_of[index]
            rows = [(name, views[index][name]) for name, _ in named]
            try:
                if family.states_movable:
                    family.adopt_states(handle, dict(rows))
            except AdapterContractError:
                raise
            except Exception:  # noqa: BLE001 - the run_case re-run reports it
                self.broken.add(index)
                continue
            self._to_bind[index] = (family, handle, rows)
        # Quantized cases whose adapter names a codec: the quantization-aware reference beside
        # each, from its parameter before step 1 (worker.engine.quant_series, as run_case).
        self.quant: dict[int, tuple[QuantRefSeries, object]] = {}
        for index in self._to_bind if self.with_references else ():
            series = QuantRefSeries.for_case(self.cases[index], family_of[index], params[index])
            if series is not None:
                self.quant[index] = (series, handle_of[index])

    def close_handles(self, quiet: bool = False) -> None:
        """Close every handle this wave opened, once (lifecycle.close_all); `quiet` while an
        error is already on its way out, so a failing close() does not hide it."""
        opened, self.opened = getattr(self, "opened", []), []
        try:
            lifecycle.close_all(opened)
        except AdapterContractError:
            if not quiet:
                raise

    # -- one step: gradients, kernels, references, observation
    def _indices(self, width_class: _WidthClass, step: int, inputs: StepInputs) -> dict:
        value_offsets, mask_offsets, n_values, n_masks = inputs.layout(step)
        finished = tuple(i for i in width_class.order if self.cases[i].steps < step)
        key = (id(value_offsets), id(mask_offsets), finished)
        if key not in width_class.index_cache:
            entry = {}
            for dtype, arena in width_class.arenas.items():
                entry[("values", dtype)] = _gather_index(arena.cases, arena.width, value_offsets, n_values,
                                                         stream_key, step, self.device)
                if arena.has_zeros:
                    entry[("masks", dtype)] = _gather_index(arena.cases, arena.width, mask_offsets, n_masks,
                                                            mask_key, step, self.device)
            if width_class.has_zeros and width_class.has_closed:
                entry["masks64"] = _gather_index(width_class.cases, width_class.width, mask_offsets, n_masks,
                                                 mask_key, step, self.device)
            width_class.index_cache[key] = entry
        return width_class.index_cache[key]

    def gradients(self, step: int, inputs: StepInputs) -> None:
        """Every arena's kernel, same-precision and float64 gradients of `step`, as run_case's
        GradientStream makes them: open-loop values cast to the dtype, closed-loop h*(p - c) in
        float32 then cast, zeros applied last; references get the kernel's open-loop values
        upcast and their own h*(r - c)."""
        self._gradient_ops(step, inputs, *inputs.get(step))

    def graphed_gradients(self, step: int, inputs: StepInputs) -> None:
        """`gradients` on CUDA as one graph per step layout: the step's values and masks are copied
        into fixed device buffers and the same ops replay from there. The ops only overwrite the
        gradient arenas from the buffers, the parameters and constants, so the layout's first step
        runs them eagerly (as the capture's warm-up) and the graph serves the steps after it."""
        began = time.perf_counter()
        values, masks = inputs.get_host(step)
        taken = time.perf_counter()
        self.gradient_seconds["inputs"] += taken - began
        # One layout object per stretch of steps between case ends (StepInputs), so its identity
        # also says which cases have finished: no scan of the cases at every step.
        key = id(inputs.layout(step))
        held = self.gradient_graphs.get(key)
        if held is not None:
            graph, (value_buffer, mask_buffer) = held
            value_buffer.copy_(values, non_blocking=True)
            mask_buffer.copy_(masks, non_blocking=True)
            uploaded = time.perf_counter()
            graph.replay()
            self.gradient_seconds["uploads"] += uploaded - taken
            self.gradient_seconds["replay"] += time.perf_counter() - uploaded
            return
        buffers = (values.to(self.device, non_blocking=True), masks.to(self.device, non_blocking=True))
        self._capture_gradients(step, inputs, buffers)
        self.gradient_seconds["capture"] += time.perf_counter() - taken

    def _capture_gradients(self, step: int, inputs: StepInputs, buffers: tuple[torch.Tensor, torch.Tensor]) -> None:
        """`step`'s layout's gradient graph, reading the step's values and masks from `buffers`;
        the ops run once eagerly first (the capture's warm-up), which makes `step`'s gradients."""
        for width_class in self.classes:  # the gather indices: made here, outside the capture
            self._indices(width_class, step, inputs)
        graph = _captured(self.device, lambda: self._gradient_ops(step, inputs, *buffers))
        self.gradient_graphs[id(inputs.layout(step))] = (graph, buffers)

    def capture_gradients_ahead(self) -> None:
        """A wave set up ahead (bind=False) on CUDA: each step layout's gradient graph captured now,
        over zeroed buffers, so that the run's first step of a layout only copies its values in and
        replays, as every later step does. Nothing here depends on the build (the graph reads the
        gradient inputs, the parameters and the closed-loop constants, and writes the gradient
        arenas); the warm-up's gradients are overwritten by the first replay. Done in the run, the
        first step's eager warm-up and capture would be most of its gradient phase."""
        if self.device.type != "cuda" or not GRAPHED_GRADIENTS:
            return
        for step in range(1, self.steps + 1):
            layout = self.inputs.layout(step)
            if id(layout) in self.gradient_graphs:
                continue
            _, _, n_values, n_masks = layout
            self._capture_gradients(step, self.inputs, (
                torch.zeros(n_values + 1, dtype=torch.float32, device=self.device),
                torch.zeros(n_masks + 1, dtype=torch.bool, device=self.device)))

    def _gradient_ops(self, step: int, inputs: StepInputs, values: torch.Tensor, masks: torch.Tensor) -> None:
        for width_class in self.classes:
            index = self._indices(width_class, step, inputs)
            for dtype, arena in width_class.arenas.items():
                grad = values.take(index[("values", dtype)]).to(dtype)
                if arena.has_closed:
                    closed = (arena.h32 * (arena.param.to(torch.float32) - arena.c32)).to(dtype)
                    grad = torch.where(arena.closed_rows, closed, grad)
                mask = masks.take(index[("masks", dtype)]) if arena.has_zeros else None
                if mask is not None:
                    grad = grad.masked_fill(mask, 0.0)
                arena.grad.copy_(grad)
                if not self.with_references:
                    continue
                if arena.has_closed:
                    same = torch.where(arena.closed_rows, arena.h_same * (arena.same - arena.c_same), arena.grad)
                    if mask is not None:
                        same = same.masked_fill(mask, 0.0)
                    arena.same_grad.copy_(same)
                width_class.g64.index_copy_(0, arena.r64_rows, arena.grad.to(torch.float64))
            if width_class.has_closed and self.with_references:
                closed64 = width_class.h64 * (width_class.r64 - width_class.c64)
                if width_class.has_zeros:
                    closed64 = closed64.masked_fill(masks.take(index["masks64"]), 0.0)
                width_class.g64.copy_(torch.where(width_class.closed_rows, closed64, width_class.g64))

    def kernels(self, step: int) -> None:
        if self.prepared_calls is not None:  # the same calls from C++ (worker.engine.call_loop)
            for index, message in self.prepared_calls.run(step):
                error = RuntimeError(message)
                if context_lost(error, self.device):
                    raise error
                self.broken.add(index)
            return
        for index, bound in enumerate(self.bound):
            if bound is None or index in self.broken or self.cases[index].steps < step:
                continue
            try:
                bound(step)
            except Exception as error:  # noqa: BLE001
                if context_lost(error, self.device):
                    raise  # the kernel host reports it and restarts; a refused launch breaks only this case
                self.broken.add(index)

    def references(self, step: int) -> None:
        for bundle in self.bundles:
            width_class = bundle.width_class
            bundle.ref64.step(step, width_class.g64[bundle.rows64])
            width_class.r64[bundle.rows64].copy_(bundle.ref64.param.detach())
            for arena, rows, batched, per_case in bundle.same:
                if batched is not None:
                    batched.step(step, arena.same_grad[rows])
                    arena.same[rows].copy_(batched.param.detach())
                    continue
                for row, reference in per_case:
                    reference.step(step, arena.view(arena.same_grad, row))
                    arena.view(arena.same, row).copy_(reference.param.detach())

    def quantized(self, step: int) -> None:
        """The quantization-aware references' step and figures, per case (they read each case's
        states through its adapter, after the kernels' step)."""
        for index, (series, handle) in self.quant.items():
            if index not in self.broken and self.cases[index].steps >= step:
                series.observe(step, handle, self._params[index])

    def _allocate_observation(self) -> None:
        n, device = len(self.cases), self.device
        self.hist_f64 = torch.zeros((3, self.steps, n), dtype=torch.float64, device=device)
        self.hist_i64 = torch.zeros((3, self.steps, n), dtype=torch.int64, device=device)
        self.current_f64 = torch.zeros((3, n), dtype=torch.float64, device=device)
        self.current_i64 = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.step_index = torch.zeros((1,), dtype=torch.int64, device=device)
        # One pass per arena through optdrift_od2::observe_rows where it is loaded (worker.engine.od2_op),
        # else digest.py's torch ops over the arena (valid mask and salts made here): same bits.
        self.fused_observation = od2_op.fused_for(device)
        self.observed: list[_Observed] = []
        for arena in self.param_arenas:
            arena.case_index = torch.tensor(arena.wave_index, dtype=torch.int64, device=device)
            lengths = [c.size for c in arena.cases]
            valid = _valid(arena.param, lengths)
            arena.padding = ~valid
            self.observed.append(self._observed(arena.param, 0, lengths, arena.case_index, valid))
        for state in self.state_arenas:
            self.observed.append(self._observed(state.buffer, state.slot, state.lengths,
                                                torch.tensor(state.wave_index, dtype=torch.int64, device=device)))

    def _observed(self, tensor: torch.Tensor, slot: int, lengths: list[int], case_index: torch.Tensor,
                  valid: torch.Tensor | None = None) -> "_Observed":
        if self.fused_observation:
            return _Observed(tensor, slot, case_index, torch.tensor(lengths, dtype=torch.int64, device=self.device))
        valid = _valid(tensor, lengths) if valid is None else valid
        return _Observed(tensor, slot, case_index, valid=valid, salts=od2.salts(slot, tensor.shape[1], self.device))

    def observe(self) -> None:
        """This step's metrics and od2 lanes of every case into the histories (device only)."""
        current_f64, current_i64 = self.current_f64, self.current_i64
        current_i64.zero_()
        for width_class in self.classes if self.with_references else ():
            for arena in width_class.arenas.values():
                # Padding is masked out of the maxima: it is not always 0 in the references (a
                # float16 Adam's eps = 1e-8 rounds to 0, so 0/(0 + eps) makes padding NaN).
                padding = arena.padding
                p64 = arena.param.to(torch.float64)
                r64 = width_class.r64.index_select(0, arena.r64_rows)
                delta = (p64 - r64).abs()
                relative = (delta / r64.abs().clamp_min(RELATIVE_ERROR_FLOOR)).masked_fill(padding, 0.0)
                same = (p64 - arena.same.to(torch.float64)).abs().masked_fill(padding, 0.0)
                current_f64[0].index_copy_(0, arena.case_index, delta.masked_fill(padding, 0.0).amax(dim=1))
                current_f64[1].index_copy_(0, arena.case_index, relative.amax(dim=1))
                current_f64[2].index_copy_(0, arena.case_index, same.amax(dim=1))
        for observed in self.observed:
            tensor, case_index = observed.tensor, observed.case_index
            if observed.lengths is not None:
                od2_op.observe_rows(tensor, observed.lengths, observed.slot, case_index, current_i64)
                continue
            current_i64[0].index_add_(0, case_index, (~torch.isfinite(tensor)).sum(dim=1))
            lane_a, lane_b = od2.lanes(od2.element_bits(tensor), *observed.salts, observed.valid)
            current_i64[1].index_add_(0, case_index, lane_a)
            current_i64[2].index_add_(0, case_index, lane_b)
        self.hist_f64.index_copy_(1, self.step_index, current_f64.unsqueeze(1))
        self.hist_i64.index_copy_(1, self.step_index, current_i64.unsqueeze(1))
        self.step_index.add_(1)

    def _capture(self) -> torch.cuda.CUDAGraph:
        # The warm-up observes this step and advances the step counter; undone here, then the
        # graph's replay observes it once more, as every later step's replay will.
        graph = _captured(self.device, self.observe, undo=lambda: self.step_index.sub_(1))
        graph.replay()
        return graph

    def run(self, use_graph: bool, profile: dict[str, float] | None = None) -> dict[int, CaseResult]:
        """Results of the cases that ran through; broken ones are left to the caller.
        `profile` accumulates the host seconds spent per phase (launches are asynchronous on
        CUDA, so this is where the Python time goes, not GPU time)."""
        started = time.perf_counter()
        inputs = self.inputs
        graph = None
        phases = defaultdict(float)
        try:
            wait = _synchronizer(self.device)
            for step in range(1, self.steps + 1):
                t0 = wait()
                if use_graph and GRAPHED_GRADIENTS:
                    self.graphed_gradients(step, inputs)
                else:
                    self.gradients(step, inputs)
                t1 = wait()
                self.kernels(step)
                t2 = wait()
                self.references(step)
                t3 = wait()
                self.quantized(step)
                t3q = wait()
                if not use_graph:
                    self.observe()
                elif graph is None:
                    graph = self._capture()
                else:
                    graph.replay()
                t4 = wait()
                phases["gradients"] += t1 - t0
                phases["kernels"] += t2 - t1
                phases["references"] += t3 - t2
                phases["quantized references"] += t3q - t3
                phases["observe"] += t4 - t3q
        finally:
            inputs.close()
        t5 = time.perf_counter()
        results = self._results(started)
        phases["results (incl. waiting for the GPU)"] += time.perf_counter() - t5
        if profile is not None:
            for name, value in phases.items():
                profile[name] = profile.get(name, 0.0) + value
            for name, value in self.gradient_seconds.items():  # the graphed gradients' parts
                profile[f"gradients_{name}"] = profile.get(f"gradients_{name}", 0.0) + value
        return results

    def _results(self, started: float) -> dict[int, CaseResult]:
        f64, i64 = self.hist_f64.cpu(), self.hist_i64.cpu()
        digests = od2.format_digest_series(i64[1].T, i64[2].T)  # [case][step], lanes 1 and 2
        seconds = (time.perf_counter() - started) / len(self.cases)
        return {index: CaseResult(case=case, status="ok", duration_s=seconds,
                                  trajectory=self._trajectory(index, case.steps, f64, i64, digests[index][:case.steps]))
                for index, case in enumerate(self.cases) if index not in self.broken}

    def _trajectory(self, index: int, steps: int, f64: torch.Tensor, i64: torch.Tensor,
                    digests: list[str]) -> Trajectory:
        quant_steps, quant_abs = self.quant[index][0].series() if index in self.quant else (None, None)
        return Trajectory(ref64_max_abs=f64[0, :steps, index].tolist(), ref64_max_rel=f64[1, :steps, index].tolist(),
                          same_precision_max_abs=f64[2, :steps, index].tolist(),
                          nonfinite_count=i64[0, :steps, index].tolist(), digests=digests,
                          quant_ref_steps=quant_steps, quant_ref_max_abs=quant_abs)


def _captured(device: torch.device, ops: Callable[[], None], undo: Callable[[], None] | None = None,
              ) -> torch.cuda.CUDAGraph:
    """`ops` run once on a side stream (the warm-up torch's capture rules ask for), `undo` after
    it, then `ops` captured into a graph that is returned without being replayed.

    torch.cuda.graph's context would also wait for the device and empty the device's and the
    pinned host memory's caches before each capture (emptying the pinned cache frees and later
    re-pins host memory, a slow driver call), and those caches hold the steps' pinned gradient inputs. So the capture is
    begun and ended here directly, on the side stream, after it caught up with the current one."""
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        ops()
    current.wait_stream(side)
    if undo is not None:
        undo()
    graph = torch.cuda.CUDAGraph()
    side.wait_stream(current)
    with torch.cuda.stream(side):
        # thread_local: the gradient threads (StepInputs) may be pinning host memory for later
        # steps right now; in the default global mode any such call from another thread
        # invalidates the capture (seen on the H200 once setup got fast enough to overlap it).
        graph.capture_begin(capture_error_mode=CAPTURE_ERROR_MODE)
        try:
            ops()
        finally:
            graph.capture_end()
    current.wait_stream(side)
    return graph


def _synchronizer(device: torch.device) -> Callable[[], float]:
    """The clock read at a phase boundary; with SYNCHRONIZE_PHASES, after the device caught up."""
    if not (SYNCHRONIZE_PHASES and device.type == "cuda"):
        return time.perf_counter

    def wait() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return wait


def _valid(buffer: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[rows, width] bool: True on each row's first `length` elements (the od2 lanes' mask)."""
    columns = torch.arange(buffer.shape[1], device=buffer.device)
    return columns.unsqueeze(0) < torch.tensor(lengths, device=buffer.device).unsqueeze(1)


# ----------------------------------------------------------------------------- the battery
def run_cases_fast(cases: list[CaseSpec], device: torch.device, *, use_graphs: bool | None = None,
                   on_result=None, max_wave_elements: int | None = None,  # noqa: ANN001
                   families: Mapping[str, FamilyAdapter] | None = None,
                   batch_low_precision_refs: bool | None = None,
                   profile: dict[str, float] | None = None) -> list[CaseResult]:
    """Every case's result, in the order of `cases`, equal to run_case's bit for bit.

    `use_graphs` defaults to True on CUDA. `on_result(index, result)` is called for each case as
    its wave finishes (waves finish in plan order, not battery order). `families`: the project
    adapter's family table, as run_case takes it (bundled by default). 16-bit same-precision
    references are batched on CUDA and run per case on the CPU (see the module docstring).
    `profile`, when given, receives host seconds per phase (setup, gradients, kernels, ...)."""
    device = torch.device(device)
    use_graphs = device.type == "cuda" if use_graphs is None else use_graphs
    if batch_low_precision_refs is None:
        batch_low_precision_refs = device.type == "cuda"
    if max_wave_elements is None:
        max_wave_elements = DEFAULT_MAX_WAVE_ELEMENTS.get(device.type, DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
    families = bundled_families() if families is None else families
    unknown = sorted({c.family for c in cases} - set(families))
    if unknown:
        raise ValueError(f"kernel families {unknown} have no adapter (known: {sorted(families)})")
    return run_waves(cases, max_wave_elements, use_graphs, on_result, profile,
                     make_wave=lambda indices, wave_cases, initial, closed_cache: _Wave(
                         wave_cases, device, families, batch_low_precision_refs, initial, closed_cache),
                     run_alone=lambda index, case: _run_alone(case, device, families))


def run_waves(cases: list[CaseSpec], max_wave_elements: int, use_graphs: bool, on_result, profile,  # noqa: ANN001
              *, make_wave: Callable, run_alone: Callable[[int, CaseSpec], CaseResult | None]) -> list[CaseResult | None]:
    """The wave loop of run_cases_fast and of worker.engine.kernels_only: each planned wave made by
    `make_wave(indices, wave_cases, initial, closed_cache)` and run; a case it did not finish goes to
    `run_alone(index, case)` (None: left unanswered)."""
    results: list[CaseResult | None] = [None] * len(cases)
    initial: dict = {}
    closed_cache: dict = {}
    # Layout cases (one optimizer over several tensors) run alone, through the group lifecycle of
    # run_case / run_params, after the waves: a wave's arenas hold one tensor per case.
    for indices in plan_wave_indices(cases, max_wave_elements):
        wave_cases = [cases[i] for i in indices]
        setup_started = time.perf_counter()
        _setup_profile[0] = profile  # the wave adds its setup's parts (_Wave._timed)
        try:
            wave = make_wave(indices, wave_cases, initial, closed_cache)
        finally:
            _setup_profile[0] = None
        if profile is not None:
            profile["setup"] = profile.get("setup", 0.0) + time.perf_counter() - setup_started
        try:
            finished = wave.run(use_graphs, profile)
        finally:
            closing = time.perf_counter()
            wave.close_handles()
            if profile is not None:
                profile["close"] = profile.get("close", 0.0) + time.perf_counter() - closing
        for position, index in enumerate(indices):
            result = finished.get(position)
            if result is None:
                result = run_alone(index, wave_cases[position])
            results[index] = result
            if on_result and result is not None:
                on_result(index, result)
        del wave
    for index, case in enumerate(cases):
        if case.layout is not None:
            results[index] = result = run_alone(index, case)
            if on_result and result is not None:
                on_result(index, result)
    return results


def _run_alone(case: CaseSpec, device: torch.device, families) -> CaseResult:  # noqa: ANN001
    try:
        return run_case(case, device, families=families)
    except Exception as error:  # noqa: BLE001 - the kernel host's rule: a kernel error breaks its case
        return CaseResult(case=case, status="broken", message=f"{type(error).__name__}: {error}")


def bundle_count(cases: list[CaseSpec], device_type: str = "cuda") -> int:
    """How many bundles (float64 reference objects) the cases make in one wave."""
    classes = width_classes([c.size for c in cases], MERGE_PADDING_FRACTION.get(device_type, MERGE_PADDING_FRACTION["cpu"]))
    return len({(classes[_round_up(c.size)], reference_key(c)) for c in cases})
