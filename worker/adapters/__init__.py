"""Project adapters: drive a kernel project's optimizer ops for the engine (see base.py).

`get_adapter(name)` returns a fresh adapter. A name is one of `BUILTIN_ADAPTERS` or the name of
any module the kernel host can import (`myproject_optdrift`, `myproject.optdrift_adapter`) that
defines exactly one `ProjectAdapter` subclass (or a module-level `ADAPTER` instance). Where the
host looks for it (docs/PROJECTS.md, "Where a worker finds an adapter"): the worker's installed
packages, the folders a project's `adapter_path` names in its tree, and the host's --adapter-path
folders, where the worker puts the adapters its operator registered (registry.py,
OPTDRIFT_EXTRA_ADAPTERS: the test suite's fixture adapters, tests/fixtures/adapters). A module
that fails to import is reported with its whole error (the exception, and the file and line where
it was raised), never cut short. No torch at import time.
"""

from __future__ import annotations

import importlib
import inspect
import traceback

from worker.adapters.base import AdapterError, ProjectAdapter

BUILTIN_ADAPTERS: dict[str, str] = {
    "bundled": "worker.adapters.bundled",
    "bitsandbytes": "worker.adapters.bitsandbytes",
    "lion_pytorch": "worker.adapters.lion_pytorch",  # a real PyPI library (lion-pytorch), issue 20
    "torchao": "worker.adapters.torchao",  # torchao's low-bit optimizers (torch.compile), issue 37
}

__all__ = ["AdapterError", "BUILTIN_ADAPTERS", "ProjectAdapter", "get_adapter"]


def _import_failure(name: str, module_name: str, error: BaseException) -> str:
    """The whole import error: the exception and where it was raised (the adapter's own file,
    often), so a typo in an adapter module is fixable from the run's message alone."""
    frames = traceback.extract_tb(error.__traceback__)
    own = [f for f in frames if "importlib" not in f.filename]
    where = f" (at {own[-1].filename}:{own[-1].lineno})" if own else ""
    if isinstance(error, SyntaxError) and error.filename:
        where = f" (at {error.filename}:{error.lineno})"
    return f"adapter {name!r}: importing module {module_name} failed: {type(error).__name__}: {error}{where}"


def get_adapter(name: str) -> ProjectAdapter:
    module_name = BUILTIN_ADAPTERS.get(name, name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is not None and module_name.split(".")[0] == error.name.split(".")[0] and \
                module_name.startswith(error.name):
            # The adapter module itself (or its package) is not importable here.
            raise AdapterError(
                f"unknown adapter {name!r}: cannot import module {module_name}: no module {error.name!r} is "
                f"importable by the kernel host. "
                f"Use one of {sorted(BUILTIN_ADAPTERS)}, an adapter the worker's operator registered "
                "(OPTDRIFT_EXTRA_ADAPTERS), a module installed in the worker's Python, or "
                "a module in a folder named by the project's adapter_path (docs/PROJECTS.md)") from error
        raise AdapterError(_import_failure(name, module_name, error)) from error
    except Exception as error:  # noqa: BLE001 - the adapter module's own fault: say which and where
        raise AdapterError(_import_failure(name, module_name, error)) from error
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
