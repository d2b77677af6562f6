"""`optdrift notify`: the settings set through the CLI against the real app on a port (uvicorn in a
thread, the test's database session: tests/service_fixtures.py live_api), secrets read from files or the environment only."""

from __future__ import annotations

from typer.testing import CliRunner

from service.cli import app as cli_app
from tests.notify_rows import make_project


def test_notify_cli_sets_github_and_a_webhook_from_secret_files(live_api, db_session, admin_token, tmp_path,
                                                                 monkeypatch, api_settings):  # noqa: ANN001
    from service.db.notify_models import GitHubIntegration, Webhook
    from service.notify.sealing import unseal

    project = make_project(db_session)
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    runner = CliRunner()
    token_file = tmp_path / "gh-token"
    token_file.write_text("ghp_fromafile0123456789\n")
    done = runner.invoke(cli_app, ["notify", "github", "--project", project.name, "--repository", "octo/kernels",
                                   "--token-file", str(token_file), "--url", live_api])
    assert done.exit_code == 0, done.output
    assert "octo/kernels (token auth)" in done.output and "ghp_fromafile" not in done.output
    row = db_session.query(GitHubIntegration).filter_by(project_id=project.id).one()
    # Stored encrypted (tests/service/notify/test_secrets_at_rest.py); decrypted, the file's token.
    assert unseal(row.token, api_settings) == "ghp_fromafile0123456789"

    monkeypatch.setenv("OPTDRIFT_WEBHOOK_SECRET", "whsec-from-the-environment")
    added = runner.invoke(cli_app, ["notify", "webhook-add", "--project", project.name, "--target",
                                    "https://hooks.example.org/x", "--slack", "--event", "broken", "--url", live_api])
    assert added.exit_code == 0, added.output
    hook = db_session.query(Webhook).filter_by(project_id=project.id).one()
    assert (unseal(hook.secret, api_settings), hook.events, hook.payload_format) == (
        "whsec-from-the-environment", ["broken"], "slack")
    listed = runner.invoke(cli_app, ["notify", "deliveries", "--project", project.name, "--webhook", str(hook.id),
                                     "--url", live_api])
    assert listed.exit_code == 0 and listed.output == ""

    # A missing secret and a refused request: one line, exit 2.
    monkeypatch.delenv("OPTDRIFT_GITHUB_TOKEN", raising=False)
    missing = runner.invoke(cli_app, ["notify", "github", "--project", project.name, "--repository", "o/r",
                                      "--url", live_api])
    assert missing.exit_code == 2 and "set OPTDRIFT_GITHUB_TOKEN or pass --token-file" in missing.output
    unknown = runner.invoke(cli_app, ["notify", "github", "--project", "no-such-project", "--repository", "o/r",
                                      "--token-file", str(token_file), "--url", live_api])
    assert unknown.exit_code == 2 and "unknown project 'no-such-project'" in unknown.output
