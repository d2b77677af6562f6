"""Run Alembic migrations programmatically (`optdrift migrate`, `optdrift serve`, the tests).

The migrations ship inside the package (service/db/migrations, package data), so an installed
wheel (the Docker images, `pip install optdrift[server]`) migrates without the source tree; the
repository's alembic.ini points at the same folder for `alembic upgrade head` from a checkout.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str | None = None) -> Config:
    # No ini file: env.py takes the URL from the settings and configures no logging of its own.
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if database_url:
        config.attributes["database_url"] = database_url
    return config


def upgrade_to_head(database_url: str | None = None) -> None:
    command.upgrade(alembic_config(database_url), "head")
