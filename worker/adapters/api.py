"""The public adapter API: the one module an adapter author imports from.

    from worker.adapters.api import CaseSpec, FamilyAdapter, HandedOverStates, ProjectAdapter

Stable surface (API_VERSION, semantic versioning of its own, independent of the package version):

* Every name in `__all__` below, with the meaning its own docstring gives: the case an adapter is
  handed (`CaseSpec` and the layout models `ParamLayout`, `TensorSlot`, `TensorGroupSpec`,
  `GradientStreamSpec`, the `LAYOUT_ALIGN` of the flat parameter vector and the literal types of
  optimizer, family and dtype names), the base classes (`ProjectAdapter`, `FamilyAdapter`,
  `HandedOverStates` and the handles it makes, `CaseStates` / `GroupStates`), the state
  declarations (`StateDeclaration`, `UnreadableState`), the errors an adapter raises or the engines
  turn into outcomes (`AdapterError`, `AdapterContractError`, `StateNotAsDeclared`,
  `GroupLifecycleMissing`), the group lifecycle (`FamilyAdapter.open_group` / `step_group`, whose
  default raises `GroupLifecycleMissing`; `HandedOverStates` loops per tensor) and `INSTALLED`, the
  `library` value that means "the package installed in the worker's Python".
* The methods and class attributes of those classes that the contract names (docs/PROJECTS.md,
  "The adapter contract" and "The group lifecycle"): `load`, `families`, `unsupported`,
  `describe`; `open`, `step`, `state_for_digest`, `close`, `bind`, `adopt_states`,
  `declared_state`, `unreadable_state`, `open_group`, `step_group`; `init_states`, `step_states`,
  `bind_states`; `states_movable`, `fast_engine`, `name`.

How it changes: a MAJOR bump removes or renames one of those names or changes what a call means
for an adapter already written (an argument, a return value, when the engines call it); a MINOR
bump adds (a name, an optional hook with a default that keeps every existing adapter's behaviour);
a PATCH bump changes documentation or fixes behaviour to match it. A name that moves keeps working
from its old import for at least one minor release of the package, with a DeprecationWarning
naming the new import (service.core.moved lists them and the release they go in).

Not covered, and free to change in any release: everything else under `worker.*` and `service.*`
(the engines, the digests, the references, `worker.adapters.base`'s own module layout, helpers
such as `worker.adapters.c_abi` and `worker.references.*`), and the provisional quantized-state
hooks `FamilyAdapter.quantization_codec` / `dequantized_states`, which take the engines' own codec
objects. An adapter that imports them pins the optdrift version it was written for.

This module does not import torch, so a process that must not (the service, the Celery parent)
can read the registry and these names.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.core.results import (
    LAYOUT_ALIGN,
    CaseSpec,
    GradientStreamSpec,
    KernelFamily,
    OptimizerName,
    ParamDtype,
    ParamLayout,
    TensorGroupSpec,
    TensorSlot,
)
from worker.adapters.base import (
    AdapterContractError,
    AdapterError,
    CaseStates,
    FamilyAdapter,
    GroupLifecycleMissing,
    GroupStates,
    HandedOverStates,
    ProjectAdapter,
    StateDeclaration,
    StateNotAsDeclared,
    UnreadableState,
)

if TYPE_CHECKING:  # pragma: no cover - at run time INSTALLED comes from __getattr__ below
    from worker.build.cache import INSTALLED

API_VERSION = "1.0.0"

__all__ = [
    "API_VERSION",
    "INSTALLED",
    "LAYOUT_ALIGN",
    "AdapterContractError",
    "AdapterError",
    "CaseSpec",
    "CaseStates",
    "FamilyAdapter",
    "GradientStreamSpec",
    "GroupLifecycleMissing",
    "GroupStates",
    "HandedOverStates",
    "KernelFamily",
    "OptimizerName",
    "ParamDtype",
    "ParamLayout",
    "ProjectAdapter",
    "StateDeclaration",
    "StateNotAsDeclared",
    "TensorGroupSpec",
    "TensorSlot",
    "UnreadableState",
]


def __getattr__(name: str):  # noqa: ANN202
    # INSTALLED lives with the build cache, whose module reaches the sandbox and the toolchain: it is
    # imported when an adapter asks for it, not whenever this module is.
    if name == "INSTALLED":
        from worker.build.cache import INSTALLED

        return INSTALLED
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
