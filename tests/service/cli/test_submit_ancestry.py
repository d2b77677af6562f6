"""`optdrift submit` sends the commit's first-parent ancestry read with git from the clone holding
--source (issue 44: the service then finds the nearest submitted ancestor however many commits were
never submitted), and --allow-no-baseline; against the real app on a port over the test's
PostgreSQL session (tests/service_fixtures.py live_api)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from sqlalchemy import select
from typer.testing import CliRunner

from service.cli import app as cli_app
from service.db.models import Commit, Run
from service.domain import projects


def _git(repo: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "HOME": str(repo.parent), "PATH": "/usr/bin:/bin"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout.strip()


def _history(repo: Path, commits: int) -> list[str]:
    """A clone whose kernel folder `src` changes in each of `commits` commits; their shas, oldest first."""
    (repo / "src").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    shas = []
    for index in range(commits):
        (repo / "src" / "ops.cpp").write_text(f"// version {index}\n")
        _git(repo, "add", "src")
        _git(repo, "commit", "-q", "-m", f"version {index}")
        shas.append(_git(repo, "rev-parse", "HEAD"))
    return shas


def test_submit_sends_the_first_parent_ancestry_and_allow_no_baseline(live_api, db_session, admin_token,  # noqa: ANN001
                                                                       tmp_path, monkeypatch) -> None:
    projects.create(session=db_session, name="kern")
    db_session.flush()
    shas = _history(tmp_path / "repo", 5)
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    runner = CliRunner()
    head = shas[-1]
    done = runner.invoke(cli_app, ["submit", "--project", "kern", "--commit", head, "--parent", shas[-2],
                                   "--source", str(tmp_path / "repo" / "src"), "--url", live_api,
                                   "--allow-no-baseline"])
    assert done.exit_code == 0, done.output
    commit = db_session.scalar(select(Commit).where(Commit.sha == head))
    db_session.refresh(commit)
    assert commit.ancestry == list(reversed(shas[:-1]))  # nearest first, the commit itself left out
    run = db_session.scalar(select(Run).where(Run.commit_id == commit.id))
    assert run.allow_no_baseline is True

    # A folder that is no clone sends none, silently; a clone without the commit says what to fetch.
    exported = tmp_path / "exported"
    exported.mkdir()
    (exported / "ops.cpp").write_text("// exported\n")
    plain = runner.invoke(cli_app, ["submit", "--project", "kern", "--commit", "e" * 40, "--source", str(exported),
                                    "--url", live_api])
    assert plain.exit_code == 0 and "ancestry" not in plain.output, plain.output
    assert db_session.scalar(select(Commit.ancestry).where(Commit.sha == "e" * 40)) is None
    missing = runner.invoke(cli_app, ["submit", "--project", "kern", "--commit", "f" * 40, "--source",
                                      str(tmp_path / "repo" / "src"), "--url", live_api])
    assert missing.exit_code == 0, missing.output
    assert "note: no ancestry sent" in missing.output and "git fetch --deepen=200" in missing.output
