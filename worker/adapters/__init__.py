"""Project adapters: drive a kernel project's optimizer ops for the engine (see base.py).

`get_adapter(name)` returns a fresh adapter. A name is either one of `BUILTIN_ADAPTERS` or the
dotted path of a module that defines exactly one `ProjectAdapter` subclass (or a module-level
`ADAPTER` instance), so a project outside this tree can bring its own adapter module.
No torch at import time.
"""

from __future__ import annotations

import importlib
import inspect

from worker.adapters.base import AdapterError, ProjectAdapter

BUILTIN_ADAPTERS: dict[str, str] = {
    "bundled": "worker.adapters.bundled",
    "bitsandbytes": "worker.adapters.bitsandbytes",
    "tinyopt": "worker.adapters.tinyopt",
}

__all__ = ["AdapterError", "BUILTIN_ADAPTERS", "ProjectAdapter", "get_adapter"]


def get_adapter(name: str) -> ProjectAdapter:
    module_name = BUILTIN_ADAPTERS.get(name, name)
    if name not in BUILTIN_ADAPTERS and "." not in name:
        raise AdapterError(f"unknown adapter {name!r}: use one of {sorted(BUILTIN_ADAPTERS)} or the dotted "
                           "path of a module defining a ProjectAdapter subclass")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise AdapterError(f"adapter {name!r}: cannot import module {module_name}: {error}") from error
    instance = getattr(module, "ADAPTER", None)
    if isinstance(instance, ProjectAdapter):
        return type(instance)()
    classes = [obj for obj in vars(module).values()
               if inspect.isclass(obj) and issubclass(obj, ProjectAdapter) and obj is not ProjectAdapter
               and obj.__module__ == module.__name__ and not inspect.isabstract(obj)]
    if len(classes) != 1:
        raise AdapterError(f"adapter module {module_name} must define exactly one ProjectAdapter subclass "
                           f"(found {[c.__name__ for c in classes]})")
    return classes[0]()
