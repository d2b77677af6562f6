"""Known secrets never stored (service/domain/redaction.py), and what is stored of submitted code's
output stays bounded (worker/sandbox/log_tail.py; service/domain/runs.py and trajectories.py clip it).

Defence in depth behind the sandbox: these tests plant the secrets where the worker process knows
them and store, through the real functions on the real PostgreSQL, text that quotes them."""

from __future__ import annotations

from pathlib import Path

from service.db.models import Run, Trajectory
from service.domain import redaction, runs, trajectories
from service.core.results import CaseResult, CaseSpec
from service.settings import Settings
from tests.service.domain.test_db_runs import _commit_run
from worker.sandbox import log_tail

ADMIN = "odt_canary_admin_token_abcdefghijklmnop"
WORKER = "odt_canary_worker_token_qrstuvwxyz012345"
DB_PASSWORD = "canary-db-p@ss/word"
DB_URL = "postgresql+psycopg://optdrift:canary-db-p%40ss%2Fword@db.internal:5432/optdrift"


def _settings(tmp_path: Path) -> Settings:
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin-token").write_text(ADMIN + "\n")
    (home / "worker-token").write_text(WORKER)
    return Settings(home=home, database_url=DB_URL, broker_url="redis://:canary-broker-pw@redis:6379/0")


def test_known_secrets_are_the_tokens_the_url_passwords_and_secret_named_variables(tmp_path) -> None:
    secrets = redaction.known_secrets(_settings(tmp_path), environ={
        "AWS_SECRET_ACCESS_KEY": "canary-aws-secret", "MY_API_TOKEN": "canary-api-token",
        "PATH": "/usr/bin:/bin", "SHORT_TOKEN": "1234"})
    for value in (ADMIN, WORKER, DB_PASSWORD, DB_URL, "canary-broker-pw", "canary-aws-secret", "canary-api-token"):
        assert value in secrets, value
    assert "/usr/bin:/bin" not in secrets and "1234" not in secrets  # not secret / too short to match safely
    text = f"build failed: read {ADMIN}; connected to {DB_URL}; password {DB_PASSWORD}"
    scrubbed = redaction.scrub(text, secrets)
    assert ADMIN not in scrubbed and DB_PASSWORD not in scrubbed and "canary" not in scrubbed
    assert scrubbed.count(redaction.REDACTED) == 3 and scrubbed.startswith("build failed: read ")
    assert redaction.scrub_json({"a": [text], "n": 1}, secrets) == {"a": [scrubbed], "n": 1}


def test_what_a_run_stores_is_scrubbed_and_bounded(db_session, api_settings, tmp_path, monkeypatch) -> None:
    # The worker process's settings (get_settings) know the secrets; the session is the test's.
    settings = _settings(tmp_path)
    monkeypatch.setattr("service.settings.get_settings", lambda: settings)
    redaction.forget_cached_secrets()
    run = _commit_run(db_session, api_settings, "leaky", [])
    assert runs.claim(session=db_session, run_id=run.id, worker="w")
    assert runs.heartbeat(session=db_session, run_id=run.id, worker="w",
                          build_log=f"$ cat admin-token\n{ADMIN}\n" + "x" * 1_000_000,
                          environment_detail={"build_error": f"leaked {WORKER}"})
    case = CaseSpec(case_id="adam-1", optimizer="adam", hyper={"lr": 0.1}, seed=0, size=8, steps=1)
    trajectories.store_case_result(session=db_session, run_id=run.id, case_index=0, result=CaseResult(
        case=case, status="broken", message=f"kernel host crashed: {DB_URL} " + "y" * 10_000_000))
    runs.set_status(session=db_session, run_id=run.id, worker="w", status="failed",
                    error=f"build failed: {ADMIN} " + "z" * 5_000_000)
    redaction.forget_cached_secrets()
    stored = db_session.get(Run, run.id)
    db_session.refresh(stored)
    row = db_session.query(Trajectory).filter_by(run_id=run.id).one()
    for text in (stored.build_log, stored.error, str(stored.environment_detail), row.error):
        assert ADMIN not in text and WORKER not in text and DB_PASSWORD not in text and DB_URL not in text
    assert len(stored.build_log) <= runs.MAX_BUILD_LOG_CHARS + 100
    assert len(stored.error) <= runs.MAX_ERROR_CHARS + 100 and stored.error.startswith("build failed: [redacted]")
    assert len(row.error) <= trajectories.MAX_CASE_ERROR_CHARS + 100
    assert "characters not kept" in row.error


def test_log_tails_are_bounded_whatever_was_printed(tmp_path) -> None:
    log = tmp_path / "build.log"
    log.write_bytes(b"first line\n" + b"A" * (50 * 1024**2) + b"\nerror: the last line\n")
    tail = log_tail.tail_text(log, 4096)
    assert tail.startswith("[... ") and tail.endswith("error: the last line\n") and len(tail) < 4200
    clipped = log_tail.clip_lines("B" * 10_000_000 + "\nshort", max_line_chars=100, max_chars=500)
    assert len(clipped) < 500 and clipped.endswith("short") and "more characters" in clipped
    log_tail.keep_tail(log, 1024 * 1024)
    assert log.stat().st_size <= 1024 * 1024 + 100 and log.read_text().endswith("error: the last line\n")
