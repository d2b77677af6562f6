"""The bundled csrc kernels (torch.ops.optdrift.*), built by worker.build.

Its families are the engine's original ones (worker.engine.trajectory.FAMILY_ADAPTERS): the 32-bit ops
through worker.engine.kernel_ops.step and the 8-bit blockwise ops through worker.engine.trajectory_8bit.
"""

from __future__ import annotations

from collections.abc import Mapping

from worker.adapters.base import AdapterError, ProjectAdapter


class BundledAdapter(ProjectAdapter):
    name = "bundled"

    def __init__(self) -> None:
        self._library: str | None = None

    def load(self, library: str) -> None:
        from worker.engine import kernel_ops

        try:
            kernel_ops.load_build(library)
        except FileNotFoundError as error:
            raise AdapterError(str(error)) from error
        self._library = library

    def families(self) -> Mapping[str, object]:
        from worker.engine.trajectory import FAMILY_ADAPTERS

        return FAMILY_ADAPTERS

    def describe(self) -> dict[str, str]:
        return {"adapter": self.name, "library": str(self._library)}
