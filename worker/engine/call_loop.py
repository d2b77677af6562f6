"""A wave's kernel calls made from C++: the harness library's `PreparedCalls` (worker/engine/
harness_csrc/call_loop.cpp) over the cases' bound ops.

The fast engine calls each case's kernel once per step through its project's op. For the bundled
kernels that op call is a kernel_ops.BoundOp; from Python each such call parses its arguments
against the op's schema again, which on the H200 host cost more than the launch itself
(bench/op_call_cost.py, docs/PERFORMANCE.md round 8). PreparedCalls converts and checks each
case's arguments once and then makes the same calls, in the same order, through the same
dispatcher entry, one per case and step: nothing is batched and the kernel sees exactly the call
its project's API makes. Calls of any other kind (a project's Python function, a library-owned
state's copy-back) stay in Python. `OPTDRIFT_CALL_LOOP=0` keeps every call in Python.

Side streams. With `side_streams` (CUDA streams of the wave's device) a step's calls are shared out
over the calling thread and one C++ thread per side stream, each launching on its own stream and
ordered against the calling thread's stream by events (call_loop.cpp says how). The same calls
are made, one per case and step; only several at once. The engine asks for it where every family
of the wave declares `concurrent_steps` (worker.adapters.base) and KERNEL_THREADS allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from worker.engine import harness

log = logging.getLogger(__name__)


class WaveCalls:
    """The prepared calls of one wave, with the wave case of each, and the side streams (if any)
    its steps' calls are shared out over."""

    def __init__(self, prepared: object, cases: list[int], side_streams: Sequence[object] = ()) -> None:
        self.prepared, self.cases = prepared, cases
        self.side_streams = list(side_streams)  # kept alive as long as the calls may use them
        self._packed = [(s.stream_id, s.device_index, s.device_type) for s in self.side_streams]

    def run(self, step: int) -> list[tuple[int, str]]:
        """Every case's call of `step`; the wave cases whose call raised, with the error's message
        (their calls are not made again)."""
        return [(self.cases[position], message) for position, message in self.prepared.run(step, self._packed)]


def prepare(bound: Sequence[Callable[[int], None] | None], last_steps: Sequence[int],
            skip: set[int], side_streams: Sequence[object] = ()) -> WaveCalls | None:
    """The calls of `bound` (a wave's step functions; None and `skip` left out) in C++, when the
    harness is loaded and switched on and every one is a kernel_ops.BoundOp; else None (the wave
    calls them from Python, as before). `side_streams`: see the module docstring."""
    from worker.engine.kernel_ops import BoundOp

    module = harness.module()
    if module is None or not harness.switched_on("OPTDRIFT_CALL_LOOP"):
        return None
    cases = [index for index, step_fn in enumerate(bound) if step_fn is not None and index not in skip]
    if not cases or not all(isinstance(bound[index], BoundOp) for index in cases):
        return None
    prepared = module.PreparedCalls()
    for index in cases:
        step_fn = bound[index]
        arguments, step_at = step_fn.arguments()
        schema = step_fn.op._schema
        try:
            prepared.add(schema.name, schema.overload_name, arguments, step_at, int(last_steps[index]))
        except (ValueError, RuntimeError) as error:  # a call C++ cannot make as Python makes it
            log.warning("kernel calls stay in Python for this wave: %s", error)
            return None
    return WaveCalls(prepared, cases, side_streams)
