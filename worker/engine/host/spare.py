"""What a spare kernel host prepares while it waits for its build (worker.engine.host_reserve).

Given the cases its parent expects (`--prepare-inputs`), it makes their initial parameters and
gradient inputs in threads (worker.engine.step_inputs) and sets their kernels-only waves up
(worker.engine.kernels_only.ReadyWaves). Its first run_many takes or drops them. Preparing is an
optimisation, never a failure: what cannot be prepared is said on stderr and the run makes its own.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from service.core.results import CaseSpec

# "cases" (the expected cases as the parent wrote them, JSON), "thread" (setting their waves up),
# "waves" (a worker.engine.kernels_only.ReadyWaves, once made).
_READY: dict = {}
# Set up ahead only up to this many parameter elements: the waves hold their arenas, gradients and
# states on the device while the spare waits (the standard battery: 29M elements, ~0.5 GB).
READY_MAX_ELEMENTS = 1 << 26


def prepare_inputs(expected: Path, device, mark: Callable[[str], None], *, ready_waves: bool = True) -> None:  # noqa: ANN001
    """Start making the initial parameters and gradient inputs of the cases in `expected` (a JSON
    list) in threads, and (`ready_waves`) set up their kernels-only waves. Marks "inputs queued",
    then "inputs prepared" when they are all made (shown in the ready line if that was before it)."""
    from worker.engine import fast, step_inputs

    try:
        raw = json.loads(expected.read_text())
        cases = [CaseSpec.model_validate(c) for c in raw]
        limit = fast.DEFAULT_MAX_WAVE_ELEMENTS.get(device.type, fast.DEFAULT_MAX_WAVE_ELEMENTS["cpu"])
        queued, done = step_inputs.prepare(cases, device, limit)
    except Exception as error:  # noqa: BLE001 - preparing is an optimisation, never a failure
        print(f"inputs not prepared: {type(error).__name__}: {error}", file=sys.stderr)
        return
    mark("inputs queued")
    if done is not None:
        done.add_done_callback(lambda _: mark("inputs prepared"))
    if ready_waves and cases and sum(c.size for c in cases) <= READY_MAX_ELEMENTS:
        thread = threading.Thread(target=_set_up_ready_waves, args=(cases, device, mark),
                                  name="optdrift-ready-waves", daemon=True)
        _READY.update(cases=raw, thread=thread)
        thread.start()


def _set_up_ready_waves(cases: list[CaseSpec], device, mark: Callable[[str], None]) -> None:  # noqa: ANN001
    """The expected cases' kernels-only waves, set up with the bundled families before any build
    is loaded (worker.engine.kernels_only.ReadyWaves), at the lowest priority: a spare waits beside
    a running battery. Marks "waves ready"; a failure is said on stderr and the run sets its
    waves up itself."""
    import torch

    from worker.engine import step_inputs
    from worker.engine.kernels_only import ReadyWaves
    from worker.engine.trajectory import bundled_families

    step_inputs.lowest_priority()
    try:
        if device.type == "cuda" and device.index is not None:
            torch.cuda.set_device(device)
        _READY["waves"] = ReadyWaves(cases, device, bundled_families())
    except Exception as error:  # noqa: BLE001 - an optimisation, never a failure
        print(f"waves not set up ahead: {type(error).__name__}: {error}", file=sys.stderr)
        return
    mark("waves ready")


def take_ready_waves(request: dict, families):  # noqa: ANN001, ANN201
    """The waves set up ahead, when this request brings exactly the cases they were made for and
    the loaded adapter's families are those they were opened with; None otherwise. Either way
    nothing is left for a later request: a spare's waves serve its first run_many only."""
    if not _READY:
        return None
    thread, expected = _READY.pop("thread"), _READY.pop("cases")
    thread.join()  # mostly done long before the build comes; else finishing beats starting over
    ready = _READY.pop("waves", None)
    if ready is not None and (request["cases"] != expected or ready.families is not families):
        ready.close()
        return None
    return ready
