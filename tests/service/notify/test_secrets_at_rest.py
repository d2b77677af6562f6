"""Secrets at rest, against a real `optdrift serve` on the embedded default (SQLite in
OPTDRIFT_HOME): the home 0700, the database (and SQLite's -wal/-shm) and every secret file 0600,
tightened at start when looser; GitHub credentials and webhook secrets encrypted in the database
file (rows from before encryption encrypted at start, their plaintext gone from the file), never
returned by the API. And the key rules: a wrong key is a clear error, a rotated key still reads.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from pathlib import Path

import httpx
import pytest
from cryptography.fernet import Fernet
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from tests.service_fixtures import free_port, start_process, stop_process, wait_http

LEGACY_WEBHOOK_SECRET = "legacy-plaintext-webhook-secret-0123"
NEW_WEBHOOK_SECRET = "whsec_" + "QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVphYmNkZWZnaA=="
NEW_TOKEN = "ghp_newtokenvalue0123456789abcdefXYZ"


def _pem() -> str:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption()).decode()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _key_material(pem: str) -> str:
    """A line from the middle of the PEM: what must not be found in the database's bytes."""
    return pem.splitlines()[5]


def _seed_plaintext_database(home: Path, pem: str) -> None:
    """A database as an older optdrift left it: credentials in plaintext, the file 0644, the home 0755."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.db.migrate import upgrade_to_head
    from service.db.notify_models import GitHubIntegration, Webhook
    from tests.notify_rows import make_project

    home.mkdir()
    home.chmod(0o755)
    url = f"sqlite:///{home / 'optdrift.db'}"
    upgrade_to_head(url)
    engine = create_engine(url)
    with Session(engine) as session:
        project = make_project(session, name="legacy")
        session.add(GitHubIntegration(project_id=project.id, repository="octo/kernels",
                                      api_url="https://api.github.com", auth_kind="app", app_id="42",
                                      private_key=pem, check_name="optdrift", pr_comments=True))
        session.add(Webhook(project_id=project.id, url="https://hooks.example.org/x", secret=LEGACY_WEBHOOK_SECRET,
                            events=["changed"], payload_format="json", active=True))
        session.commit()
    engine.dispose()
    (home / "optdrift.db").chmod(0o644)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("at-rest")
    home = tmp / "home"
    legacy_pem, new_pem = _pem(), _pem()
    _seed_plaintext_database(home, legacy_pem)
    port = free_port()
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": "",
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0", "OPTDRIFT_SECRETS_KEY": ""}
    process = start_process(["serve", "--port", str(port), "--no-worker"], env, tmp / "api.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", timeout_s=120)
        admin = (home / "admin-token").read_text().strip()
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        # Credentials set through the API by this version.
        assert client.put("/api/v1/projects/legacy/github", json={
            "repository": "octo/kernels", "auth": "app", "app_id": "43",
            "private_key": new_pem}).status_code == 200
        assert client.post("/api/v1/projects", json={"name": "fresh"}).status_code == 201
        assert client.put("/api/v1/projects/fresh/github", json={
            "repository": "octo/fresh", "auth": "token", "token": NEW_TOKEN}).status_code == 200
        created = client.post("/api/v1/projects/fresh/webhooks", json={
            "url": "https://hooks.example.org/y", "secret": NEW_WEBHOOK_SECRET})
        assert created.status_code == 201, created.text
        yield {"home": home, "client": client, "log": tmp / "api.log", "legacy_pem": legacy_pem,
               "new_pem": new_pem, "port": port}
    finally:
        stop_process(process)


def _rows(home: Path) -> dict[str, list[tuple]]:
    with sqlite3.connect(home / "optdrift.db") as db:
        return {"github": db.execute("SELECT token, private_key FROM github_integrations ORDER BY id").fetchall(),
                "webhooks": db.execute("SELECT secret FROM webhooks ORDER BY id").fetchall()}


def test_home_is_0700_and_the_database_and_secret_files_are_0600(server):  # noqa: ANN001
    home: Path = server["home"]
    assert _mode(home) == 0o700
    log = server["log"].read_text()
    # Both were looser (an older version's files): tightened at start, each with a log line.
    assert f"OPTDRIFT_HOME {home} was mode 0755" in log
    assert f"secret file {home / 'optdrift.db'} was mode 0644" in log
    secret_files = ["optdrift.db", "admin-token", "worker-token", "secrets-key"]
    # SQLite made these after the start (WAL mode, writes above): they take the database's mode.
    secret_files += [name for name in ("optdrift.db-wal", "optdrift.db-shm") if (home / name).exists()]
    assert "optdrift.db-wal" in secret_files
    assert {name: oct(_mode(home / name)) for name in secret_files} == {name: "0o600" for name in secret_files}


def test_credentials_in_the_database_file_are_encrypted_old_and_new(server):  # noqa: ANN001
    from service.notify.sealing import unseal
    from service.settings import Settings

    rows = _rows(server["home"])
    stored = [value for row in rows["github"] + rows["webhooks"] for value in row if value is not None]
    assert len(stored) == 4 and all(value.startswith("fernet:") for value in stored), stored
    settings = Settings(home=server["home"])
    assert [unseal(value, settings) for value in stored] == [
        server["new_pem"], NEW_TOKEN, LEGACY_WEBHOOK_SECRET, NEW_WEBHOOK_SECRET]
    assert "encrypted 2 stored credential(s)" in server["log"].read_text()
    # No plaintext left anywhere in the file or its write-ahead log (the legacy rows' old versions
    # included: SQLite frees pages without clearing them unless told to).
    raw = b"".join((server["home"] / name).read_bytes() for name in ("optdrift.db", "optdrift.db-wal")
                   if (server["home"] / name).exists())
    for secret in (_key_material(server["legacy_pem"]), _key_material(server["new_pem"]), NEW_TOKEN,
                   LEGACY_WEBHOOK_SECRET, NEW_WEBHOOK_SECRET):
        assert secret.encode() not in raw, f"{secret[:12]}… in the database file"


def test_the_api_never_returns_a_credential(server):  # noqa: ANN001
    client = server["client"]
    answers = [client.get(path) for path in (
        "/api/v1/projects/legacy/github", "/api/v1/projects/fresh/github", "/api/v1/projects/legacy/webhooks",
        "/api/v1/projects/fresh/webhooks", "/openapi.json")]
    assert [a.status_code for a in answers] == [200] * 5
    text = "".join(a.text for a in answers)
    for secret in (_key_material(server["legacy_pem"]), _key_material(server["new_pem"]), NEW_TOKEN,
                   LEGACY_WEBHOOK_SECRET, NEW_WEBHOOK_SECRET, "fernet:"):
        assert secret not in text
    assert answers[1].json()["has_token"] is True and answers[0].json()["has_private_key"] is True


def test_the_secrets_key_rules(tmp_path):  # noqa: ANN001
    from service.notify.sealing import SecretsKeyError, ensure_key, seal, unseal
    from service.settings import Settings

    old, new = Fernet.generate_key().decode(), Fernet.generate_key().decode()
    sealed = seal("a credential", Settings(home=tmp_path, secrets_key=old))
    # Rotation: the new key first encrypts, the old one after it still decrypts.
    assert unseal(sealed, Settings(home=tmp_path, secrets_key=f"{new},{old}")) == "a credential"
    with pytest.raises(SecretsKeyError, match="does not decrypt with the configured secrets key"):
        unseal(sealed, Settings(home=tmp_path, secrets_key=new))
    with pytest.raises(SecretsKeyError, match="is not a Fernet key"):
        unseal(sealed, Settings(home=tmp_path, secrets_key="not-a-key"))
    with pytest.raises(SecretsKeyError, match="no secrets key at"):
        unseal(sealed, Settings(home=tmp_path / "elsewhere"))
    with pytest.raises(SecretsKeyError, match="does not exist"):
        ensure_key(Settings(home=tmp_path, secrets_key_file=tmp_path / "missing-key"))
    # The embedded default: one key file, 0600, made once and kept.
    home = tmp_path / "home"
    ensure_key(Settings(home=home))
    first = (home / "secrets-key").read_text()
    ensure_key(Settings(home=home))
    assert (home / "secrets-key").read_text() == first and _mode(home / "secrets-key") == 0o600
    assert not list(home.glob("*.part"))
    # A row from before encryption reads as it is until it is sealed.
    assert unseal("plaintext from before", Settings(home=home)) == "plaintext from before"


def test_the_api_stores_credentials_encrypted(api, db_session, api_settings):  # noqa: ANN001
    from sqlalchemy import text

    from tests.notify_rows import make_project

    project = make_project(db_session)
    base = f"/api/v1/projects/{project.name}"
    assert api.put(f"{base}/github", json={"repository": "octo/k", "token": NEW_TOKEN}).status_code == 200
    assert api.post(f"{base}/webhooks", json={"url": "https://h.example.org/z",
                                               "secret": NEW_WEBHOOK_SECRET}).status_code == 201
    token = db_session.execute(text("SELECT token FROM github_integrations WHERE project_id = :p"),
                               {"p": project.id}).scalar_one()
    secret = db_session.execute(text("SELECT secret FROM webhooks WHERE project_id = :p"),
                                {"p": project.id}).scalar_one()
    assert token.startswith("fernet:") and NEW_TOKEN not in token
    assert secret.startswith("fernet:") and NEW_WEBHOOK_SECRET not in secret
    # A refused credential is not echoed back in the 422 (FastAPI's validators echo their input).
    refused = api.put(f"{base}/github", json={"repository": "octo/k", "auth": "app", "app_id": "1",
                                              "private_key": "not-a-pem-but-secret-0123456789"})
    assert refused.status_code == 422 and "not a PEM private key" in refused.text
    assert "not-a-pem-but-secret" not in refused.text
    # The embedded default's key file, made 0600 at the first write (no `serve` started here).
    assert _mode(api_settings.home / "secrets-key") == 0o600
    assert os.path.getsize(api_settings.home / "secrets-key") > 40
