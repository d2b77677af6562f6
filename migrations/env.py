"""Alembic environment: the URL is the configured one (OPTDRIFT_DATABASE_URL or the embedded
SQLite file) unless the caller put one in the config (service.db.migrate does, for tests)."""

from __future__ import annotations

from alembic import context

from service.db import models  # noqa: F401  (registers every table on Base.metadata)
from service.db import token_models  # noqa: F401
from service.db import speed_models  # noqa: F401
from service.db import notify_models  # noqa: F401
from service.db import environment_models  # noqa: F401
from service.db import training_models  # noqa: F401
from service.db.base import Base
from service.db.session import make_engine
from service.settings import get_settings

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    return config.attributes.get("database_url") or get_settings().resolved_database_url


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True,
                      render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_url())
    with engine.connect() as connection:
        _run(connection)
    engine.dispose()


def _run(connection) -> None:  # noqa: ANN001
    # render_as_batch: SQLite cannot ALTER most things; batch mode rebuilds the table instead.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
