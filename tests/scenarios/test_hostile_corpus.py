"""Issue 13's hostile corpus: every attack through the real API and a real worker, none of them
gets a secret out, leaves a process behind, writes outside its box or ends without a reason.

One service for the module, in the production shape: `optdrift serve --no-worker` on PostgreSQL
and Redis, and a separate `optdrift worker` (Celery, prefork) whose world is full of canary
secrets — its environment (OPTDRIFT_DATABASE_URL with a canary password: PostgreSQL trusts
127.0.0.1 here, so the password is never checked and the URL still works; AWS_SECRET_ACCESS_KEY; an
OPTDRIFT_* variable; the real worker token), OPTDRIFT_HOME (the real admin-token and worker-token
files, a secrets.env) and its HOME (.aws/credentials, .pgpass). Attacks come with the lowest trust
there is, a verify token (`optdrift token create --scope verify --project hostile`), except where
only the commit route has the field (a submit token).

The attacks are tests/fixtures/hostile/corpus.py. For each, the test checks what anyone can read
afterwards without a token — the run (GET /api/v1/runs/{id}, its verdict included), its build log,
its trajectory rows (list, CSV, one case, the dashboard's series), the dashboard's run page, the
commit's pages — for every canary (and 16-character pieces of each: issue 13's first leak gave 45
of 47 characters), for "PWNED" (a payload that got through), for stored text over a bound; that no
process of the attack is left (its marker number); that nothing was written outside (files, tables,
Redis keys named after the marker); and that the attempt ended with a reason: a 4xx with a detail,
or a final run with a non-empty error (or, for a run that reached its cases, every case broken with
a message).
"""

from __future__ import annotations

import fnmatch
import os
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import httpx
import psycopg
import pytest
import redis

from tests.fixtures.hostile.corpus import ATTACKS, COMMAND_TOML, Attack, Target
from tests.processes import matching, wait_gone
from tests.service_fixtures import (
    PG_HOST_URL, REPO_ROOT, create_database, drop_database, free_port, make_archive, start_process,
    stop_process, wait_http,
)

pytestmark = pytest.mark.slow

PROJECT = "hostile"
# The API tests use Redis db 14, the end-to-end tests 13; another copy of this file running at the
# same time (an older checkout, to show the corpus failing without the defences) takes its own.
REDIS_DB = int(os.environ.get("OPTDRIFT_TEST_HOSTILE_REDIS_DB", "11"))
FINAL = ("done", "failed", "cancelled")
# What a stored error, a trajectory's message and a served build log may grow to, whatever the
# submitted code prints (the worker keeps 200 000 characters of a build log).
MAX_ERROR_CHARS = 64 * 1024
MAX_LOG_CHARS = 1024 * 1024
# What a run may leave on the worker's disk in one file (a failed build's log is kept for people to
# read): a verify token's daily quota of runs must not fill the disk.
MAX_KEPT_FILE_BYTES = 64 * 1024 * 1024
REFUSALS = (400, 404, 409, 413, 422)
# The verify budgets of the test's worker (service/settings.py): small, so a hang costs seconds.
VERIFY_BUDGETS = {"OPTDRIFT_VERIFY_MAX_BUILD_S": "8", "OPTDRIFT_VERIFY_CASE_TIMEOUT_S": "6",
                  "OPTDRIFT_VERIFY_MAX_RUN_S": "40", "OPTDRIFT_VERIFY_BUILD_MAX_BYTES": str(400 * 1024 ** 2)}
# `sleep 4713107`: a number no other process on the machine uses (nor a copy on another Redis db)
FIRST_MARKER = 4_700_100 + 1000 * REDIS_DB


def _canary(kind: str) -> str:
    return f"canary{kind}{secrets.token_hex(16)}"


@dataclass
class World:
    url: str
    target: Target
    tmp: Path
    http: httpx.Client
    verify_token: str
    submit_token: str
    base_sha: str
    secrets: dict[str, str] = field(default_factory=dict)   # name -> value; none may ever be served
    worker: subprocess.Popen | None = None
    # Canary files (0600, the worker's secrets and one outside everything): their sha256 and mtime
    # must never change, whatever a box plants for the worker to write through.
    canary_files: dict[Path, tuple[str, int]] = field(default_factory=dict)

    def changed_canaries(self) -> list[str]:
        return [f"{path} ({'gone' if now is None else 'changed'})" for path, was in self.canary_files.items()
                if (now := _fingerprint(path)) != was]

    def log_tail(self, name: str = "worker.log", chars: int = 3000) -> str:
        path = self.tmp / name
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""


def _fingerprint(path: Path) -> tuple[str, int] | None:
    import hashlib

    try:
        return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns
    except OSError:
        return None


def _create_token(env: dict[str, str], scope: str) -> str:
    answer = subprocess.run(
        [sys.executable, "-m", "service.cli", "token", "create", "--name", f"hostile-{scope}", "--scope", scope,
         "--project", PROJECT, "--daily-quota", "10000"],
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **env}, capture_output=True,
        text=True, timeout=120, check=True)
    return answer.stdout.strip().splitlines()[-1]


def _plant(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(0o600)


def _wait_final(http: httpx.Client, run_id: int, timeout_s: float) -> dict | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = http.get(f"/api/v1/runs/{run_id}").json()
        if run["status"] in FINAL:
            return run
        time.sleep(0.3)
    return None


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("hostile")
    home, worker_home, build_cache = tmp / "home", tmp / "worker-home", tmp / "build-cache"
    for folder in (home, worker_home, build_cache):
        folder.mkdir()
    db_name = f"optdrift_hostile_{os.getpid()}"
    database_password = _canary("dbpassword")
    plain_url = create_database(db_name)
    database_url = plain_url.replace("postgresql+psycopg://postgres@", f"postgresql+psycopg://postgres:{database_password}@")
    assert database_password in database_url
    broker_url = f"redis://127.0.0.1:6379/{REDIS_DB}"
    redis.Redis.from_url(broker_url).flushdb()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    canaries = {"database password": database_password, "AWS_SECRET_ACCESS_KEY": _canary("aws"),
                "OPTDRIFT_CANARY_SECRET": _canary("optdriftenv"), "OPTDRIFT_HOME/secrets.env": _canary("homefile"),
                "HOME/.aws/credentials": _canary("awsfile")}
    _plant(home / "secrets.env", f"OPTDRIFT_SIGNING_KEY={canaries['OPTDRIFT_HOME/secrets.env']}\n")
    _plant(worker_home / ".aws" / "credentials",
           f"[default]\naws_access_key_id = AKIAHOSTILECANARY\naws_secret_access_key = {canaries['HOME/.aws/credentials']}\n")
    _plant(worker_home / ".pgpass", f"127.0.0.1:5432:*:postgres:{database_password}\n")
    service_env = {
        "OPTDRIFT_HOME": str(home), "OPTDRIFT_DATABASE_URL": database_url, "OPTDRIFT_BROKER_URL": broker_url,
        "OPTDRIFT_PUBLIC_URL": url, "OPTDRIFT_BUILD_CACHE_DIR": str(build_cache),
        "OPTDRIFT_MAINTENANCE_INTERVAL_S": "2", "OPTDRIFT_HEARTBEAT_INTERVAL_S": "2",
        "OPTDRIFT_CANARY_SECRET": canaries["OPTDRIFT_CANARY_SECRET"],
        "AWS_ACCESS_KEY_ID": "AKIAHOSTILECANARY", "AWS_SECRET_ACCESS_KEY": canaries["AWS_SECRET_ACCESS_KEY"],
        **VERIFY_BUDGETS,
    }
    api = start_process(["serve", "--port", str(port), "--no-worker"], service_env, tmp / "api.log")
    http = httpx.Client(base_url=url, timeout=120)
    world_ = None
    try:
        wait_http(f"{url}/readyz", timeout_s=90)
        admin_token = (home / "admin-token").read_text().strip()
        worker_token = (home / "worker-token").read_text().strip()
        admin = {"Authorization": f"Bearer {admin_token}"}
        answer = http.post("/api/v1/projects", headers=admin, json={
            "name": PROJECT, "build_kind": "command", "build_command": "false", "adapter": "bundled",
            "default_battery": "quick", "environments": ["cpu"]})
        assert answer.status_code == 201, answer.text
        verify_token = _create_token(service_env, "verify")
        submit_token = _create_token(service_env, "submit")
        shadow = [line for line in _read_or_empty("/etc/shadow").splitlines() if len(line) >= 12][:3]
        world_secrets = {**canaries, "admin token": admin_token, "worker token": worker_token,
                         "submit token": submit_token, **{f"/etc/shadow line {i}": line for i, line in enumerate(shadow)}}
        target = Target(home=home, worker_home=worker_home, build_cache=build_cache, repo=REPO_ROOT,
                        api_port=port, database=db_name, redis_db=REDIS_DB)
        # A base commit for the verify runs (its own build fails at once: nothing to compare with).
        base = http.post(f"/api/v1/projects/{PROJECT}/commits", headers={"Authorization": f"Bearer {submit_token}"},
                         data={"sha": "base"}, files={"archive": ("base.tar.gz", make_archive({"kernel.cpp": "// base\n"}))})
        assert base.status_code == 201, base.text
        outside = tmp / "outside-everything" / "canary"
        _plant(outside, _canary("outside"))
        world_secrets["a file outside everything"] = outside.read_text()
        key_file = home / "secrets-key"  # the Fernet key that encrypts every secret at rest
        if key_file.is_file():
            world_secrets["OPTDRIFT_HOME/secrets-key"] = key_file.read_text().strip()
        canary_files = {path: _fingerprint(path) for path in (
            home / "secrets.env", home / "admin-token", home / "worker-token", key_file,
            worker_home / ".aws" / "credentials", worker_home / ".pgpass", outside) if path.is_file()}
        world_ = World(url=url, target=target, tmp=tmp, http=http, verify_token=verify_token,
                       submit_token=submit_token, base_sha="base", secrets=world_secrets,
                       canary_files=canary_files)
        worker_env = {**service_env, "HOME": str(worker_home), "OPTDRIFT_WORKER_TOKEN": worker_token}
        world_.worker = start_process(["worker", "--loglevel", "INFO"], worker_env, tmp / "worker.log")
        base_run = _wait_final(http, base.json()["runs"][0]["id"], timeout_s=180)
        assert base_run is not None, f"the worker did not take the base run:\n{world_.log_tail()}"
        yield world_
    finally:
        if world_ is not None and world_.worker is not None:
            stop_process(world_.worker)
        stop_process(api)
        http.close()
        drop_database(db_name)
        redis.Redis.from_url(broker_url).flushdb()


def _read_or_empty(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


# ----------------------------------------------------------------------------- checks
def fragments(value: str) -> list[str]:
    """The value and its 16-character pieces (a leak of most of a token is a leak), forwards and
    reversed (issue 33: a payload printed the tokens reversed, past a redaction of literal values)."""
    if len(value) < 24:
        return [value, value[::-1]]
    pieces = [value] + [value[i:i + 16] for i in range(0, len(value) - 15, 8)] + [value[-16:]]
    return pieces + [piece[::-1] for piece in pieces]


def leaks(world: World, texts: dict[str, str]) -> list[str]:
    found = []
    for channel, text in texts.items():
        for name, value in world.secrets.items():
            if any(piece in text for piece in fragments(value)):
                found.append(f"{name} in {channel}")
        for evidence in sorted(set(re.findall(r"PWNED-[\w-]+", text))):
            found.append(f"{evidence} in {channel} (a payload got through)")
    return found


def served_texts(world: World, run_id: int, commit_sha: str | None) -> tuple[dict[str, str], list[str]]:
    """Everything a reader without a token gets about the run; and the requests that answered 5xx."""
    http = world.http
    paths = {"run detail": f"/api/v1/runs/{run_id}", "build log": f"/api/v1/runs/{run_id}/log",
             "trajectories": f"/api/v1/runs/{run_id}/trajectories",
             "trajectories.csv": f"/api/v1/runs/{run_id}/trajectories.csv",
             "dashboard run page": f"/runs/{run_id}"}
    if commit_sha:
        paths.update({"commit": f"/api/v1/projects/{PROJECT}/commits/{commit_sha}",
                      "dashboard commit page": f"/projects/{PROJECT}/commits/{commit_sha}",
                      "dashboard project page": f"/projects/{PROJECT}"})
    texts, server_errors = {}, []
    for channel, path in paths.items():
        answer = http.get(path)
        texts[channel] = answer.text
        if answer.status_code >= 500:
            server_errors.append(f"{path} answered {answer.status_code}")
    # The project's verdict list, this run's entry (the list holds the earlier attacks' too).
    verdicts = http.get(f"/api/v1/projects/{PROJECT}/verdicts", params={"limit": 1000})
    if verdicts.status_code >= 500:
        server_errors.append(f"the project's verdicts answered {verdicts.status_code}")
    else:
        texts["project verdicts"] = str([v for v in verdicts.json()["data"] if v["run_id"] == run_id])
    rows = http.get(paths["trajectories"]).json().get("data", [])
    for row in rows[:2]:
        case = quote(row["case_id"], safe="")
        for channel, path in ((f"trajectory {row['case_id']}", f"/api/v1/runs/{run_id}/trajectories/{case}"),
                              (f"dashboard series {row['case_id']}", f"/dashboard/api/runs/{run_id}/series?case={case}")):
            answer = http.get(path)
            texts[channel] = answer.text
            if answer.status_code >= 500:
                server_errors.append(f"{path} answered {answer.status_code}")
    return texts, server_errors


def reason_problems(run: dict, rows: list[dict], pattern: str | None) -> list[str]:
    """Why the run's end is not a clear reason ([] when it is)."""
    status = run["status"]
    if status == "done":
        broken = [row for row in rows if row["status"] == "broken" and (row.get("error") or "").strip()]
        if not rows or len(broken) != len(rows):
            return [f"run ended 'done' with {len(rows)} cases, {len(broken)} broken with a message: "
                    "the attack was not reported"]
        reason = "\n".join(row["error"] for row in broken)
    else:
        reason = (run.get("error") or "").strip()
        if not reason:
            return [f"run ended {status!r} without an error"]
    if pattern and not re.search(pattern, reason, re.IGNORECASE):
        return [f"the reason does not say what happened (wanted /{pattern}/): {reason[:300]!r}"]
    return []


def size_problems(run: dict, texts: dict[str, str], rows: list[dict]) -> list[str]:
    problems = []
    if len(run.get("error") or "") > MAX_ERROR_CHARS:
        problems.append(f"run error is {len(run['error'])} characters")
    if len(texts["build log"]) > MAX_LOG_CHARS:
        problems.append(f"served build log is {len(texts['build log'])} characters")
    for row in rows:
        if len(row.get("error") or "") > MAX_ERROR_CHARS:
            problems.append(f"trajectory {row['case_id']} error is {len(row['error'])} characters")
    return problems


def walk(root: Path, pattern: str) -> list[Path]:
    """Paths under `root` whose name matches `pattern`. Folders may vanish while we look (a verify
    build's folder is deleted when its task ends): a walk that meets one goes on."""
    found = []
    for folder, dirs, files in os.walk(root, onerror=lambda _error: None):
        found += [Path(folder, name) for name in dirs + files if fnmatch.fnmatch(name, pattern)]
    return found


class Residue:
    """What an attack numbered `n` may have left: processes, files, tables, Redis keys."""

    def __init__(self, world: World, n: int):
        self.world, self.n = world, n
        self.process_pattern = f"sleep {n}( |$)"

    def processes(self) -> list[int]:
        return matching(self.process_pattern)

    def build_processes(self) -> list[int]:
        # Anything still running from the module's build cache: a build or a kernel host.
        return [pid for pid in matching(re.escape(str(self.world.target.build_cache))) if pid != os.getpid()]

    def files(self) -> list[Path]:
        t = self.world.target
        name = f"pwned-{self.n}-*"
        found = []
        for root in (t.home, t.worker_home, t.build_cache):
            found += walk(root, name)
        for folder in (Path("/tmp"), Path("/var/tmp"), Path("/dev/shm"), t.repo, t.repo / "worker"):
            found += list(folder.glob(name))
        return found

    def tables(self) -> list[str]:
        url = f"{PG_HOST_URL}/{self.world.target.database}"
        with psycopg.connect(url) as conn:
            return [row[0] for row in conn.execute(
                "SELECT tablename FROM pg_tables WHERE tablename LIKE %s", (f"pwned_{self.n}_%",))]

    def redis_keys(self) -> list[str]:
        client = redis.Redis.from_url(f"redis://127.0.0.1:6379/{REDIS_DB}")
        return [key.decode() for key in client.keys(f"pwned-{self.n}-*")]

    def big_files(self, since: float) -> list[str]:
        """Files of the build cache written since `since` that are over the size bound."""
        found = []
        for path in walk(self.world.target.build_cache, "*"):
            try:
                info = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_mtime >= since and info.st_size > MAX_KEPT_FILE_BYTES:
                found.append(f"{path.relative_to(self.world.target.build_cache)} ({info.st_size >> 20} MiB)")
        return found

    def kill(self) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self) -> None:
        self.kill()
        for path in self.files():
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        url = f"{PG_HOST_URL}/{self.world.target.database}"
        with psycopg.connect(url, autocommit=True) as conn:
            for table in self.tables():
                conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        keys = self.redis_keys()
        if keys:
            redis.Redis.from_url(f"redis://127.0.0.1:6379/{REDIS_DB}").delete(*keys)


def _submit(world: World, attack: Attack, n: int) -> tuple[httpx.Response, str | None]:
    archive = make_archive(attack.files, links=attack.links)
    fields = {"battery": attack.battery} if attack.battery is not None else {}
    if attack.route == "commit":
        sha = f"hostile-{n}"
        answer = world.http.post(f"/api/v1/projects/{PROJECT}/commits",
                                 headers={"Authorization": f"Bearer {world.submit_token}"},
                                 data={"sha": sha, "parents": world.base_sha, **fields},
                                 files={"archive": ("tree.tar.gz", archive)})
        return answer, sha
    answer = world.http.post(f"/api/v1/projects/{PROJECT}/verify",
                             headers={"Authorization": f"Bearer {world.verify_token}"},
                             data={"base": world.base_sha, **fields}, files={"archive": ("tree.tar.gz", archive)})
    return answer, None


def _run_id(answer: httpx.Response, route: str) -> int:
    body = answer.json()
    return body["runs"][0]["id"] if route == "commit" else body["id"]


# ----------------------------------------------------------------------------- the corpus
@pytest.mark.parametrize("name", list(ATTACKS))
def test_hostile(world: World, name: str) -> None:
    n = FIRST_MARKER + list(ATTACKS).index(name)
    attack = ATTACKS[name](world.target, n)
    residue = Residue(world, n)
    residue.remove()
    problems: list[str] = []
    outcome = ""
    started, started_at = time.monotonic(), time.time() - 1
    try:
        answer, sha = _submit(world, attack, n)
        texts = {"submission answer": answer.text}
        if answer.status_code in (401, 403, 429):
            pytest.fail(f"the test's token was refused ({answer.status_code}): {answer.text}")
        if answer.status_code in REFUSALS:
            detail = answer.json().get("detail")
            outcome = f"refused {answer.status_code}: {str(detail)[:200]}"
            if not detail:
                problems.append(f"refused with {answer.status_code} but no detail")
        elif answer.status_code not in (200, 201):
            problems.append(f"submission answered {answer.status_code}: {answer.text[:500]}")
        else:
            run_id = _run_id(answer, attack.route)
            run = _wait_final(world.http, run_id, attack.wait_s)
            if run is None:
                status = world.http.get(f"/api/v1/runs/{run_id}").json()["status"]
                problems.append(f"run {run_id} still {status!r} after {attack.wait_s:g} s: the submitted code "
                                "held the worker past its budget")
                # Free the worker for the next attack: end what this attack started until the run ends.
                deadline = time.monotonic() + 240
                while run is None and time.monotonic() < deadline:
                    residue.kill()
                    run = _wait_final(world.http, run_id, 1.0)
                assert run is not None, f"run {run_id} never ended:\n{world.log_tail()}"
            deadline = time.monotonic() + 5  # the verdict follows the final status
            while run.get("verdict") is None and time.monotonic() < deadline:
                time.sleep(0.3)
                run = world.http.get(f"/api/v1/runs/{run_id}").json()
            served, server_errors = served_texts(world, run_id, sha)
            texts.update(served)
            problems += server_errors
            rows = world.http.get(f"/api/v1/runs/{run_id}/trajectories").json().get("data", [])
            reason = run.get("error") or "; ".join({(row.get("error") or "")[:200] for row in rows})
            outcome = f"run {run_id} {run['status']}: {reason[:200]!r}"
            problems += reason_problems(run, rows, attack.reason)
            problems += size_problems(run, texts, rows)
        problems += leaks(world, texts)
        left = wait_gone(residue.process_pattern, timeout_s=5)
        if left:
            problems.append(f"{len(left)} process(es) of the attack outlived it ('{residue.process_pattern}')")
        hosts = residue.build_processes()
        if hosts:
            problems.append(f"build or kernel-host processes still running after the run: {hosts[:5]}")
        written = residue.files()
        if written:
            problems.append(f"written outside the build folder: {[str(p) for p in written]}")
        tables = residue.tables()
        if tables:
            problems.append(f"tables created in the service's database: {tables}")
        keys = residue.redis_keys()
        if keys:
            problems.append(f"keys written to the broker's Redis: {keys}")
        changed = world.changed_canaries()
        if changed:
            problems.append(f"canary files written through: {changed}")
        big = residue.big_files(started_at)
        if big:
            problems.append(f"the run left files over {MAX_KEPT_FILE_BYTES >> 20} MiB on the worker's disk: {big}")
    finally:
        residue.remove()
        # -s shows what each attack came to (the report of issue 13 lists them)
        print(f"\n[{name}] {time.monotonic() - started:.1f} s; {outcome}")
    assert not problems, f"{name}:\n- " + "\n- ".join(problems)


# ----------------------------------------------------------------------------- builds across runs (issue 33)
TRUST_PROBE_TOML = """[project]
adapter = "bundled"

[build]
kind = "command"
commands = ["sh build.sh"]
timeout_s = 5
library = "lib"
"""
# timeout_s under both runs' caps (the verify cap here is 8 s): a capped timeout is part of the build's
# digest, and the attack needs the commit run's digest to equal the verify run's.
# A build that behaves differently when it sees it is untrusted (a verify build's ccache is
# read-only), and leaves a large file behind either way.
TRUST_PROBE_SH = """mkdir -p lib
if [ -n "$CCACHE_READONLY" ]; then echo planted-by-verify > lib/who.txt; else echo trusted > lib/who.txt; fi
head -c 80000000 /dev/zero > lib/ballast.bin
"""


def _build_cache_files(world: World, name: str) -> list[Path]:
    return [p for p in walk(world.target.build_cache, name) if p.is_file()]


def test_a_verify_build_is_never_served_to_a_commit_run_and_leaves_nothing_behind(world: World) -> None:
    """Issue 33 items 6 and 7 through the API and the worker: a verify run builds tree T (its build
    plants a marker it would only write when untrusted, and 80 MB of ballast); a commit run of the
    same T then builds afresh (build_cached false, the trusted marker), and once the verify run's
    task is over its folder and ballast are gone from the worker's disk."""
    files = {"optdrift.toml": TRUST_PROBE_TOML, "build.sh": TRUST_PROBE_SH, "probe.txt": secrets.token_hex(8)}
    verify = world.http.post(f"/api/v1/projects/{PROJECT}/verify", headers={"Authorization": f"Bearer {world.verify_token}"},
                             data={"base": world.base_sha}, files={"archive": ("t.tar.gz", make_archive(files))})
    assert verify.status_code == 201, verify.text
    verify_run = _wait_final(world.http, verify.json()["id"], 120)
    assert verify_run is not None, world.log_tail()
    assert verify_run["build_digest"], verify_run
    planted = [p for p in _build_cache_files(world, "who.txt") if p.read_text().strip() == "planted-by-verify"]
    deadline = time.monotonic() + 20  # the folder goes when the verify task ends (task_postrun)
    while planted and time.monotonic() < deadline:
        time.sleep(0.5)
        planted = [p for p in planted if p.exists()]
    assert planted == [], f"the verify build stayed on the worker's disk: {planted}"
    assert not [p for p in _build_cache_files(world, "ballast.bin") if "verify" in p.parts], "verify ballast left"
    commit = world.http.post(f"/api/v1/projects/{PROJECT}/commits", headers={"Authorization": f"Bearer {world.submit_token}"},
                             data={"sha": f"trust-{secrets.token_hex(4)}", "parents": world.base_sha},
                             files={"archive": ("t.tar.gz", make_archive(files))})
    assert commit.status_code == 201, commit.text
    commit_run = _wait_final(world.http, commit.json()["runs"][0]["id"], 120)
    assert commit_run is not None, world.log_tail()
    assert commit_run["build_digest"] == verify_run["build_digest"]  # the same tree and recipe
    assert commit_run["build_cached"] is False, "the commit run took the verify run's build"
    trusted = [p.read_text().strip() for p in _build_cache_files(world, "who.txt")]
    assert trusted and set(trusted) == {"trusted"}, trusted


def test_after_the_corpus_the_worker_answers_a_commit_run_in_time_and_no_canary_moved(world: World) -> None:
    """Issue 43: whatever the attacks planted (FIFOs, links, a full scratch), the same worker takes
    the next commit run and ends it within its budget; and no canary file was written through."""
    # A build that succeeds and names a library its commands did not make: the run ends at once with
    # a reason, after a whole build and its bookkeeping (the worker is alive and answering).
    files = {"optdrift.toml": COMMAND_TOML.format(timeout_s=20), "hostile.sh": "exit 0\n",
             "nonce.txt": secrets.token_hex(8)}
    commit = world.http.post(f"/api/v1/projects/{PROJECT}/commits", headers={"Authorization": f"Bearer {world.submit_token}"},
                             data={"sha": f"after-{secrets.token_hex(4)}", "parents": world.base_sha},
                             files={"archive": ("t.tar.gz", make_archive(files))})
    assert commit.status_code == 201, commit.text
    run = _wait_final(world.http, commit.json()["runs"][0]["id"], 90)
    assert run is not None, f"the worker did not end a plain commit run within 90 s:\n{world.log_tail()}"
    assert world.changed_canaries() == []
