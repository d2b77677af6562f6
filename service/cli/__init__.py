"""The `optdrift` command: the client of the REST API and, for local commands (`check`, `serve`'s
embedded worker, `sensitivity`, `adapter-check`), the only part of `service` that imports `worker`.

`app` (the typer application, `service.cli.main`) is loaded on first use, so `service.cli.client` and
the other modules import without loading every command."""

from __future__ import annotations


def __getattr__(name: str):
    if name == "app":
        from service.cli.main import app

        return app
    raise AttributeError(f"module 'service.cli' has no attribute {name!r}")
