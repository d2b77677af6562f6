"""The adapter interface: how the engine drives one kernel project's optimizer ops.

A project adapter is one short module (see `tinyopt.py` for the smallest complete one). It says
how to load a build into the kernel host process and, per kernel family ("32bit",
"8bit_blockwise"), how to allocate a case's optimizer states and perform one in-place step:

    class MyProject(ProjectAdapter):
        name = "myproject"
        def load(self, library: str) -> None: ...            # the build's output (a .so, a folder, "installed")
        def families(self) -> Mapping[str, FamilyAdapter]: ... # {"32bit": ..., "8bit_blockwise": ...}
        def unsupported(self, case, device) -> str | None: ... # why a case cannot run here, or None

A `FamilyAdapter` (worker.engine.trajectory) has `init_states(case, param) -> dict[str, Tensor]` and
`step(case, param, grad, states, step)`. The engine digests `[param, *states.values()]` after every
step, so `states` must hold every tensor the project keeps between steps (codes and absmax for
8-bit states) and nothing that changes without being state.

This module does not import torch: the registry is read by processes that must not (the Celery
parent, the service).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from service.results import CaseSpec
    from worker.engine.trajectory import FamilyAdapter


class AdapterError(RuntimeError):
    """A build cannot be loaded by its adapter (missing file, wrong package, wrong version)."""


class ProjectAdapter(ABC):
    name: ClassVar[str]

    @abstractmethod
    def load(self, library: str) -> None:
        """Load one build into this process (the kernel host). Called once, before any case."""

    @abstractmethod
    def families(self) -> Mapping[str, "FamilyAdapter"]:
        """Kernel family name -> the object that initialises states and steps a case."""

    def unsupported(self, case: "CaseSpec", device: "torch.device") -> str | None:
        """Why this project cannot run `case` on `device` (a kernel the library does not have),
        or None. Such a case is set aside as `not_applicable` with this text: counted and listed,
        never broken, never part of a verdict."""
        if case.family not in self.families():
            return (f"the {self.name} adapter has no kernel family {case.family!r} "
                    f"(it has {sorted(self.families())}); remove it from the project's battery")
        return None

    def describe(self) -> dict[str, str]:
        """What was loaded, as short strings: the adapter, its module and, when an override says
        so, the library's version and the path it was loaded from. Called once in the kernel host
        after `load()`; the host's ready line carries it, every run stores it
        (`environment_detail["adapter"]`) and the run page shows it, so a result says which
        library version produced it. Override to add `version` and `library`."""
        return {"adapter": self.name, "module": type(self).__module__}
