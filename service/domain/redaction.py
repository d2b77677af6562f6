"""Known secret values, scrubbed from everything a run stores (errors, build logs, run detail,
trajectory messages) and so from everything the API and the dashboard serve.

Defence in depth: the sandbox (worker/sandbox/) already keeps these values out of a build's and
a kernel host's reach. If one leaks anyway (a worker without bubblewrap, a bug), it is replaced by
REDACTED before it reaches the database, where a public `GET /api/v1/runs/{id}` would show it.
"""

from __future__ import annotations

import os
import re
from typing import Any
from urllib.parse import unquote, urlsplit

REDACTED = "[redacted]"
# Environment variables whose values are secrets by their name (the worker's and the host's).
SECRET_NAME = re.compile(r"(TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|PRIVATE_KEY|ACCESS_KEY|API_KEY)", re.I)
# Shorter values are too likely to occur by chance in a log ("1", "true", a port number).
MIN_SECRET_CHARS = 8


def _url_password(url: str | None) -> str | None:
    if not url:
        return None
    try:
        password = urlsplit(url).password
    except ValueError:
        return None
    return unquote(password) if password else None


def _read(path: Any) -> str | None:
    try:
        return path.read_text().strip() or None
    except (OSError, AttributeError):
        return None


def known_secrets(settings: Any, environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """Every secret value this process knows: the token files and settings, the passwords in the
    database and broker URLs (and the URLs themselves), and environment values named like secrets."""
    environ = dict(os.environ if environ is None else environ)
    values: set[str] = set()
    values.add(_read(settings.admin_token_file) or "")
    values.add(settings.resolved_worker_token() or "")
    for url in (settings.database_url, settings.broker_url, environ.get("OPTDRIFT_DATABASE_URL"),
                environ.get("OPTDRIFT_BROKER_URL")):
        password = _url_password(url)
        if password:
            values.update({password, url})
    for name, value in environ.items():
        if SECRET_NAME.search(name):
            values.add(value)
    return tuple(sorted((v for v in values if len(v) >= MIN_SECRET_CHARS), key=len, reverse=True))


_by_settings: dict[int, tuple[str, ...]] = {}


def _settings_secrets() -> tuple[str, ...]:
    """known_secrets() of the current settings, read once per settings object (a test or the CLI
    that clears get_settings' cache gets its secrets read again)."""
    from service.settings import get_settings

    settings = get_settings()
    if id(settings) not in _by_settings:
        _by_settings.clear()
        _by_settings[id(settings)] = known_secrets(settings)
    return _by_settings[id(settings)]


def forget_cached_secrets() -> None:
    """After a token file is written or rotated: read the secrets again at the next scrub."""
    _by_settings.clear()


def scrub(text: str | None, secrets: tuple[str, ...] | None = None) -> str | None:
    """`text` with every known secret replaced by REDACTED (longest first, so a URL goes whole)."""
    if not text:
        return text
    for secret in _settings_secrets() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return text


def scrub_json(value: Any, secrets: tuple[str, ...] | None = None) -> Any:
    """scrub() through a JSON-like value (dicts, lists, strings)."""
    if isinstance(value, str):
        return scrub(value, secrets)
    if isinstance(value, dict):
        return {key: scrub_json(item, secrets) for key, item in value.items()}
    if isinstance(value, list):
        return [scrub_json(item, secrets) for item in value]
    return value


def clip(text: str | None, max_chars: int) -> str | None:
    """`text` cut to its first and last halves of `max_chars` (an error's head says what failed, its
    tail where), saying how much was left out."""
    if text is None or len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters not kept ...]\n{text[-half:]}"
