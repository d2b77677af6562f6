"""Run Alembic migrations programmatically (`optdrift migrate`, `optdrift serve`, the tests).

The migrations live in the repository's top-level `migrations/` folder and ship with the
distribution as data files (<prefix>/share/optdrift/migrations, pyproject.toml), so an installed
wheel (the Docker images, `pip install optdrift[server]`) migrates without the source tree; the
repository's alembic.ini points at the folder for `alembic upgrade head` from a checkout.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from alembic import command
from alembic.config import Config


def migrations_dir() -> Path:
    """The checkout's migrations/ (an editable install, the tests), else the copy installed with
    the distribution (found through its file list, whatever the install scheme put it)."""
    checkout = Path(__file__).resolve().parents[2] / "migrations"
    if (checkout / "env.py").is_file():
        return checkout
    try:
        files = metadata.distribution("optdrift").files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.as_posix().endswith("share/optdrift/migrations/env.py"):
            return Path(file.locate()).resolve().parent
    raise FileNotFoundError("optdrift's migrations are neither in a checkout nor installed with the "
                            "package (share/optdrift/migrations); reinstall optdrift")


MIGRATIONS_DIR = migrations_dir()


def alembic_config(database_url: str | None = None) -> Config:
    # No ini file: env.py takes the URL from the settings and configures no logging of its own.
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if database_url:
        config.attributes["database_url"] = database_url
    return config


def upgrade_to_head(database_url: str | None = None) -> None:
    command.upgrade(alembic_config(database_url), "heads")
