"""Issue 47: `optdrift check` says what a build is doing while it builds (worker.build.progress):
ninja's [n/m], CMake's [ 45%], compile lines counted, read from the build's log as it grows,
through worker.sandbox.boxfiles (the box wrote it)."""

from __future__ import annotations

import re
import shutil
import threading
import time
from pathlib import Path

from worker.build.progress import BuildStep, LogProgress, listening, watching

REPO_ROOT = Path(__file__).resolve().parents[3]


def test_the_steps_a_log_tells() -> None:
    progress = LogProgress()
    assert progress.feed("compile flags: host -O3\n") is None
    step = progress.feed("[3/12] c++ -MMD -MF adam.o.d -O3 -c /tmp/x/out/src/cpu/adam.cpp -o adam.o\n")
    assert step == BuildStep(3, 12, "compiling adam.cpp") and step.words() == "[3/12] compiling adam.cpp"
    assert progress.feed("[11/12] /tmp/w/c++ a.o b.o -shared -L/opt/torch/lib -o optdrift_kernels_1.so\n").what == \
        "linking optdrift_kernels_1.so"
    assert progress.feed("[ 45%] Building CXX object CMakeFiles/capiopt.dir/src/capiopt.cpp.o\n") == \
        BuildStep(45, 100, "Building CXX object CMakeFiles/capiopt.dir/src/capiopt.cpp.o")
    progress.feed("/usr/bin/g++ -O2 -fPIC -c src/a.cpp -o a.o\n/usr/bin/g++ -O2 -fPIC -c src/b.cpp")
    assert progress.step == BuildStep(1, None, "compiling a.cpp")  # b's line is not complete yet
    assert progress.feed(" -o b.o\n").words() == "2 compiled, compiling b.cpp"
    step = progress.feed("$ cmake --build build\n")
    assert step == BuildStep(0, None, "$ cmake --build build") and step.words() == "$ cmake --build build"


def test_a_log_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    """The box could leave a link where its log was: boxfiles refuses it, nothing is read."""
    secret = tmp_path / "secret"
    secret.write_text("[1/2] c++ -c leaked.cpp\n")
    (tmp_path / "build.log").symlink_to(secret)
    steps: list[BuildStep] = []
    with listening(steps.append), watching(tmp_path / "build.log"):
        time.sleep(1.2)
    assert steps == []


def test_steps_are_said_while_the_log_grows(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    log.write_text("")
    steps: list[tuple[float, BuildStep]] = []
    began = time.monotonic()

    def writer() -> None:
        for done in range(1, 4):
            with open(log, "a") as handle:
                handle.write(f"[{done}/3] c++ -c k{done}.cpp -o k{done}.o\n")
            time.sleep(0.8)

    with listening(lambda step: steps.append((time.monotonic() - began, step))), watching(log):
        thread = threading.Thread(target=writer)
        thread.start()
        thread.join()
    assert [step.done for _, step in steps] == [1, 2, 3]
    assert steps[0][0] < 1.5  # said while the build went on, not at its end


def test_no_listener_reads_nothing(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    log.write_text("[1/1] c++ -c a.cpp\n")
    before = threading.active_count()
    with watching(log):
        assert threading.active_count() == before  # no watcher started


def test_check_prints_build_progress_during_a_real_build(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """A real CMake + ninja build of the C API fixture project, into an empty cache: `check` says
    the build starts, then ninja's steps on stderr, before its verdict."""
    from service.cli.check import run_check

    tree = tmp_path / "capi"
    shutil.copytree(REPO_ROOT / "tests" / "fixtures" / "capi_project", tree,
                    ignore=shutil.ignore_patterns("commits", "build"))
    code = run_check(tree, None, device="cpu", cache_dir=tmp_path / "cache", attribute=False)
    captured = capsys.readouterr()
    assert code == 0, captured
    lines = captured.err.splitlines()
    assert f"  building {tree}" in lines, captured.err
    steps = [line for line in lines if re.fullmatch(rf"  building {re.escape(str(tree))}: \[\d+/\d+\] .+ \(\d+ s\)",
                                                    line)]
    assert steps, captured.err
    done, total = map(int, re.search(r"\[(\d+)/(\d+)\]", steps[-1]).groups())
    assert done == total  # the last step is always said
    assert lines.index(steps[0]) < next(i for i, line in enumerate(lines) if "battery:" in line)
