"""The sandbox builds and kernel hosts run in (worker/sandbox/__init__.py), tested directly with real
processes, in both of its modes:

- `bwrap`: bubblewrap (what workers run with wherever it can be made). The child sees no secret
  file, no other process, no socket, no network; it runs as uid 65534 without capabilities; it
  cannot write outside the folders it was given; nothing it starts outlives it.
- `fallback`: bubblewrap turned off (OPTDRIFT_BWRAP names no program). The same probes then show
  what the box is for: the token file and the other processes are visible, a `setsid` child
  survives. These assertions are the "turn the defence off and the test fails" proof, kept in the
  suite so the bwrap assertions cannot pass vacuously.

The end-to-end attacks through the API and the worker are in tests/scenarios/test_hostile_corpus.py.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from service.settings import get_settings
from tests import processes
from worker import sandbox

SECRET_ENV = {"OPTDRIFT_DATABASE_URL": "postgresql://u:canary-db-password@db/x",
              "OPTDRIFT_WORKER_TOKEN": "odt_canary_worker_token", "AWS_SECRET_ACCESS_KEY": "canary-aws-key",
              "OPTDRIFT_TEST_HOST_FAULT": "abort:never"}
TOKEN = "odt_canary_admin_token_0123456789"


@pytest.fixture(params=["bwrap", "fallback"])
def mode(request, monkeypatch, tmp_path) -> str:  # noqa: ANN001
    """The sandbox's mode for the test, with a planted OPTDRIFT_HOME holding an admin token."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "admin-token").write_text(TOKEN)
    (home / "admin-token").chmod(0o644)  # readable by anyone: only the mount namespace hides it
    monkeypatch.setenv("OPTDRIFT_HOME", str(home))
    if request.param == "fallback":
        monkeypatch.setenv("OPTDRIFT_BWRAP", str(tmp_path / "no-bwrap-here"))
    get_settings.cache_clear()
    sandbox.status.cache_clear()
    if request.param == "bwrap" and not sandbox.available():
        pytest.skip(f"bubblewrap cannot run here: {sandbox.status()[1]}")
    yield request.param
    get_settings.cache_clear()
    sandbox.status.cache_clear()


def _work(tmp_path: Path) -> Path:
    """A scratch folder beside the planted OPTDRIFT_HOME (tmp_path holds it: the box never shows
    a folder that holds a secret, so tmp_path itself cannot be a child's folder)."""
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return work


def _run(code: str, scratch: Path, *, limits: sandbox.SandboxLimits = sandbox.HOST_LIMITS,
         writable: list[Path] = ()) -> subprocess.CompletedProcess:
    env = sandbox.sandbox_env(scratch=scratch, source={"PATH": os.environ["PATH"], **SECRET_ENV})
    process = sandbox.popen([sys.executable, "-c", code], limits=limits, env=env, writable=list(writable),
                            scratch=scratch, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=120)
    return subprocess.CompletedProcess(process.args, process.returncode, out.decode(), err.decode())


PROBE = textwrap.dedent("""
    import json, os, resource, socket, sys
    home, outside = sys.argv[1], sys.argv[2]
    out = {"env": sorted(os.environ), "tmp": os.environ.get("TMPDIR"), "uid": os.getuid(),
           "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
           "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
           "capabilities": [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff")][0]}
    def attempt(name, action):
        try:
            out[name] = ("ok", str(action())[:200])
        except OSError as error:
            out[name] = ("refused", type(error).__name__)
    attempt("token", lambda: open(os.path.join(home, "admin-token")).read())
    attempt("home", lambda: os.listdir(home))
    attempt("shadow", lambda: open("/etc/shadow").read())
    attempt("init_environ", lambda: open("/proc/1/environ", "rb").read())
    out["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    def tcp(port):
        s = socket.socket(); s.settimeout(2); s.connect(("127.0.0.1", port)); return "connected"
    attempt("tcp_redis", lambda: tcp(6379))
    def unix(path):
        s = socket.socket(socket.AF_UNIX); s.settimeout(2); s.connect(path); return "connected"
    attempt("unix_postgres", lambda: unix("/var/run/postgresql/.s.PGSQL.5432"))
    attempt("write_outside", lambda: open(outside, "w").write("x"))
    attempt("write_usr", lambda: open("/usr/optdrift-was-here", "w").write("x"))
    attempt("write_scratch", lambda: open(os.path.join(os.environ["TMPDIR"], "left-behind"), "w").write("x"))
    print(json.dumps(out))
""")


def _probe(scratch: Path, outside: Path) -> dict:
    code = PROBE.replace("sys.argv[1], sys.argv[2]", f"{os.environ['OPTDRIFT_HOME']!r}, {str(outside)!r}")
    result = _run(code, scratch)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _postgres_socket() -> bool:
    probe = socket.socket(socket.AF_UNIX)
    try:
        probe.connect("/var/run/postgresql/.s.PGSQL.5432")
        return True
    except OSError:
        return False
    finally:
        probe.close()


def test_what_the_child_can_reach(mode: str, tmp_path: Path) -> None:
    scratch_holder = sandbox.Scratch()
    outside = tmp_path / "written-from-the-box"
    with scratch_holder as scratch:
        seen = _probe(scratch, outside)
        assert (scratch / "left-behind").exists()  # its own scratch is writable in both modes
    assert not scratch_holder.path.exists()
    # Both modes: the allowlisted environment, the limits, no network.
    assert not {"OPTDRIFT_DATABASE_URL", "OPTDRIFT_WORKER_TOKEN", "AWS_SECRET_ACCESS_KEY"} & set(seen["env"])
    assert "OPTDRIFT_TEST_HOST_FAULT" in seen["env"] and seen["tmp"] == str(scratch_holder.path)
    assert seen["cpu"] == sandbox.HOST_LIMITS.cpu_seconds
    assert seen["fsize"] == sandbox.HOST_LIMITS.file_size_bytes
    if mode == "bwrap":
        assert seen["uid"] == 65534 and int(seen["capabilities"], 16) == 0
        for attack in ("token", "home", "shadow", "tcp_redis", "unix_postgres", "write_outside", "write_usr"):
            assert seen[attack][0] == "refused", (attack, seen[attack])
        # Its own PID namespace: bwrap's reaper (1) and the child; no worker, no PostgreSQL.
        assert max(seen["pids"]) < 10, seen["pids"]
        assert "canary" not in seen["init_environ"][1]  # pid 1 is bwrap's reaper, not the worker
        assert not outside.exists()
    else:  # root without the box: the planted token is there for the taking
        assert seen["token"] == ["ok", TOKEN]
        assert len(seen["pids"]) > 10
        if _postgres_socket():
            assert seen["unix_postgres"] == ["ok", "connected"]
        assert outside.exists()


def test_limits_stop_the_child(mode: str, tmp_path: Path) -> None:
    tight = sandbox.SandboxLimits(cpu_seconds=1, file_size_bytes=1024 * 1024, max_processes=4096)
    writable = tmp_path / "out"
    writable.mkdir()
    big_write = f"open({str(writable / 'big')!r}, 'wb').write(b'0' * (8 * 1024 * 1024))"
    result = _run(big_write, _work(tmp_path), limits=tight, writable=[writable])
    assert result.returncode != 0 and ("File too large" in result.stderr
                                       or sandbox.signal_of(result.returncode) == signal.SIGXFSZ), result
    assert (writable / "big").stat().st_size <= 1024 * 1024
    spin = _run("while True: pass", _work(tmp_path), limits=tight)
    assert sandbox.signal_of(spin.returncode) in (signal.SIGKILL, signal.SIGXCPU), spin


FORK_BOMB = textwrap.dedent("""
    import os, time
    children = 0
    try:
        while children < 2000:
            if os.fork() == 0:
                time.sleep(30)
                os._exit(0)
            children += 1
    except OSError as error:
        print("stopped", children, type(error).__name__, flush=True)
    else:
        print("not stopped", children, flush=True)
    os._exit(0)
""")


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing(mode: str, tmp_path: Path) -> None:
    if mode == "fallback" and os.geteuid() == 0:
        pytest.skip("without bubblewrap the child is root here, which RLIMIT_NPROC does not bind")
    limits = sandbox.SandboxLimits(cpu_seconds=60, file_size_bytes=None, max_processes=64)
    result = _run(FORK_BOMB.replace("time.sleep(30)", "time.sleep(30.4242)"), _work(tmp_path), limits=limits)
    words = result.stdout.split()
    assert words[:1] == ["stopped"] and int(words[1]) < 64, result
    assert processes.wait_gone("30.4242", timeout_s=5) == [] or mode == "fallback"


SURVIVORS = "setsid sleep {m} & (sleep {m} &) ; nohup sleep {m} >/dev/null 2>&1 &"


def test_nothing_it_starts_outlives_it(mode: str, tmp_path: Path) -> None:
    marker = f"{4242 + (mode == 'fallback')}.{os.getpid() % 1000}"
    env = sandbox.sandbox_env(scratch=_work(tmp_path))
    child = sandbox.popen(["sh", "-c", SURVIVORS.format(m=marker)], limits=sandbox.BUILD_LIMITS, env=env,
                          scratch=_work(tmp_path), stdout=subprocess.DEVNULL)  # a survivor would hold a pipe open
    try:
        assert child.wait(timeout=60) == 0
        left = processes.wait_gone(f"sleep {marker}", timeout_s=5)
        if mode == "bwrap":
            assert left == [], f"processes outlived the sandbox: {left}"
        else:  # what the PID namespace is for
            assert len(left) == 3
    finally:
        for pid in processes.matching(f"sleep {marker}"):
            os.kill(pid, signal.SIGKILL)


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from worker import sandbox
    scratch = Path(sys.argv[2])
    # A build-like tree: the command starts grandchildren (as ninja starts compilers).
    child = sandbox.popen(["sh", "-c", "sleep " + sys.argv[1] + " & sleep " + sys.argv[1] + "; wait"],
                          limits=sandbox.BUILD_LIMITS, env=sandbox.sandbox_env(scratch=scratch),
                          scratch=scratch, guard_group=sys.argv[3] == "guard")
    print(child.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("guard", ["guard", "no-guard"])
def test_the_box_dies_with_the_process_that_started_it(mode: str, tmp_path: Path, guard: str) -> None:
    # The worker is SIGKILLed mid-build. bwrap: --die-with-parent and the PID namespace take
    # everything. Without bwrap, PR_SET_PDEATHSIG reaches only the direct child, so the
    # grandchildren (ninja, compilers; here two sleeps) live on unless worker.sandbox.group_guard runs them.
    marker = f"{317 + (guard == 'guard') + 2 * (mode == 'bwrap')}.{os.getpid() % 1000}"
    sleepers = f"sleep {marker}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, marker, str(_work(tmp_path)), guard],
                              stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        parent.stdout.readline()
        assert len(processes.wait_for(f"^sleep {marker}", 2, timeout_s=30)) >= 2, "the command never started"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        left = processes.wait_gone(sleepers, timeout_s=5)
        if mode == "bwrap" or guard == "guard":
            assert left == [], f"processes outlived the worker: {left}"
        else:  # what the guard is for: shown here so the test above cannot pass vacuously
            assert len(processes.matching(f"^sleep {marker}")) == 2
    finally:
        for pid in processes.matching(sleepers):
            os.kill(pid, signal.SIGKILL)


def test_a_folder_holding_a_secret_is_never_shown(tmp_path: Path) -> None:
    from worker.sandbox.mounts import MountPlan

    home = tmp_path / "home"
    staging = home / "builds" / "abc.staging-1"
    staging.mkdir(parents=True)
    plan = MountPlan(read_only=[tmp_path, home / "builds"], writable=[staging],
                     secrets=[home, home / "admin-token", home / "builds"])
    args = plan.args()
    binds = {(args[i + 1], args[i + 2]) for i, flag in enumerate(args) if flag in ("--ro-bind", "--bind")}
    assert (str(tmp_path), str(tmp_path)) not in binds  # they hold the secret
    assert (str(home / "builds"), str(home / "builds")) not in binds
    assert (str(staging), str(staging)) in binds  # the staging folder itself is bound
    assert any(str(tmp_path) in reason for reason in plan.skipped)


HOST_PROBE_CASES = 4


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)")
def test_cuda_kernel_host_runs_in_the_box(mode: str, kernels_build) -> None:  # noqa: ANN001
    """The bundled kernels, built in the box (nvcc included), run on the GPU by a host in the box:
    the GPU's device nodes are bound in and nothing else changes a result."""
    from worker.battery import load_battery
    from worker.engine.host import KernelHost

    assert sandbox.available() == (mode == "bwrap")
    cases = [c for c in load_battery("quick").expand() if c.optimizer == "adam"][:HOST_PROBE_CASES]
    with KernelHost(kernels_build.library_path, device="cuda", case_timeout_s=300) as host:
        results = host.run_many(cases)
        assert host.environment.device_kind == "cuda", host.environment
    assert [r.status for r in results] == ["ok"] * len(cases), [r.message for r in results]


def test_the_kernel_host_box_shows_service_core_alone_and_a_case_still_runs(mode: str, kernels_build) -> None:  # noqa: ANN001
    """Of optdrift's `service`, the box shows service/__init__.py, the pure core and its deprecated
    aliases, nothing else:
    no API, database models, settings or command (worker/sandbox/mounts.py python_paths). A real
    host in the box reports what it sees (tests/fixtures/adapters/box_probe.py) and still runs a
    case bit for bit as the unboxed engine does. Without bubblewrap nothing is hidden (the probe
    shows the whole package), which is what the fallback's weaker measures say."""
    from worker.battery import load_battery
    from worker.engine.host import KernelHost
    from worker.engine.trajectory import run_case

    case = next(c for c in load_battery("quick").expand() if c.optimizer == "adam")
    probe_folder = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "adapters"
    with KernelHost(kernels_build.library_path, device="cpu", adapter="box_probe", adapter_paths=[probe_folder],
                    case_timeout_s=120) as host:
        result = host.run(case)
        seen = host.adapter_description
    assert result.status == "ok", result.message
    assert seen["finds service.core.results"] == "True"
    if mode == "bwrap":
        # ... and the core's deprecated aliases (service.core.moved), which old adapters import.
        assert seen["service_entries"] == "__init__.py,core,results.py,verdicts.py", seen
        # Around the packages only what this host was given (its build, its adapter's folder, the
        # virtual environment), never the checkout itself.
        shown = set(seen["code_root_entries"].split(","))
        assert {"service", "worker"} <= shown and not {".git", "docs", "pyproject.toml"} & shown, seen
        assert (seen["finds service.settings"], seen["finds service.api"], seen["finds service.db"]) == \
            ("False", "False", "False"), seen
    else:
        assert {"api", "db", "settings.py"} <= set(seen["service_entries"].split(",")), seen
    from worker.adapters import bundled_ops

    bundled_ops.load_build(kernels_build.library_path)
    unboxed = run_case(case, __import__("torch").device("cpu"))
    assert result.trajectory.digests == unboxed.trajectory.digests
