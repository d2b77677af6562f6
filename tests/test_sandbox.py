"""The sandbox builds and kernel hosts run in (worker/sandbox.py): no secrets in the environment,
no network, resource limits that bite, its own process group, scratch removed afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests import processes
from worker import sandbox

PROBE = textwrap.dedent("""
    import json, os, resource, socket
    out = {"env": sorted(os.environ), "pgid_is_pid": os.getpgid(0) == os.getpid(),
           "tmp": os.environ.get("TMPDIR"), "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
           "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0]}
    s = socket.socket(); s.settimeout(2)
    try:
        s.connect(("127.0.0.1", 6379)); out["net"] = "connected"
    except OSError as e:
        out["net"] = str(e)
    open(os.path.join(os.environ["TMPDIR"], "left-behind"), "w").write("x")
    print(json.dumps(out))
""")


def _run(limits: sandbox.SandboxLimits, code: str, scratch) -> subprocess.CompletedProcess:  # noqa: ANN001
    secrets = {"PATH": os.environ["PATH"], "OPTDRIFT_DATABASE_URL": "postgresql://u:secret@db/x",
               "OPTDRIFT_WORKER_TOKEN": "odt_secret", "AWS_SECRET_ACCESS_KEY": "k",
               "OPTDRIFT_TEST_HOST_FAULT": "abort:never"}
    process = sandbox.popen([sys.executable, "-c", code], limits=limits,
                            env=sandbox.sandbox_env(scratch=scratch, source=secrets),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=60)
    return subprocess.CompletedProcess(process.args, process.returncode, out.decode(), err.decode())


def test_environment_network_limits_group_and_scratch() -> None:
    import json

    scratch_holder = sandbox.Scratch()
    with scratch_holder as scratch:
        result = _run(sandbox.HOST_LIMITS, PROBE, scratch)
        assert result.returncode == 0, result.stderr
        seen = json.loads(result.stdout)
        assert (scratch / "left-behind").exists()
    assert not scratch_holder.path.exists()
    assert "OPTDRIFT_DATABASE_URL" not in seen["env"] and "OPTDRIFT_WORKER_TOKEN" not in seen["env"]
    assert "AWS_SECRET_ACCESS_KEY" not in seen["env"] and "OPTDRIFT_TEST_HOST_FAULT" in seen["env"]
    assert seen["tmp"] == str(scratch) and seen["pgid_is_pid"]
    assert seen["cpu"] == sandbox.HOST_LIMITS.cpu_seconds
    assert seen["fsize"] == sandbox.HOST_LIMITS.file_size_bytes
    available, reason = sandbox.network_isolation()
    if not available:
        pytest.skip(f"network isolation unavailable here: {reason}")
    assert seen["net"] != "connected" and "unreachable" in seen["net"], seen["net"]


def test_file_size_and_cpu_limits_stop_the_child(tmp_path) -> None:
    tight = sandbox.SandboxLimits(cpu_seconds=1, file_size_bytes=1024 * 1024, max_processes=4096)
    big_write = f"open({str(tmp_path / 'big')!r}, 'wb').write(b'0' * (8 * 1024 * 1024))"
    result = _run(tight, big_write, tmp_path)
    assert result.returncode != 0 and ("File too large" in result.stderr or result.returncode < 0)
    assert (tmp_path / "big").stat().st_size <= 1024 * 1024
    spin = _run(tight, "while True: pass", tmp_path)
    assert spin.returncode in (-9, -24), spin  # SIGXCPU (24) at the soft limit, SIGKILL at hard


PARENT = textwrap.dedent("""
    import subprocess, sys, time
    from pathlib import Path
    from worker import sandbox
    scratch = Path(sys.argv[2])
    # A build-like tree: the command starts grandchildren (as ninja starts compilers).
    child = sandbox.popen(["sh", "-c", "sleep " + sys.argv[1] + " & sleep " + sys.argv[1] + "; wait"],
                          limits=sandbox.BUILD_LIMITS, env=sandbox.sandbox_env(scratch=scratch),
                          guard_group=sys.argv[3] == "guard")
    print(child.pid, flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("guard", ["guard", "no-guard"])
def test_a_guarded_group_dies_with_the_process_that_started_it(tmp_path, guard) -> None:
    # The worker is SIGKILLed mid-build: PR_SET_PDEATHSIG reaches only its direct child, so without
    # the guard the grandchildren (ninja, compilers; here two sleeps) live on.
    import signal

    marker = f"{317 + (guard == 'guard')}.{os.getpid() % 1000}"
    sleepers = f"sleep {marker}"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, marker, str(tmp_path), guard],
                              stdout=subprocess.PIPE, text=True)
    try:
        parent.stdout.readline()
        # (the shell's and the guard's command lines name the sleeps too)
        assert len(processes.wait_for(sleepers, 2, timeout_s=30)) >= 2, "the sandboxed command never started"
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        left = processes.wait_gone(sleepers, timeout_s=5)
        if guard == "guard":
            assert left == [], f"processes outlived the worker: {left}"
        else:  # what the guard is for: shown here so the test above cannot pass vacuously
            assert len(left) == 2
    finally:
        for pid in processes.matching(sleepers):
            os.kill(pid, signal.SIGKILL)
