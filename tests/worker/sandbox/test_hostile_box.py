"""Issue 43's hostile box: submitted code inside the real box does every nasty thing to every path
the worker later touches, for each build kind and for the kernel host's scratch, while the worker
builds, reads and collects as it does for a run.

The box plants links (to canary files the worker can read: 0600 files in its HOME and
OPTDRIFT_HOME, the Fernet key, a file outside everything), FIFOs, sockets, links to /dev/zero,
large files, thousands of small files, names with newlines, and a loop that swaps a regular file
for a link while the worker reads. The tests assert that no canary byte reaches anything the
worker keeps or shows (results, errors, logs, taken files), that every canary file's hash and
mtime are unchanged, that every call returns within its deadline (a FIFO once hung the worker for
ever), and, through an audit hook on every `open` of this process, that nothing but
worker.sandbox.boxfiles opened a path beneath a folder a box was given to write.

Runs as the worker runs here (root, boxes dropping to uid 65534) where bubblewrap works; skipped
where it cannot make a box (the `bubblewrap` fixture).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from service.core.environments import BuildVariant
from service.core.project_config import parse_config
from worker.build import build_extension
from worker.build.cache import release_builds
from worker.build.project import build_project
from tests.fixtures.hostile.corpus import COMMAND_TOML, HOST_TOML
from worker.sandbox import boxfiles

REPO = Path(__file__).resolve().parents[3]
TINY_EXT = REPO / "tests" / "fixtures" / "tiny_ext"
EVIL_C = REPO / "tests" / "fixtures" / "hostile" / "evil.c"
DEADLINE_S = 240  # a build of tiny_ext is tens of seconds on two cores; a wedge is for ever

# ------------------------------------------------------------------------------------ the audit
_foreign_opens: list[str] = []
_auditing = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _auditing.is_set() or boxfiles.inside_helper():
        return
    path = args[0]
    if not isinstance(path, (str, bytes, os.PathLike)):
        return  # a descriptor
    path = os.fsdecode(path)
    if not os.path.isabs(path):
        return  # relative to a directory descriptor: the fd-based walks (rmtree) and the helper
    absolute = os.path.normpath(path)
    if any(absolute.startswith(folder + os.sep) for folder in boxfiles.box_folders()):
        _foreign_opens.append(absolute)


sys.addaudithook(_audit)  # process-wide and permanent: it records only while `_auditing` is set


@pytest.fixture
def audited() -> Iterator[list[str]]:
    _foreign_opens.clear()
    _auditing.set()
    try:
        yield _foreign_opens
    finally:
        _auditing.clear()


# ------------------------------------------------------------------------------------ canaries
@dataclass
class Canaries:
    files: dict[Path, tuple[str, int]]
    secrets: list[bytes]

    def changed(self) -> list[str]:
        return [str(path) for path, was in self.files.items() if _fingerprint(path) != was]

    def leaked_into(self, text: str | bytes) -> list[str]:
        data = text.encode(errors="replace") if isinstance(text, str) else text
        return [secret.decode() for secret in self.secrets if secret in data or secret[:16] in data]


def _fingerprint(path: Path) -> tuple[str, int] | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest(), path.stat().st_mtime_ns
    except OSError:
        return None


@pytest.fixture
def canaries(bubblewrap: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Canaries:
    worker_home = tmp_path / "worker-home"
    files = {
        worker_home / ".aws" / "credentials": b"aws_secret_access_key = canaryaws" + os.urandom(8).hex().encode(),
        worker_home / ".pgpass": b"127.0.0.1:5432:*:postgres:canarypg" + os.urandom(8).hex().encode(),
        bubblewrap / "secrets-key": b"canaryfernet" + os.urandom(16).hex().encode(),
        bubblewrap / "admin-token": b"canaryadmin" + os.urandom(16).hex().encode(),
        tmp_path / "outside" / "everything": b"canaryoutside" + os.urandom(16).hex().encode(),
    }
    for path, content in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(0o600)
    monkeypatch.setenv("HOME", str(worker_home))
    return Canaries(files={path: _fingerprint(path) for path in files}, secrets=list(files.values()))


def _targets(c: Canaries) -> list[str]:
    return [str(path) for path in c.files]


def _plant_script(c: Canaries, names: list[str]) -> str:
    """Shell that, in the current folder, leaves each of `names` as a different nasty thing, plus
    thousands of small files and a name with a newline (run inside the box)."""
    targets = _targets(c)
    lines = ["set +e"]
    shapes = [f'ln -sfn {targets[i % len(targets)]} "$n"' for i in range(len(targets))] + [
        'mkfifo "$n"', 'ln -sfn /dev/zero "$n"', 'ln -sfn /proc/self/environ "$n"',
        'python3 -c "import socket,sys; socket.socket(socket.AF_UNIX).bind(sys.argv[1])" "$n"',
        f'ln "{targets[0]}" "$n"',  # a hard link: fails across the box's mounts, tried anyway
    ]
    for i, name in enumerate(names):
        lines.append(f'n="{name}"; rm -rf "$n"; {shapes[i % len(shapes)]}')
    lines += ['mkdir -p many && i=0 && while [ $i -lt 3000 ]; do : > "many/f$i"; i=$((i+1)); done',
              "printf x > \"$(printf 'new\\nline.log')\"",
              'head -c 20000000 /dev/zero > big.bin']
    return "\n".join(lines) + "\n"


def _bounded(call: Callable[[], object], timeout_s: float = DEADLINE_S) -> object:
    """call() on a thread, failing the test if it does not return in time (the worker wedged)."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:  # noqa: BLE001 - re-raised below on the test's thread
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"the worker's call did not return within {timeout_s} s: a box wedged it"
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]


def _everything_kept(result, extra: list[Path] = ()) -> bytes:  # noqa: ANN001
    """What a run keeps of a build: its result (error, stats), its log, its manifest."""
    kept = [result.model_dump_json().encode()]
    for path in [Path(result.log_path) if result.log_path else None, *extra]:
        if path is not None and path.is_file() and not path.is_symlink():
            kept.append(path.read_bytes()[-(2 << 20):])
    return b"\n".join(kept)


# ------------------------------------------------------------------------------------ build kinds
@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_torch_extension_build_whose_compiler_plants_everywhere(canaries: Canaries, audited: list[str],
                                                                tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                trusted: bool) -> None:
    """A compiler gone bad (what `-wrapper` gave a tree before flags were an allow-list): around
    every compile it plants in its folder the names the worker used to keep there (build.log,
    manifest.json, last-used) and the ones it takes (ccache-stats.log, the library), and after
    the link replaces the library with a link to a canary."""
    tools = tmp_path / "tools"
    tools.mkdir()
    plant = tools / "plant.sh"
    plant.write_text(_plant_script(canaries, ["build.log", "manifest.json", "last-used", "ccache-stats.log",
                                              "../build.log", "../manifest.json"]))
    compiler = tools / "c++"
    # Only a compile or a link plants: the worker asks the compiler its version outside any box
    # (worker.build.toolchain: the operator's compiler is trusted), and that must stay harmless here.
    compiler.write_text(f"""#!/bin/sh
case " $* " in *" -c "*|*" -shared "*) ;; *) exec c++ "$@";; esac
c++ "$@"; status=$?
sh {plant} > /dev/null 2>&1
for a in "$@"; do case "$a" in *.so) rm -f "$a"; ln -s {_targets(canaries)[0]} "$a";; esac; done
for l in *.so; do [ -e "$l" ] || [ -L "$l" ] || continue; rm -f "$l"; ln -s {_targets(canaries)[2]} "$l"; done
exit $status
""")
    compiler.chmod(0o755)
    for path in (tools, plant):
        path.chmod(path.stat().st_mode | stat.S_IROTH | stat.S_IXOTH)
    monkeypatch.setenv("OPTDRIFT_SANDBOX_RO_PATHS", str(tools))  # the operator shows the compiler to the box
    from service.settings import get_settings
    get_settings.cache_clear()
    from worker import sandbox
    sandbox.worker_environment.cache_clear()
    try:
        result = _bounded(lambda: build_extension(TINY_EXT, cache_dir=tmp_path / "cache", cuda_archs=[],
                                                  trusted=trusted, compiler=str(compiler), timeout_s=200))
        assert not result.ok and "link" in (result.error or ""), result.error
        kept = _everything_kept(result, list((tmp_path / "cache").rglob("manifest.json")))
        assert canaries.leaked_into(kept) == []
    finally:
        release_builds()
    assert canaries.changed() == []
    assert audited == [], f"opened beneath a box's folder outside worker.sandbox.boxfiles: {audited[:5]}"




@pytest.mark.parametrize("trusted", [True, False], ids=["trusted", "untrusted"])
def test_command_build_that_plants_in_its_tree_and_scratch(canaries: Canaries, audited: list[str],
                                                           tmp_path: Path, trusted: bool) -> None:
    tree = tmp_path / "tree"
    tree.mkdir()
    stats = '"${CCACHE_STATSLOG:-$HOME/ccache-stats.log}"'
    (tree / "hostile.sh").write_text(
        "cd \"$HOME\"\n" + _plant_script(canaries, ["ccache-stats.log", "build.log", "x1", "x2", "x3", "x4",
                                                   "x5", "x6", "x7"])
        + f"rm -f {stats}; mkfifo {stats}\n"
        + "cd \"$OPTDRIFT_SOURCE_DIR\"\n" + _plant_script(canaries, ["out.so", "../build.log", "../manifest.json"])
        + "exit 0\n")
    toml = COMMAND_TOML.format(timeout_s=60)
    (tree / "optdrift.toml").write_text(toml)
    config = parse_config(toml)
    try:
        result = _bounded(lambda: build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[],
                                                trusted=trusted, variant=BuildVariant()))
        assert not result.ok, "build.library was planted as a link or special file and must be refused"
        kept = _everything_kept(result, list((tmp_path / "cache").rglob("manifest.json")))
        assert canaries.leaked_into(kept) == []
        if result.compiler_cache is not None:  # ccache is on PATH: its stats log was a FIFO
            assert result.compiler_cache.unread and "FIFO" in result.compiler_cache.unread
    finally:
        release_builds()
    assert canaries.changed() == []
    assert audited == [], f"opened beneath a box's folder outside worker.sandbox.boxfiles: {audited[:5]}"


# ------------------------------------------------------------------------------------ the kernel host


def test_kernel_host_that_swaps_its_output_files_while_the_worker_collects(canaries: Canaries,
                                                                          audited: list[str],
                                                                          tmp_path: Path) -> None:
    """The host's library starts, at load, a loop in its scratch that keeps replacing the files
    the worker collects (params.f32, states.npys, the co-run's params-0/1.f32) with links to the
    canaries, FIFOs, links to /dev/zero and plain files. Every case comes back within its timeout
    with the parameters or a refusal; nothing taken holds a canary byte."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the hostile kernel library")
    from worker.battery import BUILTIN_BATTERIES
    from worker.engine.host import KernelHost

    targets = _targets(canaries)
    shapes = [f'ln -sfn {t} "$n.tmp"' for t in targets] + [
        'mkfifo "$n.tmp"', 'ln -sfn /dev/zero "$n.tmp"', 'head -c 64 /dev/zero > "$n.tmp"']
    loop = "\n".join(["cd \"$HOME\"", "(", "  i=0", "  while :; do", "    i=$((i+1))",
                      "    for n in params.f32 states.npys params-0.f32 params-1.f32; do",
                      "      rm -f \"$n.tmp\"",
                      f"      case $((i % {len(shapes)})) in",
                      *[f"        {k}) {shape};;" for k, shape in enumerate(shapes)],
                      "      esac", "      mv -f \"$n.tmp\" \"$n\" 2>/dev/null", "    done", "  done",
                      ") > /dev/null 2>&1 < /dev/null &", "exit 0", ""])
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "evil.c").write_text(EVIL_C.read_text())
    (tree / "load.sh").write_text(loop)
    (tree / "case.sh").write_text("exit 0\n")
    config = parse_config(HOST_TOML.format(adapter="tinyopt"))
    build = build_project(tree, config, cache_dir=tmp_path / "cache", cuda_archs=[], trusted=False)
    assert build.ok, build.error
    case = next(c for c in BUILTIN_BATTERIES["quick"]().expand() if c.optimizer == "adam" and c.param_dtype == "float32")
    from worker.engine import params_file
    from worker.engine.corun import _Chunk

    outcomes, taken = [], []
    try:
        with KernelHost(build.library_path, device="cpu", adapter="tinyopt", case_timeout_s=60) as host:
            for attempt in range(12):
                destination = tmp_path / f"taken-{attempt}.f32"
                result = _bounded(lambda: host.run(case, params_out=destination), timeout_s=90)
                outcomes.append(result.status)
                if destination.exists():
                    assert not destination.is_symlink() and destination.stat().st_nlink == 1
                    assert canaries.leaked_into(destination.read_bytes()) == []
                assert canaries.leaked_into(result.model_dump_json()) == []
            # The co-run's chunk file, read while the loop swaps it (a FIFO there once blocked the
            # worker's open for ever): each take returns the parameters or a refusal, in time.
            chunk = _Chunk(0, [0], [case], tmp_path)
            for _ in range(20):
                try:
                    values = _bounded(lambda: chunk._taken_chunk_file(host, 0), timeout_s=30)
                except params_file.ParamsFileError as refused:
                    taken.append(str(refused))
                    continue
                assert canaries.leaked_into(values.tobytes()) == []
                taken.append("taken")
    finally:
        release_builds()
    assert outcomes and set(outcomes) <= {"ok", "broken"}
    assert len(taken) == 20
    assert canaries.changed() == []
    assert audited == [], f"opened beneath a box's folder outside worker.sandbox.boxfiles: {audited[:5]}"
