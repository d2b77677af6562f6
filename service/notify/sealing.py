"""Credentials at rest: the GitHub token, a GitHub App's private key and the webhook secrets are
stored encrypted (Fernet: AES-128-CBC + HMAC-SHA256, from `cryptography`) under a key the operator
provides, so a copy of the database alone (a backup, a 0644 SQLite file) does not hold them.

The key: OPTDRIFT_SECRETS_KEY (one or more Fernet keys, comma-separated: the first encrypts, every
one decrypts, so a key is rotated by putting the new one first), else the file
OPTDRIFT_SECRETS_KEY_FILE, else `<OPTDRIFT_HOME>/secrets-key`, which the embedded default creates
(0600) on first start, as it does the admin token. A stored value is `fernet:` + the token; a
value without that prefix is a row written before encryption, read as it is until
`seal_stored_credentials` (run by `optdrift serve` at start) encrypts it in place.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from service.db.notify_models import GitHubIntegration, Webhook
from service.settings import Settings

log = logging.getLogger(__name__)

SEALED_PREFIX = "fernet:"
# The columns that hold a credential, per model.
SEALED_COLUMNS = {GitHubIntegration: ("token", "private_key"), Webhook: ("secret",)}


class SecretsKeyError(RuntimeError):
    """The secrets key is missing, malformed, or not the one the stored credentials were sealed with."""


def _key_source(settings: Settings) -> tuple[str, str | None]:
    """(where the key comes from, in words; its text, or None when that file does not exist)."""
    # An empty OPTDRIFT_SECRETS_KEY (a compose file's `${VAR:-}`) counts as unset.
    if settings.secrets_key is not None and settings.secrets_key.get_secret_value().strip():
        return "OPTDRIFT_SECRETS_KEY", settings.secrets_key.get_secret_value()
    path = settings.resolved_secrets_key_file
    try:
        return str(path), path.read_text()
    except FileNotFoundError:
        return str(path), None


def _create_key_file(path: Path) -> None:
    """Write a new key to `path`, 0600 from the first byte, unless another process got there
    first (link() is atomic and refuses an existing name, so two first starts agree on one key)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(Fernet.generate_key().decode() + "\n")
    try:
        os.link(part, path)
        log.info("created the secrets key %s (0600): keep it with the database's backups", path)
    except FileExistsError:
        pass
    finally:
        part.unlink()


def ensure_key(settings: Settings) -> str:
    """The embedded default's first start: create `<home>/secrets-key` when no key is configured
    and none exists. Returns where the key comes from."""
    where, text = _key_source(settings)
    if text is None and settings.secrets_key_file is None:
        _create_key_file(settings.resolved_secrets_key_file)
    elif text is None:
        raise SecretsKeyError(f"OPTDRIFT_SECRETS_KEY_FILE names {where}, which does not exist; create it "
                              f"with a Fernet key (python -c 'from cryptography.fernet import Fernet; "
                              f"print(Fernet.generate_key().decode())') or unset the setting")
    fernet(settings)  # a malformed key is reported at start, not at the first notification
    return where


def fernet(settings: Settings, *, create: bool = False) -> MultiFernet:
    """The configured key(s). `create`: in the embedded default, make the key file if missing."""
    if create:
        ensure_key(settings)
    where, text = _key_source(settings)
    if text is None:
        raise SecretsKeyError(f"no secrets key at {where}: the stored GitHub credentials and webhook "
                              f"secrets cannot be decrypted; set OPTDRIFT_SECRETS_KEY or "
                              f"OPTDRIFT_SECRETS_KEY_FILE to the key `optdrift serve` uses")
    keys = [part.strip() for part in text.replace("\n", ",").split(",") if part.strip()]
    if not keys:
        raise SecretsKeyError(f"the secrets key from {where} is empty; put a Fernet key there (python -c "
                              f"'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())')")
    try:
        return MultiFernet([Fernet(key) for key in keys])
    except (ValueError, TypeError) as exc:
        raise SecretsKeyError(f"the secrets key from {where} is not a Fernet key (32 url-safe base64 "
                              f"bytes, e.g. from Fernet.generate_key()): {exc}") from None


def is_sealed(stored: str | None) -> bool:
    return stored is not None and stored.startswith(SEALED_PREFIX)


def seal(plaintext: str | None, settings: Settings) -> str | None:
    """What is stored for `plaintext`: `fernet:` + its Fernet token (None stays None)."""
    if plaintext is None:
        return None
    token = fernet(settings, create=True).encrypt(plaintext.encode()).decode()
    return SEALED_PREFIX + token


def unseal(stored: str | None, settings: Settings) -> str | None:
    """The credential a stored value holds. A value stored before encryption (no prefix) is
    returned as it is; `seal_stored_credentials` encrypts those at start."""
    if not is_sealed(stored):
        return stored
    try:
        return fernet(settings).decrypt(stored[len(SEALED_PREFIX):].encode()).decode()
    except InvalidToken:
        raise SecretsKeyError("a stored credential does not decrypt with the configured secrets key "
                              "(OPTDRIFT_SECRETS_KEY / OPTDRIFT_SECRETS_KEY_FILE): was the key replaced? "
                              "Put the old key after the new one (comma-separated) to read it") from None


def seal_stored_credentials(session: Session, settings: Settings) -> int:
    """Encrypt in place every credential stored before encryption; returns how many. Idempotent."""
    sealed = 0
    for model, columns in SEALED_COLUMNS.items():
        for row in session.scalars(select(model)):
            for column in columns:
                value = getattr(row, column)
                if value is not None and not is_sealed(value):
                    setattr(row, column, seal(value, settings))
                    sealed += 1
    session.flush()
    return sealed


def forget_plaintext_pages(engine: Engine) -> None:
    """After plaintext credentials were sealed in an SQLite file: rebuild it (VACUUM) and empty its
    write-ahead log, so their old values do not linger in freed pages. Run with no other
    connection writing (`serve` does it before its worker and server start). A server database
    (PostgreSQL) reclaims old row versions by its own VACUUM."""
    if engine.dialect.name != "sqlite":
        return
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as connection:
        connection.exec_driver_sql("VACUUM")
        connection.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
