"""A deliberately slowed kernel, to prove the speed check flags a slowdown (tests, bench/gpu).

`SlowedFamily` wraps a family adapter: after each real step it makes one extra pass over the first
`fraction` of the parameter (`mul_(1.0)`: read and written, values unchanged), so the step moves
2 * fraction * param bytes more — the shape of a real regression (an added pass, an unfused
epilogue). Only the kernels named in `kernels` ("adam/32bit") are slowed; the others are the
original, so a check can also show that they are not flagged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from worker.adapters.base import FamilyAdapter


class SlowedFamily(FamilyAdapter):
    def __init__(self, inner: Any, optimizers: set[str], fraction: float) -> None:
        from worker.engine.lifecycle import LegacyFamily

        self.inner = inner if isinstance(inner, FamilyAdapter) else LegacyFamily(inner)
        self.states_movable = self.inner.states_movable
        self.optimizers, self.fraction = optimizers, fraction

    def open(self, case, param, device):  # noqa: ANN001, ANN201
        return (case.optimizer, self.inner.open(case, param, device))

    def _extra(self, optimizer: str, param) -> None:  # noqa: ANN001
        if optimizer in self.optimizers:
            param[: max(1, int(param.numel() * self.fraction))].mul_(1.0)

    def step(self, handle, param, grad, step: int) -> None:  # noqa: ANN001
        optimizer, inner = handle
        self.inner.step(inner, param, grad, step)
        self._extra(optimizer, param)

    def bind(self, handle, param, grad) -> Callable[[int], None]:  # noqa: ANN001
        optimizer, inner = handle
        stepper = self.inner.bind(inner, param, grad)

        def slowed(step: int) -> None:
            stepper(step)
            self._extra(optimizer, param)
        return slowed

    def state_for_digest(self, handle):  # noqa: ANN001, ANN201
        return self.inner.state_for_digest(handle[1])

    def adopt_states(self, handle, states) -> None:  # noqa: ANN001
        self.inner.adopt_states(handle[1], states)

    def close(self, handle) -> None:  # noqa: ANN001
        self.inner.close(handle[1])


def slowed_families(families: Mapping[str, Any], kernels: list[str], fraction: float) -> dict[str, Any]:
    """`families` with the named kernels ("<optimizer>/<family>") slowed by an extra pass."""
    by_family: dict[str, set[str]] = {}
    for kernel in kernels:
        optimizer, _, family = kernel.partition("/")
        if family not in families:
            raise ValueError(f"mutant kernel {kernel!r}: no family {family!r} (have {sorted(families)})")
        by_family.setdefault(family, set()).add(optimizer)
    return {name: SlowedFamily(family, by_family[name], fraction) if name in by_family else family
            for name, family in families.items()}
