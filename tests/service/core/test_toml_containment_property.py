"""Issue 33: a tree that names host paths anywhere in its optdrift.toml sees none of them.

Hypothesis writes optdrift.toml files from what an attacker would put in them: build.env names
(build knobs, the loader's and interpreters' variables, search paths, random ones) and values
(host folders holding a canary, glued to compiler options, in path lists), build.library,
adapter_path, source_dir, battery and commands naming host paths or stepping out with `..`. Each
file is either refused by the configuration's validation (the API's 422, the worker's failed run),
or, when accepted, its command build's box is exactly the box of a tree without the file: the same
binds, the launcher's part of the command line free of anything the tree said. A few of them are
also run for real under bubblewrap, where a probe looks for the canary everywhere the tree's config
pointed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from service.core.project_config import BUILD_ENV_NAMES, ProjectConfig, ProjectConfigError, parse_config
from worker import sandbox
from worker.build import project as command_build

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bubblewrap is Linux-only")

CANARY_TEXT = "canary-toml-containment-0d2f"
# Host folders an attacker names (issue 33 item 3's CPATH list, and a folder with a planted canary).
HOST_PATHS = ["/run/postgresql", "/root", "/proc", "/etc", "/var", "/home", "/run", "/tmp"]


def _canary_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "host-canary"
    folder.mkdir(exist_ok=True)
    folder.chmod(0o755)
    secret = folder / "secret.txt"
    secret.write_text(CANARY_TEXT)
    secret.chmod(0o644)
    return folder


def _host_path(canary: str):  # noqa: ANN202
    return st.sampled_from([canary, f"{canary}/secret.txt", *HOST_PATHS])


def _env_value(canary: str):  # noqa: ANN202
    word = st.one_of(
        _host_path(canary),
        st.builds(lambda option, path: option + path, st.sampled_from(["-I", "-L", "--sysroot=", "-isystem", "-B", "-DX="]),
                  _host_path(canary)),
        st.sampled_from(["..", "../..", "x/../../y", "~/x", "-O3", "Release", "4", "9.0;8.6"]),
        st.text(alphabet="abcXYZ019_-.=/", max_size=12),
    )
    return st.lists(word, min_size=1, max_size=4).flatmap(
        lambda words: st.sampled_from([":", " ", ";", ","]).map(lambda sep: sep.join(words)))


def _env_name():  # noqa: ANN202
    return st.one_of(
        st.sampled_from(sorted(BUILD_ENV_NAMES)),
        st.sampled_from(["CMAKE_ARGS", "CMAKE_BUILD_PARALLEL_LEVEL", "NVCC_APPEND_FLAGS", "BUILD_EXTRA"]),
        st.sampled_from(["PATH", "LD_PRELOAD", "LD_LIBRARY_PATH", "LIBRARY_PATH", "CPATH", "CUDA_HOME",
                         "CUDA_PATH", "PYTHONPATH", "PYTHONSTARTUP", "BASH_ENV", "ENV", "GCONV_PATH", "CCACHE_DIR",
                         "HTTPS_PROXY", "https_proxy", "HOME", "TMPDIR", "CMAKE_CXX_COMPILER_LAUNCHER",
                         "CMAKE_TOOLCHAIN_FILE", "NVCC_CCBIN", "LD_AUDIT", "MALLOC_CONF"]),
        st.from_regex(r"\A[A-Z][A-Z0-9_]{0,12}\Z"),
    )


def _relative_or_hostile(canary: str):  # noqa: ANN202
    return st.one_of(st.sampled_from(["out.so", "build/lib", "tools", "."]), _host_path(canary),
                     st.sampled_from(["../out.so", "a/../../b", "./../x"]))


def _config_text(canary: str):  # noqa: ANN202
    return st.fixed_dictionaries({
        "env": st.dictionaries(_env_name(), _env_value(canary), max_size=4),
        "library": _relative_or_hostile(canary),
        "adapter_path": st.lists(_relative_or_hostile(canary), max_size=2),
        "battery": st.one_of(st.just("quick"), _relative_or_hostile(canary)),
        "commands": st.lists(st.builds(lambda p: f"sh -c 'cat {p}'", _host_path(canary)), min_size=1, max_size=2),
    }).map(_toml)


def _toml(fields: dict) -> str:
    return "\n".join([
        "[project]", f"adapter_path = {json.dumps(fields['adapter_path'])}", f"battery = {json.dumps(fields['battery'])}",
        "[build]", 'kind = "command"', f"commands = {json.dumps(fields['commands'])}",
        f"library = {json.dumps(fields['library'])}",
        "env = { " + ", ".join(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in fields["env"].items()) + " }",
    ]) + "\n"


def _accepted(text: str) -> ProjectConfig | None:
    tomllib.loads(text)  # the strategy writes valid TOML: a decoding error is the test's own bug
    try:
        return parse_config(text)
    except ProjectConfigError:
        return None  # refused, with its message: what the API answers 422 and a run fails with


@pytest.fixture
def box(bubblewrap, tmp_path: Path):  # noqa: ANN001, ANN201
    work, scratch = tmp_path / "work" / "tree", tmp_path / "scratch"
    for folder in (work, scratch):
        folder.mkdir(parents=True)
        folder.chmod(0o755)
    return _canary_folder(tmp_path), work, scratch


def _binds(command: list[str]) -> set[tuple[str, str]]:
    launch = command[:command.index("--")]
    return {(arg, launch[i + 1]) for i, arg in enumerate(launch) if arg in ("--ro-bind", "--bind", "--dev-bind")}


def _raw_fields(text: str) -> tuple[dict[str, str], list[str]]:
    """What the file says, taken as it is, whether or not validation would accept it: the box must
    hold without the validation too (it is a second line, not the only one)."""
    data = tomllib.loads(text)
    return dict(data["build"].get("env", {})), [data["build"]["library"], *data["project"]["adapter_path"]]


def _child_env(raw_env: dict[str, str], work: Path, scratch: Path) -> dict[str, str]:
    plain = parse_config('[build]\nkind = "command"\ncommands = ["true"]\nlibrary = "out.so"\n')
    return {**command_build._environment(plain, [], work, scratch), **raw_env}


def _box_command(env: dict[str, str], work: Path, scratch: Path) -> list[str]:
    return sandbox.bwrap_command(["sh", "-c", "true"], env=env, writable=[work], cwd=work)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whatever_the_toml_says_the_box_is_the_box_of_a_tree_without_one(box, data) -> None:  # noqa: ANN001
    canary, work, scratch = box
    text = data.draw(_config_text(str(canary)), label="optdrift.toml")
    config = _accepted(text)
    event("accepted by validation" if config is not None else "refused by validation")
    if config is not None:  # what the worker applies: the validated knobs, checked again there
        command_build._environment(config, [], work, scratch)
    raw_env, _ = _raw_fields(text)
    plain_env = _child_env({}, work, scratch)
    command, expected = _box_command(_child_env(raw_env, work, scratch), work, scratch), _box_command(plain_env, work, scratch)
    assert _binds(command) == _binds(expected), "the tree's configuration changed what the box binds"
    # Everything before the child's own command (bwrap's options, the fixed environment it passes on)
    # is the same as for a tree that says nothing: the tree's values appear only after `env -i`.
    launch, expected_launch = command[:command.index("--")], expected[:expected.index("--")]
    assert launch == expected_launch
    assert not any(str(canary) in arg for arg in launch)


PROBE = textwrap.dedent("""
    import os, sys
    canary_text, paths = sys.argv[1], sys.argv[2:]
    for name, value in os.environ.items():
        paths += [p for p in value.replace(";", ":").replace(" ", ":").replace("=", ":").split(":") if p.startswith("/")]
    for path in paths:
        try:
            if os.path.isdir(path):
                for entry in os.listdir(path):
                    full = os.path.join(path, entry)
                    if os.path.isfile(full) and canary_text in open(full, errors="replace").read(4096):
                        print("SEEN", full)
            elif canary_text in open(path, errors="replace").read(4096):
                print("SEEN", path)
        except OSError:
            pass
    print("probe-done")
""")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whatever_the_toml_says_the_build_never_sees_the_canary(box, data) -> None:  # noqa: ANN001
    canary, work, scratch = box
    text = data.draw(_config_text(str(canary)), label="optdrift.toml")
    raw_env, named_paths = _raw_fields(text)
    probe = work / "probe.py"
    probe.write_text(PROBE)
    looked_at = [str(canary), f"{canary}/secret.txt", *(p if p.startswith("/") else str(work / p) for p in named_paths)]
    # -I: the probe itself ignores PYTHON* variables the tree may have set (it must run to look).
    child = sandbox.popen([sys.executable, "-I", str(probe), CANARY_TEXT, *looked_at], limits=sandbox.BUILD_LIMITS,
                          env=_child_env(raw_env, work, scratch), writable=[work], scratch=scratch, cwd=work,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = child.communicate(timeout=120)[0].decode(errors="replace")
    assert "probe-done" in out, out
    assert "SEEN" not in out, out


def test_the_canary_is_seen_where_the_box_is_not():
    """The probe's own check: run outside any box, it finds the canary (else the tests above prove nothing)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        canary = _canary_folder(Path(tmp))
        out = subprocess.run([sys.executable, "-I", "-c", PROBE, CANARY_TEXT, str(canary)], capture_output=True,
                             text=True, timeout=60).stdout
    assert "SEEN" in out and "probe-done" in out


def test_benign_build_knobs_are_accepted_and_host_paths_refused() -> None:
    ok = _accepted('[build]\nkind = "command"\ncommands = ["make"]\nlibrary = "out.so"\n'
                   'env = { CMAKE_BUILD_PARALLEL_LEVEL = "2", CXXFLAGS = "-O3 -Iinclude", TORCH_CUDA_ARCH_LIST = "9.0;8.6" }\n')
    assert ok is not None and ok.build.env["CXXFLAGS"] == "-O3 -Iinclude"
    for name, value in (("PATH", ".:/usr/bin"), ("LD_PRELOAD", "x.so"), ("CPATH", "/run/postgresql"),
                        ("CXXFLAGS", "-I/root"), ("CMAKE_ARGS", "-DX=../.."), ("https_proxy", "x")):
        with pytest.raises(ProjectConfigError, match=name):
            parse_config(f'[build]\nkind = "command"\ncommands = ["make"]\nlibrary = "out.so"\n'
                         f'env = {{ {name} = {json.dumps(value)} }}\n')
