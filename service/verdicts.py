"""Deprecated: `service.verdicts` moved to `service.core.verdicts`. This alias keeps old imports working, with a
DeprecationWarning naming the new import, until optdrift `service.core.moved.REMOVED_IN`."""

from __future__ import annotations

import warnings
from types import ModuleType

from service.core import verdicts as _moved
from service.core.moved import message

# At import, once per process; stacklevel 2 is the importing line (importlib's frames are skipped).
warnings.warn(message(__name__), DeprecationWarning, stacklevel=2)

# What `from <old> import *` gave: the new module's public names, not the modules it imports.
__all__ = [name for name, value in vars(_moved).items()
           if not name.startswith("_") and name != "annotations" and not isinstance(value, ModuleType)]


def __getattr__(name: str):  # noqa: ANN202
    try:
        return getattr(_moved, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r} (nor has service.core.verdicts, "
                             "where it moved)") from None


def __dir__() -> list[str]:
    return sorted(set(dir(_moved)))
