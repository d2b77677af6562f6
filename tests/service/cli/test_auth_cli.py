"""Token lifecycle through the real CLI on the embedded default (SQLite under a temporary
OPTDRIFT_HOME), serve's first-start bootstrap, and where the client finds its token."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.service_fixtures import REPO_ROOT


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "PYTHONPATH": str(REPO_ROOT), "COLUMNS": "200"})
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_create_list_revoke_through_the_cli(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert _cli(home, "migrate").returncode == 0
    created = _cli(home, "token", "create", "--name", "ci", "--scope", "submit", "--project", "kern",
                   "--expires-days", "30")
    assert created.returncode == 0, created.stderr
    token = created.stdout.strip()
    assert token.startswith("odt_") and "\n" not in token and "shown once" in created.stderr
    listed = _cli(home, "token", "list")
    assert token[:10] in listed.stdout and token not in listed.stdout and "kern" in listed.stdout
    bad = _cli(home, "token", "create", "--name", "x", "--scope", "root")
    assert bad.returncode == 2 and "not one of" in bad.stdout
    assert _cli(home, "token", "revoke", "1").returncode == 0
    assert _cli(home, "token", "revoke", "99").returncode == 2
    with sqlite3.connect(home / "optdrift.db") as db:
        stored_hash, revoked, expires = db.execute(
            "SELECT token_hash, revoked_at, expires_at FROM api_tokens WHERE id = 1").fetchone()
        dump = "\n".join(db.iterdump())
    assert stored_hash == hashlib.sha256(token.encode()).hexdigest()
    assert revoked is not None and expires is not None
    assert token not in dump  # only the hash is stored


def test_first_start_bootstrap_writes_0600_files_once(tmp_path: Path) -> None:
    from sqlalchemy.orm import Session

    from service.db.migrate import upgrade_to_head
    from service.db.session import make_engine
    from service.domain.auth import authenticate, bootstrap_tokens

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    admin_file, worker_file = tmp_path / "home" / "admin-token", tmp_path / "home" / "worker-token"
    with Session(engine) as session:
        first = bootstrap_tokens(session=session, admin_file=admin_file, worker_file=worker_file,
                                 worker_configured=False)
        assert first == {"admin": "created", "worker": "created"}
        assert admin_file.stat().st_mode & 0o777 == 0o600 and worker_file.stat().st_mode & 0o777 == 0o600
        assert authenticate(session=session, token=admin_file.read_text().strip()).scope == "admin"
        assert authenticate(session=session, token=worker_file.read_text().strip()).scope == "worker"
        token_before = admin_file.read_text()
        again = bootstrap_tokens(session=session, admin_file=admin_file, worker_file=worker_file,
                                 worker_configured=False)
        assert again["admin"] == "kept" and "worker" not in again and admin_file.read_text() == token_before
        admin_file.unlink()  # a database with an admin already gets no second one
        third = bootstrap_tokens(session=session, admin_file=admin_file, worker_file=worker_file,
                                 worker_configured=True)
        assert third["admin"].startswith("exists") and not admin_file.exists()
    engine.dispose()


def test_client_token_sources_in_order(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    from service.cli.client import OptdriftClient, resolve_token

    for key in ("OPTDRIFT_TOKEN", "OPTDRIFT_TOKEN_FILE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("OPTDRIFT_HOME", str(tmp_path / "home"))
    assert resolve_token() is None
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "admin-token").write_text("odt_embedded\n")
    assert resolve_token() == "odt_embedded"
    (tmp_path / "config" / "optdrift").mkdir(parents=True)
    (tmp_path / "config" / "optdrift" / "token").write_text("odt_config\n")
    assert resolve_token() == "odt_config"
    (tmp_path / "named").write_text("odt_named")
    monkeypatch.setenv("OPTDRIFT_TOKEN_FILE", str(tmp_path / "named"))
    assert resolve_token() == "odt_named"
    monkeypatch.setenv("OPTDRIFT_TOKEN", "odt_env")
    assert resolve_token() == "odt_env"
    client = OptdriftClient("http://127.0.0.1:9")
    assert client.http.headers["authorization"] == "Bearer odt_env"
    client.close()
