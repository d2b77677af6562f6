"""A wave's kernel calls made from C++: the harness library's `PreparedCalls` (worker/engine/
harness_csrc/call_loop.cpp) over the cases' bound ops.

The fast engine calls each case's kernel once per step through its project's op. For the bundled
kernels that op call is a bundled_ops.BoundOp; from Python each such call parses its arguments
against the op's schema again, which costs the host more than the launch itself
(bench/op_call_cost.py measures it). PreparedCalls converts and checks each
case's arguments once and then makes the same calls, in the same order, through the same
dispatcher entry, one per case and step: nothing is batched and the kernel sees exactly the call
its project's API makes. Calls of any other kind (a project's Python function, a library-owned
state's copy-back) stay in Python. `OPTDRIFT_CALL_LOOP=0` keeps every call in Python.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from worker.engine import harness

log = logging.getLogger(__name__)


class WaveCalls:
    """The prepared calls of one wave, with the wave case of each."""

    def __init__(self, prepared: object, cases: list[int]) -> None:
        self.prepared, self.cases = prepared, cases

    def run(self, step: int) -> list[tuple[int, str]]:
        """Every case's call of `step`; the wave cases whose call raised, with the error's message
        (their calls are not made again)."""
        return [(self.cases[position], message) for position, message in self.prepared.run(step)]


def prepare(bound: Sequence[Callable[[int], None] | None], last_steps: Sequence[int],
            skip: set[int], *, below_autograd: bool | None = None) -> WaveCalls | None:
    """The calls of `bound` (a wave's step functions; None and `skip` left out) in C++, when the
    harness is loaded and switched on and every one is a bundled_ops.BoundOp; else None (the wave
    calls them from Python, as before). `below_autograd` (default: on unless
    OPTDRIFT_CALL_LOOP_BELOW_AUTOGRAD=0): the calls enter the dispatcher below its autograd layer,
    which a bundled op has no kernel in (call_loop.cpp)."""
    from worker.adapters.bundled_ops import BoundOp

    module = harness.module()
    if module is None or not harness.switched_on("OPTDRIFT_CALL_LOOP"):
        return None
    cases = [index for index, step_fn in enumerate(bound) if step_fn is not None and index not in skip]
    if not cases or not all(isinstance(bound[index], BoundOp) for index in cases):
        return None
    if below_autograd is None:
        below_autograd = harness.switched_on("OPTDRIFT_CALL_LOOP_BELOW_AUTOGRAD")
    prepared = module.PreparedCalls(below_autograd)
    for index in cases:
        step_fn = bound[index]
        arguments, step_at = step_fn.arguments()
        schema = step_fn.op._schema
        try:
            prepared.add(schema.name, schema.overload_name, arguments, step_at, int(last_steps[index]))
        except (ValueError, RuntimeError) as error:  # a call C++ cannot make as Python makes it
            log.warning("kernel calls stay in Python for this wave: %s", error)
            return None
    return WaveCalls(prepared, cases)
