"""File modes of what OPTDRIFT_HOME holds: the folder 0700, the SQLite database and every secret
file 0600, whoever else has an account on the host.

The embedded database holds the GitHub credentials and webhook secrets (encrypted, sealing.py,
but with the key file beside it) and the token hashes; it used to be created 0644 in a 0755 home.
The database file is created 0600 before SQLAlchemy opens it: SQLite creates its -wal, -shm and
-journal files with the database file's mode, so those are 0600 too. A home or a file found
looser (made by an older version, or by hand) is tightened at start, with a log line.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from sqlalchemy.engine import make_url

from service.settings import Settings

log = logging.getLogger(__name__)

HOME_MODE, SECRET_FILE_MODE = 0o700, 0o600
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def sqlite_file(settings: Settings) -> Path | None:
    """The embedded database's file, or None for a server database (or an in-memory one)."""
    url = make_url(settings.resolved_database_url)
    if not url.drivername.startswith("sqlite") or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database)


def _tighten(path: Path, mode: int, what: str) -> bool:
    """chmod `path` to `mode` when it grants more; True when it did."""
    try:
        current = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        return False
    if current & ~mode == 0:
        return False
    path.chmod(mode)
    log.warning("%s %s was mode %04o, readable by others: changed to %04o", what, path, current, mode)
    return True


def secret_files(settings: Settings) -> list[Path]:
    """Every file of the home that holds a secret (SQLite's companions included)."""
    files = [settings.admin_token_file, settings.worker_token_file, settings.resolved_secrets_key_file]
    database = sqlite_file(settings)
    if database is not None:
        files += [database, *(database.with_name(database.name + suffix) for suffix in SQLITE_COMPANIONS)]
    return files


def secure_home(settings: Settings) -> list[Path]:
    """Create OPTDRIFT_HOME 0700 (or tighten it), create the SQLite database file 0600 when it
    does not exist yet, and tighten every secret file to 0600. Returns the paths it changed."""
    changed: list[Path] = []
    home = settings.home
    if not home.exists():
        home.mkdir(parents=True, mode=HOME_MODE)
        home.chmod(HOME_MODE)  # mkdir's mode is masked by the umask
    elif _tighten(home, HOME_MODE, "OPTDRIFT_HOME"):
        changed.append(home)
    database = sqlite_file(settings)
    if database is not None and not database.exists():
        database.parent.mkdir(parents=True, exist_ok=True)
        # An empty file is an empty SQLite database; created with its final mode, no chmod race.
        try:
            os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SECRET_FILE_MODE))
        except FileExistsError:
            pass  # another process made it first (then tightened below if it is looser)
    for path in secret_files(settings):
        if _tighten(path, SECRET_FILE_MODE, "secret file"):
            changed.append(path)
    return changed
