"""A worker started as root holds root only to launch the box (worker/sandbox/privilege.py, issue 43).

Real processes and a real throwaway system user (`useradd --system`, removed after): a process
started as root that drops for the worker runs as that user with saved uid 0, cannot open a root-only
0600 file (a link planted to it is useless), still builds a CMake tree in the box as uid 65534, owns
what the box wrote once the box is gone, and can kill a box it started. A real `optdrift worker` as
root says which way it runs in its log and in /healthz's sandbox status, with its user and without.

Skipped, with the reason, where the test process is not root or useradd is missing. The Python these
tests run lives under /root here (pyenv): the throwaway user gets an ACL entry to enter the folders
above it that it could not (an operator installs Python outside /root instead), removed after.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sqlite3
import stat
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tests.service_fixtures import REPO_ROOT, code_path, start_process, stop_process
from worker import sandbox

CMAKE_PROJECT = REPO_ROOT / "tests" / "fixtures" / "cmake_project"
ACL_XATTR = "system.posix_acl_access"


def _acl_with_user(mode: int, uid: int) -> bytes:
    """A POSIX access ACL (the kernel's xattr form) of `mode` plus search for `uid`."""
    entry = struct.Struct("<HHI")
    owner, group, other = (mode >> 6) & 7, (mode >> 3) & 7, mode & 7
    return struct.pack("<I", 2) + b"".join([
        entry.pack(0x01, owner, 0xFFFFFFFF), entry.pack(0x02, 1, uid), entry.pack(0x04, group, 0xFFFFFFFF),
        entry.pack(0x10, group | 1, 0xFFFFFFFF), entry.pack(0x20, other, 0xFFFFFFFF)])


def _folders_closed_to_others(paths: list[Path]) -> list[Path]:
    closed = set()
    for path in paths:
        for folder in Path(path).resolve().parents:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                closed.add(folder)
    return sorted(closed)


@pytest.fixture
def worker_user():  # noqa: ANN201
    """A throwaway system user that can enter the folders of this Python and this checkout."""
    if os.geteuid() != 0:
        pytest.skip("dropping root needs a test process running as root")
    useradd, userdel = shutil.which("useradd"), shutil.which("userdel")
    if not useradd or not userdel:
        pytest.skip("useradd/userdel (passwd) are missing: no throwaway user can be made")
    if not sandbox.available():
        pytest.skip(f"bubblewrap cannot run here: {sandbox.status()[1]}")
    name = f"optdrift-test-{uuid.uuid4().hex[:8]}"
    subprocess.run([useradd, "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
    user = pwd.getpwnam(name)
    opened: list[tuple[Path, int, bytes | None]] = []
    try:
        for folder in _folders_closed_to_others([Path(os.path.realpath(sys.executable)), Path(sys.prefix), REPO_ROOT]):
            mode = stat.S_IMODE(os.stat(folder).st_mode)
            try:
                before = os.getxattr(folder, ACL_XATTR)
            except OSError:
                before = None
            opened.append((folder, mode, before))
            os.setxattr(folder, ACL_XATTR, _acl_with_user(mode, user.pw_uid))
        yield user
    finally:
        for folder, mode, before in reversed(opened):  # exactly as found: its ACL, if any, and its mode
            if before is None:
                os.removexattr(folder, ACL_XATTR)
            else:
                os.setxattr(folder, ACL_XATTR, before)
            os.chmod(folder, mode)  # the ACL's mask had become the group bits
        subprocess.run([userdel, name], check=False)


@pytest.fixture
def base():  # noqa: ANN201
    """A folder the worker user can enter (pytest's tmp_path lies under a 0700 folder of root's)."""
    folder = Path(tempfile.mkdtemp(prefix="optdrift-privilege-"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _root_only(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    os.chown(path, 0, 0)
    return path


DROPPED_WORKER = textwrap.dedent("""
    import json, os, shutil, signal, subprocess, sys, time
    from pathlib import Path
    from worker import sandbox
    from worker.sandbox import privilege

    canary, tree, cache, work, home = map(Path, sys.argv[1:6])
    from service.settings import get_settings
    out = {"identity": privilege.drop_for_worker(get_settings()).as_dict()}
    get_settings.cache_clear()
    out["uids"] = [line.split()[1:4] for line in open("/proc/self/status") if line.startswith("Uid:")][0]
    (tree / "planted").symlink_to(canary)
    for name, path in (("canary", tree / "planted"), ("secrets_key_file", home / "secrets-key")):
        try:
            out[name] = Path(path).read_text()
        except PermissionError:
            out[name] = "refused"
    out["secrets_key_preloaded"] = os.environ.get("OPTDRIFT_SECRETS_KEY")

    from service.core.project_config import load_project_config
    from worker.build.project import build_project
    (tree / "planted").unlink()
    result = build_project(tree, load_project_config(tree), cache_dir=cache, cuda_archs=[])
    out["build"] = {"ok": result.ok, "error": result.error, "library": result.library_path}

    work.mkdir()
    scratch = sandbox.Scratch()
    child = sandbox.popen([sys.executable, "-c", "import os; open('made', 'w').write(str(os.getuid()))"],
                          limits=sandbox.BUILD_LIMITS, env=sandbox.sandbox_env(scratch=scratch.path),
                          writable=[work], scratch=scratch.path)
    child.wait(timeout=60)
    out["box_uid"] = (work / "made").read_text()
    out["made_owner"] = (work / "made").stat().st_uid
    shutil.rmtree(work)  # the worker deletes what the box wrote, as its owner
    scratch.remove()
    out["work_removed"] = not work.exists() and not scratch.path.exists()

    # A box that hides what it writes in a folder mode 0700 (its own, uid 65534): the worker's user
    # cannot list it, and a verify build's cap must count it anyway (worker.build.cache.measured_bytes).
    from worker.build.cache import folder_bytes, measured_bytes
    hidden_work = home / "hidden-work"
    hidden_work.mkdir()
    hider = sandbox.popen([sys.executable, "-c", "import os, time; os.mkdir('hidden', 0o700); "
                           "open('hidden/fill', 'wb').write(bytes(3000000)); open('done', 'w').close(); time.sleep(60)"],
                          limits=sandbox.BUILD_LIMITS, env=sandbox.sandbox_env(scratch=Path("/tmp")),
                          writable=[hidden_work])
    deadline = time.monotonic() + 60
    while not (hidden_work / "done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    out["hidden_listed"], out["hidden_measured"] = folder_bytes(hidden_work), measured_bytes([hidden_work])
    os.killpg(hider.pid, signal.SIGKILL)
    hider.wait(timeout=30)

    marker = "box-to-kill-%d" % os.getpid()
    sleeper = sandbox.popen([sys.executable, "-c", "import time; time.sleep(120)", marker],
                            limits=sandbox.BUILD_LIMITS, env=sandbox.sandbox_env(scratch=Path("/tmp")),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)
    os.killpg(sleeper.pid, signal.SIGKILL)  # as a build timeout or the watchdog kills a box
    sleeper.wait(timeout=30)
    time.sleep(0.5)  # the parent-death signals run down bwrap's chain
    def runs_marker(pid):
        try:
            return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            return False
    out["box_left"] = [pid for pid in os.listdir("/proc") if pid.isdigit() and runs_marker(pid)]
    print(json.dumps(out))
""")


def test_a_root_worker_drops_to_its_user_and_still_builds_in_the_box(worker_user, base: Path) -> None:  # noqa: ANN001
    home = base / "home"
    home.mkdir(mode=0o700)
    key = "a-fernet-key-only-root-reads-from-its-file"
    _root_only(home / "secrets-key", key)
    canary = _root_only(base / "canary", "root's own secret\n")
    tree = base / "tree"
    shutil.copytree(CMAKE_PROJECT, tree)
    subprocess.run(["chown", "-R", f"{worker_user.pw_uid}:{worker_user.pw_gid}", str(tree)], check=True)  # as the
    # worker unpacks a submitted tree itself
    env = {**os.environ, "PYTHONPATH": code_path(), "OPTDRIFT_WORKER_USER": worker_user.pw_name,
           "OPTDRIFT_HOME": str(home)}
    env.pop("OPTDRIFT_SECRETS_KEY", None)
    done = subprocess.run([sys.executable, "-c", DROPPED_WORKER, str(canary), str(tree), str(home / "builds"),
                           str(home / "work"), str(home)], cwd=base, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    uid = str(worker_user.pw_uid)
    assert out["identity"]["mode"] == "dropped", out
    assert out["uids"] == [uid, uid, "0"], "real and effective uid the user's, saved uid 0"
    assert out["canary"] == "refused", "the worker followed a planted link to root's 0600 file and read it"
    assert out["secrets_key_file"] == "refused" and out["secrets_key_preloaded"] == key
    assert out["build"]["ok"], out["build"]
    assert Path(out["build"]["library"]).stat().st_uid == worker_user.pw_uid, "the build is the worker's again"
    # the compiler cache every trusted build shares stays the box's, and the box wrote it
    from worker.build.ccache import find_ccache

    if find_ccache() is not None:  # a worker without ccache (the GPU machine's image) builds without one
        compiler_cache = home / "builds" / "command" / "ccache"
        assert compiler_cache.stat().st_uid == 65534 and any(compiler_cache.iterdir()), "no compiler cache the box wrote"
    assert out["box_uid"] == "65534", "the box no longer runs as the sandbox user"
    assert out["made_owner"] == worker_user.pw_uid and out["work_removed"], out
    assert out["box_left"] == [], "the box outlived the process the worker killed"
    assert out["hidden_listed"] < 1_000_000, "the test's box did not hide its bytes from the worker's user"
    assert out["hidden_measured"] >= 3_000_000, "a verify build's cap missed what the box hid in a 0700 folder"
    assert stat.S_IMODE(os.stat(canary).st_mode) == 0o600 and os.stat(canary).st_uid == 0


DROPPED_WORKER_THAT_DIES = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from worker import sandbox
    from worker.sandbox import privilege

    from service.settings import get_settings
    privilege.drop_for_worker(get_settings())
    sandbox.popen([sys.executable, "-c", "import time; time.sleep(120)", sys.argv[1]], limits=sandbox.BUILD_LIMITS,
                  env=sandbox.sandbox_env(scratch=Path("/tmp")))
    print("started", flush=True)
    time.sleep(120)
""")


def _processes_running(marker: str, *, uid: int | None = None) -> list[str]:
    """Processes whose command line holds `marker` (of `uid` alone, where given)."""
    def runs(pid: str) -> bool:
        try:
            return marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and (
                uid is None or os.stat(f"/proc/{pid}").st_uid == uid)
        except OSError:
            return False
    return [pid for pid in os.listdir("/proc") if pid.isdigit() and runs(pid)]


def test_the_box_of_a_dropped_worker_dies_with_the_worker(worker_user, base: Path) -> None:  # noqa: ANN001
    """The tether dies with the worker (its own parent-death signal) and bwrap with the tether."""
    marker = f"box-of-a-killed-worker-{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": code_path(), "OPTDRIFT_WORKER_USER": worker_user.pw_name,
           "OPTDRIFT_HOME": str(base / "home")}
    worker = subprocess.Popen([sys.executable, "-c", DROPPED_WORKER_THAT_DIES, marker], cwd=base, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert worker.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 10
        while not _processes_running(marker, uid=65534) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_running(marker, uid=65534), "the box's command never started"
    finally:
        worker.kill()
        worker.wait()
    deadline = time.monotonic() + 5
    while _processes_running(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_running(marker) == [], "the box outlived the worker that started it"


def _worker_until_ready(env: dict[str, str], log_path: Path, timeout_s: float = 240.0):  # noqa: ANN202
    """`optdrift migrate` (as root, as `serve` would: the database is root's until the worker starts),
    then a real `optdrift worker` up to Celery's "ready." line."""
    migrated = subprocess.run([sys.executable, "-m", "service.cli", "migrate"], cwd=REPO_ROOT, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": code_path(), **env}, timeout=120)
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    worker = start_process(["worker", "--pool", "solo", "--name", "privilegecheck"], env, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if " ready." in text:
            return worker, text
        if worker.poll() is not None:
            raise AssertionError(f"the worker exited ({worker.returncode}):\n{text[-3000:]}")
        time.sleep(0.3)
    stop_process(worker)
    raise AssertionError(f"the worker was not ready within {timeout_s:g} s:\n{log_path.read_text()[-3000:]}")


def _healthz_sandbox(home: Path, timeout_s: float = 30.0) -> dict:
    """/healthz of an API on the worker's embedded database, once the worker's presence row is there."""
    from fastapi.testclient import TestClient

    from service.api.main import create_app
    from service.db.session import get_engine, get_sessionmaker
    from service.settings import get_settings

    deadline = time.monotonic() + timeout_s
    while True:
        with sqlite3.connect(home / "optdrift.db") as db:
            rows = db.execute("SELECT count(*) FROM worker_presence").fetchone()[0]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    previous = os.environ.get("OPTDRIFT_HOME")
    os.environ["OPTDRIFT_HOME"] = str(home)
    for cached in (get_settings, get_engine, get_sessionmaker):
        cached.cache_clear()
    try:
        with TestClient(create_app()) as client:
            return client.get("/healthz").json()
    finally:
        if previous is None:
            os.environ.pop("OPTDRIFT_HOME", None)
        else:
            os.environ["OPTDRIFT_HOME"] = previous
        for cached in (get_settings, get_engine, get_sessionmaker):
            cached.cache_clear()


def _send_as_the_root_api(home: Path, *, run_id: int) -> None:
    """One run message on the embedded broker, written by this (root) process as the API would."""
    from service.broker.queueing import send_run
    from service.settings import Settings

    send_run(settings=Settings(home=home), run_id=run_id, environment="cpu", kind="commit")


def _worker_env(home: Path, base: Path, user: str) -> dict[str, str]:
    blocker = base / "no-harness"
    blocker.write_text("a file where the harness cache would be: its build fails fast, and is only logged\n")
    return {"OPTDRIFT_HOME": str(home), "OPTDRIFT_WORKER_USER": user, "OPTDRIFT_HARNESS_CACHE": str(blocker / "h")}


@pytest.mark.slow
def test_a_started_worker_runs_as_its_user_and_healthz_says_so(worker_user, base: Path) -> None:  # noqa: ANN001
    home = base / "home"
    worker, text = _worker_until_ready(_worker_env(home, base, worker_user.pw_name), base / "worker.log")
    try:
        with open(f"/proc/{worker.pid}/status") as status:
            uids = [line.split()[1:4] for line in status if line.startswith("Uid:")][0]
        assert uids == [str(worker_user.pw_uid)] * 2 + ["0"], uids
        assert f"run as {worker_user.pw_name!r}" in text, text[-3000:]
        assert os.stat(home / "optdrift.db").st_uid == worker_user.pw_uid, "the database is not the worker's"
        # `optdrift serve`'s API stays root and keeps writing the embedded broker's files: the worker
        # must still be able to open them for writing (kombu binds a queue by rewriting the exchange file)
        made_by_root = home / "broker" / "control" / "made-by-the-api.exchange"
        made_by_root.write_text("[]")
        assert made_by_root.stat().st_uid == 0
        opened = subprocess.run([sys.executable, "-c", "import sys; open(sys.argv[1], 'rb+').close()", str(made_by_root)],
                                user=worker_user.pw_uid, group=worker_user.pw_gid, extra_groups=[],
                                capture_output=True, text=True)
        assert opened.returncode == 0, opened.stderr[-2000:]
        # ... and take the messages the root API sends: kombu moves each to the worker's temporary
        # folder, reads it and deletes it (a run id nobody has: the task finds nothing to do)
        _send_as_the_root_api(home, run_id=987654)
        queue = home / "broker" / "queue"
        deadline = time.monotonic() + 30
        while any(queue.iterdir()) and worker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)
        text = (base / "worker.log").read_text(errors="replace")
        assert worker.poll() is None and "Unrecoverable error" not in text, text[-3000:]
        assert not any(queue.iterdir()), "the worker did not take the message the root API sent"
        health = _healthz_sandbox(home)
    finally:
        stop_process(worker)
    assert health["status"] == "ok"
    [report] = health["sandbox"]["workers"]
    assert report["identity"]["mode"] == "dropped" and report["identity"]["user"] == worker_user.pw_name
    assert report["available"] is True and health["sandbox"]["warnings"] == [], health


@pytest.mark.slow
def test_a_root_worker_without_its_user_says_so_at_start_and_in_healthz(base: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("a root worker needs a test process running as root")
    missing = f"optdrift-absent-{uuid.uuid4().hex[:8]}"
    home = base / "home"
    worker, text = _worker_until_ready(_worker_env(home, base, missing), base / "worker.log")
    try:
        assert f"running as root: file handling, database and network work run with root's rights; create " \
               f"the user {missing!r}" in text, text[-3000:]
        health = _healthz_sandbox(home)
    finally:
        stop_process(worker)
    assert len(health["sandbox"]["workers"]) == 1, (health, text[-3000:])
    [report] = health["sandbox"]["workers"]
    assert report["identity"]["mode"] == "root", report
    assert any("running as root" in warning and missing in warning for warning in health["sandbox"]["warnings"]), health


def test_the_systemd_example_starts_a_root_worker_that_drops_to_its_user() -> None:
    """docker/optdrift-worker.service: a real `optdrift worker` command line, real variables, and no
    User= (a worker started as its user could not launch boxes privileged)."""
    import click
    import typer

    from service.cli.main import app
    from service.settings import Settings

    unit = (REPO_ROOT / "docker" / "optdrift-worker.service").read_text()
    lines = [line.strip() for line in unit.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert not [line for line in lines if line.startswith(("User=", "DynamicUser="))]
    environment = dict(line.removeprefix("Environment=").split("=", 1) for line in lines if line.startswith("Environment="))
    assert environment.get("OPTDRIFT_WORKER_USER") == "optdrift"
    known = {f"OPTDRIFT_{name.upper()}" for name in Settings.model_fields} | {"OPTDRIFT_WORKER_USER", "OPTDRIFT_HARNESS_CACHE"}
    assert set(environment) <= known, set(environment) - known
    [start] = [line.removeprefix("ExecStart=") for line in lines if line.startswith("ExecStart=")]
    program, *words = start.split()
    assert Path(program).name == "optdrift" and words[0] == "worker", start
    group = typer.main.get_command(app)
    group.get_command(click.Context(group), "worker").make_context("worker", words[1:], resilient_parsing=False)


def test_the_compiler_caches_handed_to_the_box_are_where_the_builds_keep_them() -> None:
    """privilege names the command builds' folder itself (worker.build sits above worker.sandbox)."""
    from worker.build.cache import COMMAND_FOLDER
    from worker.sandbox import privilege

    assert privilege.COMMAND_BUILDS_FOLDER == COMMAND_FOLDER
