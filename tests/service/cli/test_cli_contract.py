"""The CLI's contract with CI, through the real `optdrift` executable: exit codes (README "Exit
codes"), one-line errors without a traceback, source conflicts, patches from either root, the
dashboard URL, `retry`, and serve's api-url file that lets a worker find the API.

The server is a real `optdrift serve --no-worker` on the embedded default (SQLite under a temporary
OPTDRIFT_HOME). Runs are brought to their final states by writing the rows a worker writes (status,
error, verdict) into that database: the CLI under test then reads them over HTTP like any run.
"""

from __future__ import annotations

import http.server
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service_fixtures import REPO_ROOT, free_port, wait_http

OPTDRIFT = Path(sys.executable).with_name("optdrift")
VERDICT_CODES_LINE = ("Exit codes: 0 unchanged / acknowledged / no baseline allowed by --allow-no-baseline; 1 changed; "
                      "2 bad input")
SOURCE = {"ops.cpp": "// adam\nint step() { return 1; }\n", "cpu/adam.cpp": "int adam = 1;\n"}


def optdrift(home: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The installed `optdrift` executable, with only this test's OPTDRIFT_ settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "COLUMNS": "200"})
    return subprocess.run([str(OPTDRIFT), *args], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    """The single line an expected failure prints; fails on a traceback or several lines."""
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def write_tree(folder: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


# ----------------------------------------------------------------------------- no server
@pytest.mark.parametrize("command", [["submit"], ["verify"], ["retry"], ["check"]])
def test_help_of_each_verdict_command_lists_every_exit_code(tmp_path: Path, command: list[str]) -> None:
    result = optdrift(tmp_path, *command, "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert VERDICT_CODES_LINE in text
    for code in ("3 broken commit", "4 optdrift or service error", "5 nondeterministic", "7 no baseline"):
        assert code in text, (command, code)


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["migrate"], ["demo"], ["token", "create"]])
def test_help_of_each_server_command_lists_its_exit_codes(tmp_path: Path, command: list[str]) -> None:
    result = optdrift(tmp_path, *command, "--help")
    assert result.returncode == 0
    assert "Exit codes: 0 done; 2 bad input or usage; 4 optdrift error." in " ".join(result.stdout.split())


def test_server_down_is_one_line_and_exit_4(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    source = write_tree(tmp_path / "src", SOURCE)
    result = optdrift(tmp_path, "submit", "--project", "p", "--commit", "c1", "--source", str(source),
                      "--url", url)
    assert result.returncode == 4
    line = one_error_line(result)
    assert "cannot reach the optdrift service at " + url in line and "OPTDRIFT_URL" in line
    result = optdrift(tmp_path, "retry", "7", "--url", url)
    assert result.returncode == 4 and "cannot reach" in one_error_line(result)


def test_bad_input_is_one_line_naming_it_and_exit_2(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # refused before any request is made
    missing_patch = tmp_path / "nope.diff"
    result = optdrift(tmp_path, "verify", "--project", "p", "--base", "b", "--patch", str(missing_patch),
                      "--url", url)
    assert result.returncode == 2 and str(missing_patch) in one_error_line(result)
    result = optdrift(tmp_path, "submit", "--project", "p", "--commit", "c", "--source",
                      str(tmp_path / "gone"), "--url", url)
    line = one_error_line(result)
    assert result.returncode == 2 and "--source" in line and "gone" in line and "not a folder" in line
    result = optdrift(tmp_path, "verify", "--project", "p", "--base", "b", "--url", url)
    assert result.returncode == 2 and "exactly one of --source DIR or --patch FILE" in one_error_line(result)
    a_file = write_tree(tmp_path / "t", {"f.diff": ""}) / "f.diff"
    result = optdrift(tmp_path, "verify", "--project", "p", "--base", "b", "--source", str(a_file),
                      "--url", url)
    assert result.returncode == 2 and "not a folder" in one_error_line(result)
    result = optdrift(tmp_path, "submit", "--project", "p")  # usage: a required option missing
    assert result.returncode == 2 and "Traceback" not in result.stderr


def _cuda_visible() -> bool:
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe]).returncode == 0


def test_check_on_cuda_without_a_gpu_exits_2_at_once(tmp_path: Path) -> None:
    if _cuda_visible():
        pytest.skip("a GPU is visible here")
    started = time.monotonic()
    result = optdrift(tmp_path, "check", "--source", str(REPO_ROOT / "csrc"), "--device", "cuda")
    elapsed = time.monotonic() - started
    assert result.returncode == 2
    assert "no CUDA GPU is visible" in one_error_line(result) and "--device cpu" in result.stderr
    assert elapsed < 60, elapsed  # no build, no battery


class _BadGateway(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        self._answer()

    def do_POST(self) -> None:  # noqa: N802
        self._answer()

    def _answer(self) -> None:
        body = b'{"detail": "upstream API is down"}'
        self.send_response(502)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_5xx_answer_is_a_service_error_exit_4(tmp_path: Path) -> None:
    """A proxy in front of the API answering 502 (the API behind it down): optdrift's side, 4."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BadGateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = optdrift(tmp_path, "retry", "3", "--url", url)
        assert result.returncode == 4
        assert "502: upstream API is down" in one_error_line(result)
    finally:
        server.shutdown()


# ----------------------------------------------------------------------------- a real server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    home = tmp_path_factory.mktemp("cli-contract") / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0"})
    log = open(home.parent / "serve.log", "wb")  # noqa: SIM115
    process = subprocess.Popen([str(OPTDRIFT), "serve", "--port", str(port), "--no-worker"],
                               cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/healthz", timeout_s=90)
        yield {"url": url, "home": home, "process": process, "port": port,
               "database_url": f"sqlite:///{home / 'optdrift.db'}"}
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        log.close()


def _project(server: dict, name: str) -> None:
    from service.cli.client import OptdriftClient

    client = OptdriftClient(server["url"], token=(server["home"] / "admin-token").read_text().strip())
    client.ensure_project(name)
    client.close()


def _finish_run(server: dict, run_id: int, *, status: str, outcome: str | None = None,
                error: str | None = None, acknowledged: bool = False) -> None:
    """Write what a worker writes at the end of a run: its status and error, and its verdict."""
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.db.base import utcnow
    from service.db.models import Run, Verdict
    from service.core.results import CaseComparison, RunComparison

    cases = [CaseComparison(case_id="adam-fp32-a1", optimizer="adam",
                            verdict={"changed": "changed", "nondeterministic": "nondeterministic",
                                     "broken": "broken"}.get(outcome, "unchanged"),
                            first_divergent_step=1 if outcome in ("changed", "nondeterministic") else None),
             CaseComparison(case_id="adam-bf16-a2", optimizer="adam", verdict="not_applicable",
                            message="libcapi has no bf16 32-bit adam kernel")]
    engine = create_engine(server["database_url"])
    with Session(engine) as session:
        run = session.get(Run, run_id)
        run.status, run.error, run.finished_at = status, error, utcnow()
        if outcome is not None:
            comparison = RunComparison(verdict=outcome, summary=f"{outcome.upper()}: test", battery_digest="b",
                                       cases=cases)
            session.add(Verdict(run_id=run_id, outcome=outcome, detail=comparison.model_dump(mode="json"),
                                flagged=outcome in ("changed", "broken", "nondeterministic") and not acknowledged,
                                changed_cases=int(outcome == "changed"), acknowledged=acknowledged,
                                first_divergent_step=1 if outcome == "changed" else None))
        session.commit()
    engine.dispose()


@pytest.mark.parametrize(("status", "outcome", "error", "acknowledged", "code", "options"), [
    ("done", "unchanged", None, False, 0, []),
    # Nothing to compare with fails (issue 44), unless the submission allowed it (a first commit).
    ("done", "no-baseline", None, False, 7, []),
    ("done", "no-baseline", None, False, 0, ["--allow-no-baseline"]),
    ("done", "changed", None, True, 0, []),
    ("done", "changed", None, False, 1, []),
    ("failed", "broken", "segfault in adam_step", False, 3, []),
    ("error", None, "source fetch refused: 401 from http://127.0.0.1:8000", False, 4, []),
    ("done", "nondeterministic", None, False, 5, []),
])
def test_submit_wait_exits_with_the_runs_code(server: dict, tmp_path: Path, status: str,
                                              outcome: str | None, error: str | None,
                                              acknowledged: bool, code: int, options: list[str]) -> None:
    project = f"codes-{status}-{outcome}-{int(acknowledged)}-{len(options)}"
    _project(server, project)
    source = write_tree(tmp_path / "src", {**SOURCE, "variant.cpp": project})
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(server["home"]), "COLUMNS": "200"})
    # The CLI waits on the queued run (no worker here); the run then ends as a worker would end it.
    waiting = subprocess.Popen([str(OPTDRIFT), "submit", "--project", project, "--commit", "c1", "--source",
                                str(source), "--url", server["url"], "--wait", "--no-training", *options], cwd=REPO_ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while True:
        commits = httpx.get(f"{server['url']}/api/v1/projects/{project}/commits").json()["data"]
        if commits and commits[0]["runs"]:
            break
        assert time.monotonic() < deadline and waiting.poll() is None, waiting.communicate()
        time.sleep(0.2)
    run_id = commits[0]["runs"][0]["id"]
    _finish_run(server, run_id, status=status, outcome=outcome, error=error, acknowledged=acknowledged)
    stdout, stderr = waiting.communicate(timeout=60)
    assert waiting.returncode == code, (stdout, stderr)
    # The dashboard's HTML page of the run, not its JSON.
    page_url = f"{server['url']}/runs/{run_id}"
    assert f"run {run_id}: {page_url}" in stdout
    page = httpx.get(page_url)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    if status == "error":  # optdrift's failure, with the run's error and what to do
        assert f"run {run_id} failed in optdrift, not in the commit: source fetch refused" in stderr
        assert f"optdrift retry {run_id}" in stderr
    else:
        assert "Traceback" not in stderr and "libcapi has no bf16" in stdout


def test_same_sha_with_other_source_is_a_409_naming_both_digests_exit_2(server: dict, tmp_path: Path) -> None:
    from service.core.archives import pack_directory, sha256_hex

    _project(server, "conflict")
    first_tree = write_tree(tmp_path / "first", SOURCE)
    other_tree = write_tree(tmp_path / "other", {**SOURCE, "ops.cpp": "// someone force-pushed\n"})
    args = ("submit", "--project", "conflict", "--commit", "c1", "--url", server["url"], "--source")
    assert optdrift(server["home"], *args, str(first_tree)).returncode == 0
    # The CLI sends the same Idempotency-Key (project:sha:battery) both times: the key must not hide it.
    result = optdrift(server["home"], *args, str(other_tree))
    assert result.returncode == 2, (result.stdout, result.stderr)
    line = one_error_line(result)
    assert "409" in line and "cannot change" in line
    assert sha256_hex(pack_directory(first_tree)) in line and sha256_hex(pack_directory(other_tree)) in line
    again = optdrift(server["home"], *args, str(first_tree))
    assert again.returncode == 0 and "already submitted" in again.stdout


def test_http_4xx_is_exit_2_with_the_servers_detail(server: dict, tmp_path: Path) -> None:
    _project(server, "fourxx")
    patch = tmp_path / "x.diff"
    patch.write_text("diff --git a/a b/a\n")
    result = optdrift(server["home"], "verify", "--project", "fourxx", "--base", "nosuchsha", "--patch",
                      str(patch), "--url", server["url"])
    assert result.returncode == 2
    assert "404" in one_error_line(result) and "has no commit or release 'nosuchsha'" in result.stderr


def _git_diff(repo: Path, *args: str) -> bytes:
    return subprocess.run(["git", "-C", str(repo), "diff", *args], capture_output=True, check=True).stdout


def test_verify_accepts_repository_root_and_source_folder_patches(server: dict, tmp_path: Path) -> None:
    """The base is submitted as the source folder (`--source csrc`); a plain `git diff` from the
    repository root and a `git diff --relative=csrc` both apply, and the CLI says which was used."""
    repo = tmp_path / "repo"
    write_tree(repo / "csrc", SOURCE)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm",
                    "base"], check=True)
    _project(server, "patches")
    base = optdrift(server["home"], "submit", "--project", "patches", "--commit", "base1", "--source",
                    str(repo / "csrc"), "--url", server["url"])
    assert base.returncode == 0, base.stderr
    (repo / "csrc" / "cpu" / "adam.cpp").write_text("int adam = 2;  // decay after the update\n")
    for name, diff, said in (("root.diff", _git_diff(repo), "leading folder 'csrc/' removed"),
                             ("relative.diff", _git_diff(repo, "--relative=csrc"), "applied as given")):
        (tmp_path / name).write_bytes(diff)
        result = optdrift(server["home"], "verify", "--project", "patches", "--base", "base1", "--patch",
                          str(tmp_path / name), "--no-wait", "--url", server["url"])
        assert result.returncode == 0, (name, result.stdout, result.stderr)
        assert said in " ".join(result.stdout.split()), (name, result.stdout)
        run_id = int(re.search(r"verify run (\d+): ", result.stdout).group(1))
        assert f"verify run {run_id}: {server['url']}/runs/{run_id}" in result.stdout
    unrelated = tmp_path / "unrelated.diff"
    unrelated.write_bytes(_git_diff(repo).replace(b"adam.cpp", b"lion.cpp"))
    result = optdrift(server["home"], "verify", "--project", "patches", "--base", "base1", "--patch",
                      str(unrelated), "--no-wait", "--url", server["url"])
    assert result.returncode == 2
    line = one_error_line(result)
    assert "patch does not apply" in line and "tried: as given; with its leading folder 'csrc/' removed" in line


def test_retry_requeues_an_errored_run_and_refuses_others(server: dict, tmp_path: Path) -> None:
    _project(server, "retry")
    source = write_tree(tmp_path / "src", SOURCE)
    first = optdrift(server["home"], "submit", "--project", "retry", "--commit", "c1", "--source", str(source),
                     "--url", server["url"])
    run_id = int(re.search(r"run (\d+): ", first.stdout).group(1))
    refused = optdrift(server["home"], "retry", str(run_id), "--url", server["url"])
    assert refused.returncode == 2 and "409" in one_error_line(refused)
    _finish_run(server, run_id, status="error", error="lost worker")
    retried = optdrift(server["home"], "retry", str(run_id), "--url", server["url"])
    assert retried.returncode == 0, retried.stderr
    assert f"run {run_id} queued again: {server['url']}/runs/{run_id}" in retried.stdout
    assert httpx.get(f"{server['url']}/api/v1/runs/{run_id}").json()["status"] == "queued"
    missing = optdrift(server["home"], "retry", "999999", "--url", server["url"])
    assert missing.returncode == 2 and "404" in one_error_line(missing)


def test_serve_writes_its_url_for_workers_of_the_same_home_and_removes_it(tmp_path: Path) -> None:
    """A worker started apart from the same OPTDRIFT_HOME fetches from the port serve listens on."""
    from service.settings import Settings

    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env["OPTDRIFT_HOME"] = str(home)
    process = subprocess.Popen([str(OPTDRIFT), "serve", "--port", str(port), "--no-worker"], cwd=REPO_ROOT,
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=90)
        assert (home / "api-url").read_text().strip() == f"http://127.0.0.1:{port}"
        assert Settings(home=home).resolved_public_url == f"http://127.0.0.1:{port}"
        # OPTDRIFT_PUBLIC_URL still wins: workers on other hosts reach the API by its public name.
        assert Settings(home=home, public_url="http://api.internal:9000").resolved_public_url == \
            "http://api.internal:9000"
        # ...and an empty one (a compose file's `${OPTDRIFT_PUBLIC_URL:-}`) is no setting at all.
        assert Settings(home=home, public_url="").resolved_public_url == f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=30)
    assert not (home / "api-url").exists()
    assert Settings(home=home).resolved_public_url == "http://127.0.0.1:8000"


def test_a_source_folder_patch_applies_inside_a_repository_root_tree(tmp_path: Path) -> None:
    """The other way round: the stored tree is the repository root (optdrift.toml with
    build.source_dir), the patch was made with `git diff --relative=csrc`."""
    from service.domain.patch_layout import apply_patch_any_root
    from service.domain.patches import PatchLimits

    repo = write_tree(tmp_path / "repo", {"optdrift.toml": '[build]\nsource_dir = "csrc"\n',
                                          **{f"csrc/{name}": text for name, text in SOURCE.items()}})
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm",
                    "base"], check=True)
    (repo / "csrc" / "cpu" / "adam.cpp").write_text("int adam = 3;\n")
    patch = tmp_path / "relative.diff"
    patch.write_bytes(_git_diff(repo, "--relative=csrc"))
    subprocess.run(["git", "-C", str(repo), "checkout", "-q", "--", "."], check=True)
    limits = PatchLimits(max_file_bytes=1 << 20, max_total_bytes=1 << 20)
    said = apply_patch_any_root(tree=repo, patch_file=patch, limits=limits)
    assert "inside 'csrc/'" in said and (repo / "csrc" / "cpu" / "adam.cpp").read_text() == "int adam = 3;\n"


@pytest.mark.slow
def test_a_worker_started_apart_fetches_from_serves_port(tmp_path: Path) -> None:
    """serve on a port other than 8000 and `optdrift worker` from the same OPTDRIFT_HOME, no
    OPTDRIFT_PUBLIC_URL: the worker fetches the source (a fetch from the wrong port would end the
    run in `error`, exit 4), builds it, and the commit's syntax error is its own fault: exit 3."""
    home = tmp_path / "home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPTDRIFT_")}
    env.update({"OPTDRIFT_HOME": str(home), "OPTDRIFT_ALLOW_UNSANDBOXED": "1",
                "OPTDRIFT_BUILD_CACHE": str(tmp_path / "builds")})
    processes = [subprocess.Popen([str(OPTDRIFT), "serve", "--port", str(port), "--no-worker"], cwd=REPO_ROOT,
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)]
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=90)
        processes.append(subprocess.Popen([str(OPTDRIFT), "worker", "--pool", "solo"], cwd=REPO_ROOT, env=env,
                                          stdout=open(tmp_path / "worker.log", "wb"),  # noqa: SIM115
                                          stderr=subprocess.STDOUT, start_new_session=True))
        source = write_tree(tmp_path / "src", {"cpu/broken.cpp": "int optdrift_broken( { return 0; }\n"})
        _project({"url": f"http://127.0.0.1:{port}", "home": home}, "apart")
        result = optdrift(home, "submit", "--project", "apart", "--commit", "c1", "--source", str(source),
                          "--wait", "--no-training", "--url", f"http://127.0.0.1:{port}", timeout=600)
        assert result.returncode == 3, (result.stdout, result.stderr, (tmp_path / "worker.log").read_text()[-3000:])
    finally:
        for process in reversed(processes):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.mark.parametrize(("outcome", "why"), [("unchanged", "its verdict is unchanged"),
                                              ("no-baseline", "it has no baseline to change from")])
def test_ack_refuses_a_run_with_nothing_to_acknowledge(server: dict, tmp_path: Path, outcome: str,
                                                       why: str) -> None:
    """Only a flagging verdict can be declared intended: `ack` of an unchanged or no-baseline run is
    a 409 whose detail says why, and the CLI's exit 2; the run stays unacknowledged. A changed run
    of the same commit, and the commit route, still acknowledge what flags."""
    from service.cli.client import OptdriftClient

    project = f"ack-{outcome}"
    _project(server, project)
    client = OptdriftClient(server["url"], token=(server["home"] / "admin-token").read_text().strip())
    source = write_tree(tmp_path / "src", {**SOURCE, "variant.cpp": project})
    run_ids = {}
    for sha, result in (("quiet", outcome), ("moved", "changed")):
        submitted = client.submit_commit(project=project, sha=sha, source_dir=source)
        run_ids[sha] = submitted["runs"][0]["id"]
        _finish_run(server, run_ids[sha], status="done", outcome=result)

    refused = optdrift(server["home"], "ack", str(run_ids["quiet"]), "--note", "intended", "--url", server["url"])
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    line = one_error_line(refused)
    assert f"run {run_ids['quiet']} has nothing to acknowledge: {why}" in line, line
    assert "changed, broken or nondeterministic" in line, line
    commit_route = client.http.post(f"/api/v1/projects/{project}/commits/quiet/acknowledge", json={"note": "x"})
    assert commit_route.status_code == 409 and why in commit_route.json()["detail"], commit_route.text
    assert client.run(run_ids["quiet"])["verdict"]["acknowledged"] is False

    accepted = optdrift(server["home"], "ack", str(run_ids["moved"]), "--note", "intended", "--url", server["url"])
    assert accepted.returncode == 0, (accepted.stdout, accepted.stderr)
    assert client.run(run_ids["moved"])["verdict"]["acknowledged"] is True
    client.close()
