"""Deprecated: `service.verdicts` moved to `service.core.verdicts`. This alias keeps old imports working, with a
DeprecationWarning naming the new import, until optdrift `service.core.moved.REMOVED_IN`."""

from __future__ import annotations

import warnings

from service.core import verdicts as _moved
from service.core.moved import alias, message

# At import, once per process; stacklevel 2 is the importing line (importlib's frames are skipped).
warnings.warn(message(__name__), DeprecationWarning, stacklevel=2)

__all__, __getattr__, __dir__ = alias(__name__, _moved)
