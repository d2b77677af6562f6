"""Issue 33, items 1-3: what a child's environment can do to the box that runs it. Nothing.

The child's environment is fed by a submitted tree (build.env), so it is attacker input. These
tests hand the sandbox hostile environments directly (below the configuration's allowlist, which
would refuse them: the box must hold without it) and check, with real bubblewrap processes:

- the programs that make the box (bwrap, as root setpriv) are the worker's, by absolute path: a
  `setpriv` in a folder first on the child's PATH never runs (issue 33 item 1, as root);
- LD_PRELOAD in the child's environment is not loaded by bwrap outside the namespaces (item 2);
- search-path values (CPATH, PATH, LD_LIBRARY_PATH, CUDA_HOME...) never become binds (item 3).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from worker import sandbox
from worker.sandbox import launcher

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bubblewrap is Linux-only")


@pytest.fixture(autouse=True)
def _bwrap(bubblewrap):  # noqa: ANN001, ANN202
    yield


def _folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    return folder


def _run(args: list[str], env: dict[str, str], work: Path, scratch: Path) -> subprocess.CompletedProcess:
    child = sandbox.popen(args, limits=sandbox.BUILD_LIMITS, env=env, writable=[work], scratch=scratch, cwd=work,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, _ = child.communicate(timeout=120)
    return subprocess.CompletedProcess(args, child.returncode, out.decode(errors="replace"), "")


@pytest.mark.skipif(os.geteuid() != 0, reason="the identity drop (setpriv) runs only when the worker is root")
def test_a_setpriv_on_the_childs_path_never_runs(tmp_path: Path) -> None:
    work, scratch = _folder(tmp_path, "work"), _folder(tmp_path, "scratch")
    fake = work / "setpriv"
    fake.write_text("#!/bin/sh\necho PWNED-setpriv-as-$(id -u)\nexec \"$@\"\n")
    fake.chmod(0o755)
    env = sandbox.sandbox_env(scratch=scratch)
    env["PATH"] = f".:{work}:/usr/bin:/bin"  # what the tree's build.env asked for in the attack
    done = _run(["sh", "-c", "echo child-ran-as-$(id -u)"], env, work, scratch)
    assert done.returncode == 0, done.stdout
    assert "PWNED" not in done.stdout, "the tree's setpriv ran before the identity drop"
    assert f"child-ran-as-{sandbox.mounts.SANDBOX_UID}" in done.stdout


EVIL_PRELOAD = textwrap.dedent("""
    #include <fcntl.h>
    #include <unistd.h>
    __attribute__((constructor)) static void leak(void) {
        int fd = open("%s", O_WRONLY | O_CREAT | O_APPEND, 0644);
        if (fd >= 0) { char m[64]; int n = 0; const char *w = "loaded-by-uid ";
            while (w[n]) { m[n] = w[n]; n++; } m[n++] = '\\n'; write(fd, m, n); close(fd); }
    }
""")


def test_ld_preload_in_the_childs_environment_is_not_loaded_outside_the_box(tmp_path: Path) -> None:
    work, scratch, outside = _folder(tmp_path, "work"), _folder(tmp_path, "scratch"), _folder(tmp_path, "outside")
    outside.chmod(0o777)
    evidence = outside / "preload-ran"
    source = work / "evil.c"
    source.write_text(EVIL_PRELOAD % evidence)
    library = work / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120)
    env = sandbox.sandbox_env(scratch=scratch)
    env["LD_PRELOAD"] = str(library)
    done = _run(["sh", "-c", "echo child-done"], env, work, scratch)
    assert done.returncode == 0, done.stdout
    assert "child-done" in done.stdout
    # Outside the box only bwrap (and, as root, setpriv) could have written there: the folder is not
    # shown inside. The child itself loads the library, inside, where the write fails.
    assert not evidence.exists(), f"LD_PRELOAD ran outside the box: {evidence.read_text()!r}"


SEARCH_PATH_VARIABLES = ("PATH", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "CUDA_HOME", "CUDA_PATH", "TMPDIR", "HOME")


def test_search_path_values_in_the_childs_environment_never_become_binds(tmp_path: Path) -> None:
    work, scratch = _folder(tmp_path, "work"), _folder(tmp_path, "scratch")
    hidden = _folder(tmp_path, "hidden-host-folder")
    (hidden / "secret.txt").write_text("canary-search-path-bind")
    (hidden / "secret.txt").chmod(0o644)
    env = sandbox.sandbox_env(scratch=scratch)
    for name in SEARCH_PATH_VARIABLES:
        env[name] = os.pathsep.join([str(hidden), "/run", "/root", "/proc", "/etc", env.get(name, "")])
    command = sandbox.bwrap_command(["true"], env=env, writable=[work], cwd=work)
    launch_part = command[:command.index("--")]
    bound = {launch_part[i + 1] for i, arg in enumerate(launch_part) if arg in ("--ro-bind", "--bind", "--dev-bind")}
    for forbidden in (str(hidden), "/run", "/root", "/etc"):
        assert forbidden not in bound, f"{forbidden} bound because the child's environment named it"
    env["PATH"] = "/usr/bin:/bin"  # so `cat` is found; the other variables still name the folder
    done = _run(["cat", str(hidden / "secret.txt")], env, work, scratch)
    assert done.returncode != 0 and "canary-search-path-bind" not in done.stdout, done.stdout


def test_the_launcher_is_absolute_and_starts_with_its_own_environment(tmp_path: Path) -> None:
    work, scratch = _folder(tmp_path, "work"), _folder(tmp_path, "scratch")
    env = sandbox.sandbox_env(scratch=scratch)
    env.update({"LD_PRELOAD": "x.so", "PATH": ".", "GCONV_PATH": ".", "BASH_ENV": "./x"})
    command = sandbox.bwrap_command(["true"], env=env, writable=[work], cwd=work)
    found = launcher.launcher()
    assert command[0] == found.bwrap and os.path.isabs(command[0])
    launch_part, child_part = command[:command.index("--")], command[command.index("--") + 1:]
    assert "--clearenv" in launch_part
    set_by_bwrap = {launch_part[i + 1]: launch_part[i + 2] for i, arg in enumerate(launch_part) if arg == "--setenv"}
    assert set_by_bwrap == launcher.LAUNCHER_ENV, "bwrap gives setpriv/env more than the fixed environment"
    programs = [arg for arg in child_part if os.path.isabs(arg) and Path(arg).name in ("setpriv", "env")]
    assert programs and all(os.path.isabs(p) for p in programs)
    assert child_part[0] in (found.setpriv, found.env)
    # The child's environment is given by `env -i` after the drop, as NAME=VALUE arguments.
    env_at = child_part.index(found.env)
    assert child_part[env_at + 1:env_at + 3] == ["-i", "--"]
    assert "LD_PRELOAD=x.so" in child_part[env_at:]
    assert not any("LD_PRELOAD" in arg for arg in launch_part)
