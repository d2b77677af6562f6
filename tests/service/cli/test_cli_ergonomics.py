"""Issue 15's everyday conventions, through the real CLI in subprocesses and the real API:
server-only commands on a client install name their extra; `--version`; `serve` prints its URL
line within seconds and explains a busy port; `ack` through the API (and the 403 wording); the
verdict tables and progress as a CI log shows them; the docs name only real settings."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from service.cli.report import ProgressLines, make_console, print_report
from service.cli.client import ApiError, OptdriftClient
from service.settings import Settings
from tests.service_fixtures import REPO_ROOT, free_port
from tests.service.api.test_metrics import _project, make_run

# What the client install lacks (`pip install optdrift`: httpx, typer, rich, pydantic only).
SERVER_PACKAGES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "celery", "psycopg", "torch", "numpy",
                   "starlette", "prometheus_client", "jinja2", "redis", "kombu")
CLIENT_INSTALL = ("import sys\n"
                  f"for name in {SERVER_PACKAGES!r}: sys.modules[name] = None  # as if not installed\n"
                  "from service.cli import app\nsys.argv[0] = 'optdrift'\napp()\n")


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "PYTHONPATH": str(REPO_ROOT), **extra})
    return env


def _client_install(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLIENT_INSTALL, *args], capture_output=True, text=True,
                          env=_env(tmp_path / "home"), cwd=tmp_path, timeout=60)


@pytest.mark.parametrize(("args", "extra"), [
    (["serve"], "server"), (["migrate"], "server"), (["token", "list"], "server"),
    (["token", "create", "--name", "x", "--scope", "admin"], "server"),
    (["worker"], "worker"), (["check", "--source", "."], "worker")])
def test_server_commands_on_the_client_install_name_their_extra(tmp_path: Path, args: list[str],
                                                                 extra: str) -> None:
    result = _client_install(tmp_path, *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("error: ") and f"pip install 'optdrift[{extra}]'" in lines[0]


def test_client_commands_still_run_on_the_client_install(tmp_path: Path) -> None:
    version = _client_install(tmp_path, "--version")
    assert version.returncode == 0 and re.fullmatch(r"optdrift \d+\.\d+\.\d+\S*\nadapter API \d+\.\d+\.\d+\n",
                                                    version.stdout), version
    down = _client_install(tmp_path, "retry", "1", "--url", f"http://127.0.0.1:{free_port()}")
    assert down.returncode == 4 and "cannot reach the optdrift service" in down.stderr, down.stderr
    assert "ack" in _client_install(tmp_path, "--help").stdout


def _serve(tmp_path: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port), "--no-worker"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                            env=_env(tmp_path / "home", OPTDRIFT_MAINTENANCE_INTERVAL_S="0"))


def test_serve_prints_its_url_line_within_seconds(tmp_path: Path) -> None:
    port = free_port()
    started = time.monotonic()
    server = _serve(tmp_path, port)
    try:
        seen = []
        for line in server.stdout:
            seen.append(line)
            if line.startswith("optdrift serving"):
                break
        elapsed = time.monotonic() - started
        assert seen and seen[-1].startswith(f"optdrift serving http://127.0.0.1:{port}/ "), seen
        assert elapsed < 30, elapsed  # the acceptance: within 30 s of `serve`
        assert "celery" not in "".join(seen).lower()  # no worker banner on the console
        import httpx

        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200  # listening when said
    finally:
        server.terminate()
        server.wait(timeout=30)


def _wait_for_url_line(server: subprocess.Popen) -> str:
    for line in server.stdout:
        if line.startswith("optdrift serving"):
            return line
    raise AssertionError(f"serve ended without its URL line: {server.wait()}")


def test_a_second_serve_on_the_same_home_refuses_and_leaves_the_first_alone(tmp_path: Path) -> None:
    """One serve per OPTDRIFT_HOME (service/cli/serve_lock.py): the second says which serve holds the
    home and exits 2 without touching its api-url file; a serve killed outright leaves no stale lock."""
    import signal

    import httpx

    first_port, second_port = free_port(), free_port()
    api_url_file = tmp_path / "home" / "api-url"
    first = _serve(tmp_path, first_port)
    try:
        _wait_for_url_line(first)
        assert api_url_file.read_text().strip() == f"http://127.0.0.1:{first_port}"
        second = _serve(tmp_path, second_port)
        try:
            output, _ = second.communicate(timeout=60)
        finally:
            if second.poll() is None:  # it started serving instead of refusing
                second.kill()
                second.wait(timeout=30)
        assert second.returncode == 2, output
        lines = output.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in output, output
        assert lines[0].startswith("error: another `optdrift serve` is running on OPTDRIFT_HOME"), lines[0]
        assert f"pid {first.pid}" in lines[0] and f"http://127.0.0.1:{first_port}" in lines[0], lines[0]
        assert "another OPTDRIFT_HOME" in lines[0], lines[0]
        # the first serve's address is still where a worker looks for it, and it still answers
        assert api_url_file.read_text().strip() == f"http://127.0.0.1:{first_port}"
        assert httpx.get(f"http://127.0.0.1:{first_port}/healthz").status_code == 200
    finally:
        first.send_signal(signal.SIGKILL)  # a crash: no cleanup runs
        first.wait(timeout=30)
    # the kernel dropped the dead serve's lock: a new serve starts and takes the api-url file over
    third = _serve(tmp_path, second_port)
    try:
        _wait_for_url_line(third)
        assert api_url_file.read_text().strip() == f"http://127.0.0.1:{second_port}"
    finally:
        third.terminate()
        third.wait(timeout=30)
    assert not api_url_file.exists()  # its own file, removed as it stopped


def test_serve_on_a_busy_port_says_which_to_pick(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        started = time.monotonic()
        server = _serve(tmp_path, port)
        output, _ = server.communicate(timeout=60)
    assert server.returncode == 2, output
    assert time.monotonic() - started < 20
    assert f"port {port} on 127.0.0.1 is already in use" in output and f"--port {port + 1}" in output
    assert "Errno" not in output and "Traceback" not in output


def _api_client(api) -> OptdriftClient:  # noqa: ANN001
    """The real client over the test app (its httpx client is the app's TestClient)."""
    client = OptdriftClient("http://testserver")
    client.http = api
    return client


def test_ack_needs_a_maintain_token_and_says_so_once(api, db_session) -> None:  # noqa: ANN001
    from service.domain.auth import create_token

    run = make_run(db_session, _project(db_session), environment="cpu", status="done", created_s_ago=60,
                   queue_s=1, build_s=1, battery_s=1, cases=1, corun_s=1.0)
    _, submit_token = create_token(session=db_session, name="ci", scope="submit")
    client = _api_client(api)
    api.headers["Authorization"] = f"Bearer {submit_token}"
    with pytest.raises(ApiError) as refused:
        client.acknowledge(run.id, note="intended")
    assert refused.value.status_code == 403
    # The scopes that may (issue 44: maintain, or admin), each named once.
    assert "needs 'maintain' or 'admin'" in refused.value.detail and "'admin' or 'admin'" not in refused.value.detail


def test_ack_by_an_admin(api, db_session) -> None:  # noqa: ANN001
    run = make_run(db_session, _project(db_session), environment="cpu", status="done", created_s_ago=60,
                   queue_s=1, build_s=1, battery_s=1, cases=1, corun_s=1.0)
    verdict = _api_client(api).acknowledge(run.id, note="the reorder is intended", by="maintainer")
    assert verdict["acknowledged"] and verdict["acknowledgement_note"] == "the reorder is intended"
    assert verdict["flagged"] is False


LONG_CASE = "adamw-float32-n4097-lr0.1-wd0.1-open-seed0-with-a-very-long-descriptive-case-identifier"
FINAL_RUN = {
    "id": 7, "commit_sha": "abc1234", "base_sha": None, "environment": "cpu", "status": "done", "error": None,
    "progress": {"cases_done": 40, "cases_total": 40},
    "verdict": {"outcome": "changed", "flagged": True, "changed_cases": 1, "first_divergent_step": 1,
                "summary": "1 case changed (farther from float64): weight decay moved after the update, the "
                           "largest |commit - baseline| 1.9e-06 at step 20",
                "detail": {"cases": [{"case_id": LONG_CASE, "verdict": "changed", "first_divergent_step": 1,
                                      "direction": "farther", "max_abs_diff_per_step": [0.0, 1.5e-6, 1.9e-6],
                                      "baseline_peak_ref64_distance": 1.25e-5,
                                      "commit_peak_ref64_distance": 1.5e-2, "message": None}]}},
}


def test_verdict_tables_in_a_log_are_full_width_with_the_change_size(capsys, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("COLUMNS", raising=False)
    console = make_console()  # stdout is captured here: not a terminal, as in CI
    assert not console.is_terminal
    print_report(console, [FINAL_RUN])
    text = capsys.readouterr().out
    assert LONG_CASE in text and "unchang…" not in text and "…" not in text
    assert FINAL_RUN["verdict"]["summary"] in text
    assert "1.900e-06" in text and "1.250e-05 → 1.500e-02" in text  # max |Δ|, float64 distance before → after


def test_progress_lines_say_cases_phase_and_elapsed() -> None:
    lines: list[str] = []
    progress = ProgressLines(lines.append, interval_s=0.0)
    queued = {**FINAL_RUN, "status": "queued", "verdict": None, "progress": {"cases_done": 0, "cases_total": None},
              "waiting_for": "no live worker for queue cpu"}
    building = {**queued, "status": "running", "waiting_for": None}
    battery = {**building, "progress": {"cases_done": 12, "cases_total": 40}}
    for state in (queued, queued, building, battery):
        progress.update([state])
    assert len(lines) == 3, lines  # the same state twice is one line
    assert lines[0].startswith("run 7: queued (no live worker for queue cpu), elapsed 0:00:0")
    assert lines[1].startswith("run 7: building, elapsed")
    assert re.fullmatch(r"run 7: running the battery, 12/40 cases, elapsed \d:\d\d:\d\d", lines[2])


def _documented_names() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for doc in [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]:
        for name in re.findall(r"\bOPTDRIFT_[A-Z0-9_]*[A-Z0-9]\b", doc.read_text()):
            found.setdefault(name, set()).add(doc.name)
    return found


def _read_by_name_in_code(name: str) -> bool:
    """An environment variable the code reads directly (the client, `check`, the build)."""
    pattern = re.compile(rf"[\"']{name}[\"']")
    return any(pattern.search(path.read_text()) for folder in ("service", "worker")
               for path in (REPO_ROOT / folder).rglob("*.py"))


def test_every_documented_optdrift_name_is_real() -> None:
    settings = {f"OPTDRIFT_{field.upper()}" for field in Settings.model_fields}
    unknown = {name: docs for name, docs in _documented_names().items()
               if name not in settings and not _read_by_name_in_code(name)}
    assert not unknown, f"named in the docs but neither a setting nor read by the code: {unknown}"


def test_the_readme_settings_paragraph_names_only_settings() -> None:
    """The paragraph that says 'settings ... (see service/settings.py)' names settings only: the
    client's and check's variables are in their own paragraph (OPTDRIFT_BUILD_CACHE was listed
    there for the worker's OPTDRIFT_BUILD_CACHE_DIR)."""
    readme = (REPO_ROOT / "README.md").read_text()
    paragraph = readme.split("## Configuration", 1)[1].strip().split("\n\n", 1)[0]
    assert "service/settings.py" in paragraph
    settings = {f"OPTDRIFT_{field.upper()}" for field in Settings.model_fields}
    named = set(re.findall(r"\bOPTDRIFT_[A-Z0-9_]*[A-Z0-9]\b", paragraph))
    assert named and named <= settings, named - settings


# Every top-level command once on the client install, with the arguments it requires and a URL
# where nothing listens: each ends in one error line (never a traceback), and the commands that
# build or run kernels on this machine name the worker extra and how to install it.
ENGINE_COMMANDS = {
    "worker": ["worker"], "check": ["check", "--source", "."], "sensitivity": ["sensitivity"],
    "adapter-check": ["adapter-check", "--adapter", "bundled", "--library", "."],
    "bisect": ["bisect", "--local", "--repo", ".", "--good", "a", "--bad", "b"],
}
OTHER_COMMANDS = {
    "migrate": ["migrate"], "serve": ["serve"], "token": ["token", "list"], "demo": ["demo"],
    "submit": ["submit", "--project", "p", "--commit", "c", "--source", "."],
    "verify": ["verify", "--project", "p", "--base", "b", "--source", "."],
    "retry": ["retry", "1"], "ack": ["ack", "1", "--note", "intended"], "speed": ["speed", "1"],
    "notify": ["notify", "deliveries", "--project", "p", "--webhook", "1"],
    "project": ["project", "show", "p"], "training": ["training", "1"],
    "compare": ["compare", "--project", "p", "--commit", "c", "--env", "cpu", "--env", "gpu.sm90"],
}


def test_the_command_table_below_covers_every_command() -> None:
    from service.cli import app

    registered = {command.name or command.callback.__name__ for command in app.registered_commands}
    registered |= {group.name for group in app.registered_groups}
    assert registered == set(ENGINE_COMMANDS) | set(OTHER_COMMANDS)


@pytest.mark.parametrize("name", sorted({**ENGINE_COMMANDS, **OTHER_COMMANDS}))
def test_every_command_on_the_client_install_fails_in_one_line(tmp_path: Path, name: str) -> None:
    args = {**ENGINE_COMMANDS, **OTHER_COMMANDS}[name]
    takes_url = name not in ENGINE_COMMANDS and name not in ("migrate", "serve", "token")
    url = ["--url", f"http://127.0.0.1:{free_port()}"] if takes_url else []
    result = _client_install(tmp_path, *args, *url)
    assert "Traceback" not in result.stderr + result.stdout, result.stderr
    assert result.returncode in (2, 4), (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    if name in ENGINE_COMMANDS:
        assert result.returncode == 2
        assert "builds and runs kernels on this machine" in lines[0], lines[0]
        assert "torch" in lines[0] and "pip install 'optdrift[worker]'" in lines[0], lines[0]


def test_serve_with_its_worker_says_the_worker_is_starting(tmp_path: Path) -> None:
    """A run submitted as soon as `serve` (with its own worker) listens waits for that worker, which
    is still starting: never "no live worker ... start one" (issue 34)."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
                              env=_env(tmp_path / "home", OPTDRIFT_MAINTENANCE_INTERVAL_S="0"))
    try:
        _wait_for_url_line(server)
        client = OptdriftClient(f"http://127.0.0.1:{port}",
                                token=(tmp_path / "home" / "admin-token").read_text().strip())
        client.ensure_project("embedded")
        source = tmp_path / "src"
        source.mkdir()
        (source / "ops.cpp").write_text("// not built: the test ends before the worker takes it\n")
        run = client.submit_commit(project="embedded", sha="c1", source_dir=source)["runs"][0]
        waiting = client.run(run["id"])["waiting_for"]
        client.close()
        assert waiting is None or waiting.startswith("the worker `optdrift serve` started for queue cpu is "
                                                     "starting"), waiting
    finally:
        server.terminate()
        server.wait(timeout=60)
