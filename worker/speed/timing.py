"""Time each optimizer kernel of the loaded build, inside the kernel host (worker/engine/host/).

One sample is one optimizer step through the project's adapter, as the fast engine calls it: the
case opened once (`open`), its `bind(handle, param, grad)` step function called per sample, the
case closed after (worker/adapters/base.py). On CUDA
each sample is bracketed by CUDA events on the current stream, after a write of FLUSH_BYTES that
evicts the L2 cache (so every step reads its tensors from HBM, as a step over a real model's
parameters does) and that also keeps the GPU busy while Python launches the step, so the events
time the kernel, not the launch. On the CPU (for tests and CPU workers) each sample is a
perf_counter interval around the step.

Beside every kernel, a device-to-device copy of the same number of bytes the step moves is timed
the same way: the card's copy bandwidth in the same run, so `copy_fraction` = copy time / kernel
time is the kernel's bandwidth as a fraction of what this card, right now, can copy.

Bytes moved is the nominal minimum traffic of one step: the parameter read and written, the
gradient read, every state tensor read and written.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from service.core.results import CaseSpec, GradientStreamSpec
from worker.engine import cuda_errors

DEFAULT_SIZES = (1 << 20, 1 << 26)
DEFAULT_DTYPES = ("float32", "bfloat16")
# At least twice the largest L2 of current cards (H200: 50 MB, B200: 126 MB... 2x is what matters).
FLUSH_BYTES = 256 * 1024**2
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class TimingPlan:
    """What to time and how often. `budget_s`: the whole timing's wall-clock cap; kernels not
    reached in time are reported `not timed`, never half-timed."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    families: tuple[str, ...] | None = None  # None: every family the adapter has
    optimizers: tuple[str, ...] | None = None  # None: every optimizer the battery knows
    warmup: int = 5
    repeats: int = 50
    budget_s: float = 120.0

    @classmethod
    def from_request(cls, request: Mapping) -> "TimingPlan":
        plan = request.get("plan") or {}
        known = {name for name in cls.__dataclass_fields__}
        unknown = set(plan) - known
        if unknown:
            raise ValueError(f"time_kernels: unknown plan field(s) {sorted(unknown)}; known: {sorted(known)}")
        converted = {key: (tuple(value) if isinstance(value, list) else value) for key, value in plan.items()}
        made = cls(**converted)
        if made.repeats < 5 or made.warmup < 0:
            raise ValueError(f"time_kernels: repeats must be >= 5 and warmup >= 0 (got {made.repeats}, {made.warmup})")
        bad = [size for size in made.sizes if not isinstance(size, int) or size <= 0]
        if bad or set(made.dtypes) - set(_DTYPES):
            raise ValueError(f"time_kernels: sizes must be positive integers and dtypes in {sorted(_DTYPES)}; "
                             f"got sizes {list(made.sizes)}, dtypes {list(made.dtypes)}")
        return made


@dataclass
class KernelTiming:
    kernel: str  # "<optimizer>/<family>"
    optimizer: str
    family: str
    param_dtype: str
    size: int
    samples_s: list[float] = field(default_factory=list)
    bytes_moved: int = 0
    copy_samples_s: list[float] = field(default_factory=list)
    error: str | None = None

    def as_json(self) -> dict:
        return asdict(self)


class Clock:
    """Times `fn()` `repeats` times after `warmup` calls: CUDA events on a GPU, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self._flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def samples(self, fn: Callable[[], None], *, warmup: int, repeats: int) -> list[float]:
        for _ in range(warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(repeats):
                started = time.perf_counter()
                fn()
                times.append(time.perf_counter() - started)
            return times
        torch.cuda.synchronize(self.device)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for start, end in zip(starts, ends):
            self._flush.zero_()  # evict L2; the GPU works on it while Python launches fn
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]


def _timing_case(optimizer: str, family: str, param_dtype: str, size: int) -> CaseSpec:
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS, make_case

    return make_case(optimizer=optimizer, family=family, param_dtype=param_dtype,
                     hyper=dict(OPTIMIZER_HYPER_DEFAULTS[optimizer]), gradient=GradientStreamSpec(),
                     seed=0, size=size, steps=1)


def time_one(clock: Clock, families: Mapping, timing: KernelTiming, plan: TimingPlan) -> None:
    """Fill `timing`'s samples: the kernel, then a copy of the bytes it moves. The kernel runs
    through the adapter's case lifecycle (worker/adapters/base.py: open, bind or step, close)."""
    from worker.engine.lifecycle import family_for

    device = clock.device
    case = _timing_case(timing.optimizer, timing.family, timing.param_dtype, timing.size)
    family = family_for(families, case)
    generator = torch.Generator(device=device).manual_seed(0)
    dtype = _DTYPES[timing.param_dtype]
    param = torch.randn(timing.size, generator=generator, device=device).to(dtype)
    grad = (torch.randn(timing.size, generator=generator, device=device) * 1e-2).to(dtype)
    handle = family.open(case, param, device)
    try:
        step_fn = family.bind(handle, param, grad)
        counter = iter(range(1, 1 << 62))
        timing.samples_s = clock.samples(lambda: step_fn(next(counter)), warmup=plan.warmup, repeats=plan.repeats)
        states = family.state_for_digest(handle)
        tensors = states.values() if isinstance(states, Mapping) else states
        state_bytes = sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    finally:
        family.close(handle)
    timing.bytes_moved = 2 * param.nbytes + grad.nbytes + 2 * state_bytes
    del param, grad, handle
    half = max(1, timing.bytes_moved // 2)  # a copy reads and writes: half the bytes each way
    source = torch.empty(half, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    timing.copy_samples_s = clock.samples(lambda: target.copy_(source), warmup=plan.warmup, repeats=plan.repeats)


def plan_targets(plan: TimingPlan, family_names: Sequence[str]) -> list[KernelTiming]:
    from worker.battery import OPTIMIZER_HYPER_DEFAULTS

    families = [f for f in family_names if plan.families is None or f in plan.families]
    optimizers = list(plan.optimizers or OPTIMIZER_HYPER_DEFAULTS)
    return [KernelTiming(kernel=f"{optimizer}/{family}", optimizer=optimizer, family=family,
                         param_dtype=dtype, size=size)
            for size in plan.sizes for family in families for optimizer in optimizers for dtype in plan.dtypes]


def time_kernels(plan: TimingPlan, device: torch.device, adapter, families: Mapping) -> dict:  # noqa: ANN001
    """Every kernel of the plan the adapter can run here, within `plan.budget_s`. Returns the
    `time_kernels` answer of the kernel host: {"timings": [...], "not_applicable": n,
    "not_timed": n, "seconds": s, "device": name}."""
    started = time.monotonic()
    clock = Clock(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    timings, not_applicable, not_timed = [], 0, 0
    context_lost = False  # after a sticky CUDA error nothing more can run in this process
    for timing in plan_targets(plan, list(families)):
        case = _timing_case(timing.optimizer, timing.family, timing.param_dtype, timing.size)
        if adapter.unsupported(case, device):
            not_applicable += 1
            continue
        if context_lost or time.monotonic() - started > plan.budget_s:
            not_timed += 1
            continue
        try:
            time_one(clock, families, timing, plan)
        except Exception as error:  # noqa: BLE001 - this kernel's failure, reported with it
            timing.error = f"{type(error).__name__}: {error}"[:2000]
            timing.samples_s, timing.copy_samples_s = [], []
            context_lost = cuda_errors.context_lost(error, device)
        timings.append(timing.as_json())
        if device.type == "cuda":
            torch.cuda.empty_cache()  # 2^26-element tensors of one kernel must not pile up
    return {"timings": timings, "not_applicable": not_applicable, "not_timed": not_timed,
            "seconds": time.monotonic() - started, "device": name, "restart": context_lost}


def answer(request: Mapping, device: torch.device, adapter, families: Mapping) -> dict:  # noqa: ANN001
    """The host's answer to {"op": "time_kernels", "plan": {...}}: the timings or {"error": ...}."""
    try:
        plan = TimingPlan.from_request(request)
    except (TypeError, ValueError) as error:
        return {"error": str(error)}
    return time_kernels(plan, device, adapter, families)
