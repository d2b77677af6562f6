"""Modules that moved, and how long their old imports keep working (docs/PROJECTS.md, "Public
adapter API").

Each old path is a small shim module in its old place (service/results.py, ...) that warns once,
when it is first imported, with `message(old)` as a DeprecationWarning pointing at the importing
line, and then hands out the new module's names. A shim stays for at least one minor release of
the package after the release that ships it (the deprecation rule), so none goes before
REMOVED_IN. Pure: the shims of adapter-facing modules run inside the sandbox, which shows
service.core and no more of `service` than they need.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

# old import -> (new import, what to import instead when the old one served adapters or clients)
MOVED: dict[str, tuple[str, str]] = {
    "service.results": ("service.core.results", "adapters: worker.adapters.api, the public adapter API"),
    "service.verdicts": ("service.core.verdicts", ""),
    "service.client": ("service.cli.client", "the Python client's public import path"),
}
REMOVED_IN = "0.3.0"


def message(old: str) -> str:
    new, hint = MOVED[old]
    return (f"{old} is deprecated: import from {new}{f' ({hint})' if hint else ''}; "
            f"the old path goes in optdrift {REMOVED_IN}")


def alias(old: str, moved: ModuleType) -> tuple[list[str], Callable[[str], object], Callable[[], list[str]]]:
    """What a shim at `old` hands out for the module `moved`: its `__all__` (the new module's public
    names, not the modules it imports: what `from <old> import *` gave), and the module-level
    `__getattr__` and `__dir__` that answer from `moved`. The shim itself warns (its own frame is
    the one the importing line calls)."""
    names = [name for name, value in vars(moved).items()
             if not name.startswith("_") and name != "annotations" and not isinstance(value, ModuleType)]

    def attribute(name: str) -> object:
        try:
            return getattr(moved, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r} (nor has {moved.__name__}, "
                                 "where it moved)") from None

    def listing() -> list[str]:
        return sorted(set(dir(moved)))

    return names, attribute, listing
