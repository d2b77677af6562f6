"""Adapters the operator registers beside the built-in ones: OPTDRIFT_EXTRA_ADAPTERS.

    OPTDRIFT_EXTRA_ADAPTERS="tinyopt=/srv/adapters/tinyopt.py,capiopt=/srv/adapters/capiopt.py,mine=mypkg.adapter"

Each entry is `name=/absolute/folder/module.py` (the module is imported from that folder, which
the kernel host's box shows read-only) or `name=dotted.module` (a module installed in the worker's
Python). A tree's optdrift.toml then names the adapter by `name`. The registration is the
worker's own configuration (service.settings): a submitted tree only ever names an adapter, and a
name that is neither built in nor registered gets get_adapter's refusal listing the valid ones.
The test suite registers its fixture adapters this way (tests/conftest.py, tests/fixtures/adapters).

Read in the worker's process only (`registered()`); the kernel host receives the module name and
the folder on its command line (worker.engine.host.client), so nothing in the box reads a setting.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SETTING = "OPTDRIFT_EXTRA_ADAPTERS"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class RegisteredAdapter:
    name: str
    module: str  # what the kernel host imports
    folder: Path | None  # imported from here (shown read-only in the box), or None: installed

    @property
    def folders(self) -> list[Path]:
        return [] if self.folder is None else [self.folder]


def parse(text: str) -> dict[str, RegisteredAdapter]:
    """The registrations in `text` (comma-separated `name=target`); ValueError naming the setting
    and the entry when one is malformed, shadows a built-in name, or names a file that is not an
    absolute path to an existing .py file."""
    from worker.adapters import BUILTIN_ADAPTERS

    registered: dict[str, RegisteredAdapter] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, equals, target = (s.strip() for s in entry.partition("="))
        if not equals or not _NAME.fullmatch(name) or not target:
            raise ValueError(f"{SETTING}: {entry!r} is not name=/absolute/folder/module.py or name=dotted.module")
        if name in BUILTIN_ADAPTERS or name in registered:
            raise ValueError(f"{SETTING}: {name!r} is registered twice or is a built-in adapter's name")
        if target.endswith(".py"):
            path = Path(target)
            if not path.is_absolute() or not path.is_file() or not _NAME.fullmatch(path.stem):
                raise ValueError(f"{SETTING}: {name}={target}: not an absolute path to a module file "
                                 "(a Python identifier, ending .py)")
            registered[name] = RegisteredAdapter(name, path.stem, path.parent.resolve())
        elif _MODULE.fullmatch(target):
            registered[name] = RegisteredAdapter(name, target, None)
        else:
            raise ValueError(f"{SETTING}: {name}={target}: neither a module file nor a dotted module name")
    return registered


def registered() -> dict[str, RegisteredAdapter]:
    """The worker's registrations (its settings, read now)."""
    from service.settings import get_settings

    return parse(get_settings().extra_adapters)


def host_form(name: str) -> tuple[str, list[Path]]:
    """(the module name a kernel host is given for adapter `name`, folders to import it from): a
    registered adapter's module and folder, else `name` itself (a built-in name or a module path,
    which get_adapter resolves or refuses inside the host)."""
    found = registered().get(name)
    return (name, []) if found is None else (found.module, found.folders)
