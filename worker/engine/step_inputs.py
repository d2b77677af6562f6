"""The fast engine's gradient inputs: each open-loop stream's values and each zero mask, per step,
made with gradients.py's own functions, in threads, ahead of the step that needs it.

Making them is CPU work that does not depend on the kernels under test: for the standard battery's
100-step wave 1.13M values and 157K mask elements a step (470 MB for the wave). In a run it competes
with the step loop and the wave's setup for the host's cores. So a spare kernel host
(worker.engine.host_reserve), which waits for its build with nothing to do, can make them before
its run comes (`prepare`): the parent tells it which cases to expect (those of the worker's last
run), it plans their waves as the engine will, and keeps each step's tensors until a wave with the
same layout asks for them. A wave whose layout was not prepared makes its own, as before; the
values are the same either way (the same function on the same inputs; `tests/worker/engine/test_step_inputs.py`).

Step t's layout: the values of the streams active at t back to back, then one 0.0 (where padding,
closed-loop rows and finished cases point); the masks likewise, then one False.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from service.core.results import CaseSpec
from worker.engine import gradients
from worker.engine.gradients import GradientStream, zero_mask

PREFETCH_STEPS = 32  # steps of gradients made ahead in a run (4.7 MB a step for the standard battery)
# At most this many bytes of prepared steps are kept per process (`prepare`): the standard battery
# needs ~470 MB; a larger battery gets its first steps prepared and makes the rest as it runs.
PREPARE_MAX_BYTES = 1 << 30

_pool_lock = threading.Lock()
_pools: dict[str, ThreadPoolExecutor] = {}  # "run": a wave's own threads; "idle": `prepare`'s, at nice 19
_prepared_lock = threading.Lock()
_prepared: dict[tuple, Future] = {}  # (a step's content key, step) -> its (values, masks)
_initial: dict[tuple[int, int], Future] = {}  # (seed, size) -> its float32 initial parameters (CPU)
_closed: dict[tuple, Future] = {}  # (seed, size, spec) -> a closed-loop stream's float32 (curvature, centre) (CPU)


def lowest_priority() -> None:
    """This thread at nice 19 (Linux sets niceness per thread): a spare prepares beside a running
    battery (the worker starts the next spares as a run starts), which must not wait on it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or refused: the threads run at normal priority
        pass


def _threads(kind: str = "run") -> ThreadPoolExecutor:
    """The process's input threads of `kind`. Making a step's values is CPU work whose torch ops
    release the GIL: up to 15 threads, one core left to the step loop. With the kernel calls made
    from C++ the loop outpaces fewer threads and would wait on them for each step's values."""
    with _pool_lock:
        if kind not in _pools:
            _pools[kind] = ThreadPoolExecutor(max_workers=max(1, min(15, (os.cpu_count() or 2) - 1)),
                                              thread_name_prefix=f"optdrift-inputs-{kind}",
                                              initializer=lowest_priority if kind == "idle" else None)
        return _pools[kind]


def stream_key(case: CaseSpec) -> tuple | None:
    return (case.seed, case.size, case.gradient.scale) if case.gradient.kind == "open" else None


def mask_key(case: CaseSpec) -> tuple | None:
    return (case.seed, case.size, case.gradient.zero_fraction) if case.gradient.zero_fraction > 0 else None


def _offsets(keys: list[tuple]) -> dict[tuple, int]:
    """Start of each (seed, size, ...) stream when they are laid back to back."""
    offsets, at = {}, 0
    for key in keys:
        offsets[key] = at
        at += key[1]
    return offsets


class StepInputs:
    """One wave's open-loop gradient values and zero masks: each (stream, step) made once, uploaded
    as one float32 and one bool tensor per step (pinned first on CUDA)."""

    def __init__(self, cases: list[CaseSpec], device: torch.device) -> None:
        self.device = device
        self.steps = max(c.steps for c in cases)
        self._specs = {}
        for case in cases:
            if case.gradient.kind == "open":
                self._specs.setdefault(stream_key(case), case.gradient)
        self._layouts: dict[int, tuple] = {}
        self._contents: dict[int, tuple] = {}
        # The active cases change only after some case's last step: one layout per stretch of steps
        # (a wave's cases share their step count, so usually one layout for the whole wave).
        first = 1
        for last in sorted({c.steps for c in cases}):
            active = [c for c in cases if c.steps >= last]
            streams = sorted({stream_key(c) for c in active} - {None})
            masks = sorted({mask_key(c) for c in active} - {None})
            layout = (_offsets(streams), _offsets(masks), sum(s[1] for s in streams), sum(m[1] for m in masks))
            # Everything a step's tensors depend on besides the step: each stream's whole spec (its
            # key holds the scale only), the masks, and whether they are pinned.
            content = (device.type == "cuda", tuple((key, repr(self._specs[key])) for key in streams), tuple(masks))
            for step in range(first, last + 1):
                self._layouts[step], self._contents[step] = layout, content
            first = last + 1
        self._futures: dict[int, Future] = {}

    def layout(self, step: int) -> tuple[dict, dict, int, int]:
        """(value offsets, mask offsets, number of values, number of mask elements) of `step`."""
        return self._layouts[step]

    def step_bytes(self, step: int) -> int:
        _, _, n_values, n_masks = self._layouts[step]
        return 4 * (n_values + 1) + n_masks + 1

    def _make(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        value_offsets, mask_offsets, n_values, n_masks = self._layouts[step]
        values = torch.zeros(n_values + 1, dtype=torch.float32)
        for key, offset in value_offsets.items():
            seed, size, _scale = key
            stream = GradientStream(self._specs[key], seed=seed, size=size, device="cpu", grad_dtype=torch.float32)
            values[offset:offset + size] = stream._open_values(step)
        masks = torch.zeros(n_masks + 1, dtype=torch.bool)
        for (seed, size, fraction), offset in mask_offsets.items():
            masks[offset:offset + size] = zero_mask(seed, step, size, fraction)
        if self.device.type == "cuda":
            try:  # page-locked, so the upload is asynchronous
                values, masks = values.pin_memory(), masks.pin_memory()
            except RuntimeError:  # refused (a limit on locked memory): pageable, the same values
                pass
        return values, masks

    def prefetch(self, step: int) -> None:
        """Queue steps `step`.. (PREFETCH_STEPS of them) that are not queued yet: a prepared one
        is taken over, the others are made in the input threads."""
        for ahead in range(step, min(self.steps, step + PREFETCH_STEPS) + 1):
            if ahead not in self._futures:
                self._futures[ahead] = (_take_prepared((self._contents[ahead], ahead))
                                        or _threads().submit(self._make, ahead))

    def get_host(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s values and masks in host memory (and the next steps queued)."""
        self.prefetch(step)
        return self._futures.pop(step).result()

    def get(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s values and masks on the device (and the next steps queued)."""
        values, masks = self.get_host(step)
        return values.to(self.device, non_blocking=True), masks.to(self.device, non_blocking=True)

    def close(self) -> None:
        """Cancel the steps not started; wait for those being made (no input work outlives its wave)."""
        running = [future for future in self._futures.values() if not future.cancel()]
        self._futures.clear()
        wait(running)


_taken = [0]  # prepared steps taken by waves since the process started


def _take_prepared(key: tuple) -> Future | None:
    with _prepared_lock:
        future = _prepared.pop(key, None)
        _taken[0] += future is not None
        return future


def taken() -> int:
    """How many prepared steps waves have taken in this process."""
    return _taken[0]


def initial_parameters(seed: int, size: int) -> torch.Tensor:
    """gradients.initial_parameters(seed, size), prepared or made now. Shared: read it, never write it."""
    with _prepared_lock:
        future = _initial.get((seed, size))
    return future.result() if future is not None else gradients.initial_parameters(seed, size)


def _closed_key(case: CaseSpec) -> tuple:
    return (case.seed, case.size, repr(case.gradient))


def _make_closed(case: CaseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    stream = GradientStream(case.gradient, seed=case.seed, size=case.size, device="cpu", grad_dtype=torch.float32)
    return stream.curvature32, stream.centre32


def closed_constants(case: CaseSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """A closed-loop case's float32 curvature and centre on the CPU (GradientStream's), prepared or
    made now. Shared: read them, never write them."""
    with _prepared_lock:
        future = _closed.get(_closed_key(case))
    return future.result() if future is not None else _make_closed(case)


def prepare(cases: list[CaseSpec], device: torch.device, max_wave_elements: int,
            max_bytes: int = PREPARE_MAX_BYTES) -> tuple[int, Future | None]:
    """Start making the initial parameters, closed-loop constants and gradient inputs of `cases`' waves (planned as the fast engine plans them,
    worker.engine.wave_plan.plan_waves), step by step, while their total stays within `max_bytes`.
    The (seed, size) initial parameters and each closed-loop stream's constants come first (kept
    until `discard_prepared`: each serves every dtype and wave). Returns (the tensors queued, a future done when they all are made; None when
    none were)."""
    from worker.engine.wave_plan import plan_wave_indices

    # Only cases a wave holds: a layout case runs alone (run_case), making its own inputs.
    cases = [case for case in cases if case.layout is None]
    queued: list[Future] = []
    spent = 0
    # The initial parameters and closed-loop constants first: a wave's setup needs them before its first step.
    for seed, size in dict.fromkeys((c.seed, c.size) for c in cases):
        spent += 4 * size
        with _prepared_lock:
            if spent <= max_bytes and (seed, size) not in _initial:
                _initial[(seed, size)] = _threads("idle").submit(gradients.initial_parameters, seed, size)
                queued.append(_initial[(seed, size)])
    for key, case in {_closed_key(c): c for c in cases if c.gradient.kind == "closed"}.items():
        spent += 8 * case.size
        with _prepared_lock:
            if spent <= max_bytes and key not in _closed:
                _closed[key] = _threads("idle").submit(_make_closed, case)
                queued.append(_closed[key])
    waves = [StepInputs([cases[i] for i in indices], device) for indices in plan_wave_indices(cases, max_wave_elements)]
    for inputs, step in ((inputs, step) for inputs in waves for step in range(1, inputs.steps + 1)):
        spent += inputs.step_bytes(step)
        if spent > max_bytes:
            break
        key = (inputs._contents[step], step)
        with _prepared_lock:
            if key not in _prepared:
                _prepared[key] = _threads("idle").submit(inputs._make, step)
                queued.append(_prepared[key])
    if not queued:
        return 0, None
    done: Future = Future()
    left = [len(queued)]
    counting = threading.Lock()

    def finished(_: Future) -> None:
        with counting:
            left[0] -= 1
            if left[0] == 0:
                done.set_result(len(queued))
    for future in queued:
        future.add_done_callback(finished)
    return len(queued), done


def discard_prepared() -> int:
    """Drop every prepared step not taken (their memory goes); how many there were."""
    with _prepared_lock:
        left = list(_prepared.values())
        _prepared.clear()
        _initial.clear()
        _closed.clear()
    for future in left:
        future.cancel()
    return len(left)
