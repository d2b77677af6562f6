"""worker.sandbox.boxfiles, the one door for files a box wrote (issue 43): every shape a box can
leave at a path the worker later takes, and what the worker gets from each."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from worker.sandbox import boxfiles

SECRET = b"aws_secret_access_key = canary-not-for-the-box\n"


@pytest.fixture
def box(tmp_path: Path) -> Path:
    folder = tmp_path / "box"
    folder.mkdir()
    return folder


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "credentials"
    path.write_bytes(SECRET)
    path.chmod(0o600)
    return path


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """Both ways of resolving a name: openat2 (this kernel has it) and the component walk that
    older kernels and seccomp profiles that refuse openat2 get."""
    if request.param == "walk":
        monkeypatch.setattr(boxfiles, "_openat2_works", False)
    else:
        (tmp_path / "probe").write_bytes(b"")
        boxfiles.read_bytes(tmp_path, "probe", max_bytes=1)  # probes openat2
        if boxfiles._openat2_works is False:
            pytest.skip("openat2 is not available on this kernel")
    return request.param


def test_a_plain_file_is_read_whole(box: Path, resolver: str) -> None:
    (box / "sub").mkdir()
    (box / "sub" / "stats.log").write_bytes(b"# src/a.cpp\ndirect_cache_hit\n")
    assert boxfiles.read_bytes(box, "sub/stats.log", max_bytes=100) == b"# src/a.cpp\ndirect_cache_hit\n"
    assert boxfiles.read_bytes(box, "absent.log", max_bytes=100) is None


@pytest.mark.parametrize("shape", ["symlink", "hardlink", "symlinked folder", "dangling link"])
def test_a_link_is_never_followed(box: Path, secret: Path, resolver: str, shape: str) -> None:
    if shape == "symlink":
        (box / "build.log").symlink_to(secret)
        name = "build.log"
    elif shape == "hardlink":
        os.link(secret, box / "build.log")
        name = "build.log"
    elif shape == "symlinked folder":
        (box / "out").symlink_to(secret.parent)
        name = f"out/{secret.name}"
    else:
        (box / "build.log").symlink_to(box / "nowhere")
        name = "build.log"
    with pytest.raises(boxfiles.BoxFileRefused, match="link"):
        boxfiles.read_bytes(box, name, max_bytes=1 << 20)
    with pytest.raises(boxfiles.BoxFileRefused, match="link"):
        boxfiles.copy_out(box, name, box.parent / "taken", max_bytes=1 << 20)
    assert not (box.parent / "taken").exists()


def test_the_box_folder_itself_replaced_by_a_link_is_refused(tmp_path: Path, secret: Path, resolver: str) -> None:
    (tmp_path / "scratch").symlink_to(secret.parent)
    with pytest.raises(boxfiles.BoxFileRefused, match="could not be opened as a folder"):
        boxfiles.read_bytes(tmp_path / "scratch", secret.name, max_bytes=1 << 20)


@pytest.mark.parametrize("name", ["../credentials", "/etc/passwd", "a/../../credentials", "", "."])
def test_names_that_leave_the_folder_are_refused_before_any_open(box: Path, secret: Path, name: str) -> None:
    with pytest.raises(boxfiles.BoxFileRefused, match="plain relative name"):
        boxfiles.read_bytes(box, name, max_bytes=1 << 20)


def test_a_fifo_is_refused_at_once_instead_of_waiting_for_a_writer(box: Path, resolver: str) -> None:
    """The open of a FIFO with no writer blocks for ever without O_NONBLOCK: run it on a thread
    and require it back within seconds (a hang would otherwise hang the test session)."""
    os.mkfifo(box / "ccache-stats.log")
    outcome: list[BaseException | object] = []

    def take() -> None:
        try:
            outcome.append(boxfiles.read_bytes(box, "ccache-stats.log", max_bytes=100))
        except BaseException as error:  # noqa: BLE001 - the test reads what it was
            outcome.append(error)

    thread = threading.Thread(target=take, daemon=True)
    thread.start()
    thread.join(timeout=5)
    if thread.is_alive():
        with open(box / "ccache-stats.log", "wb"):  # free the blocked open so the thread can end
            pass
        pytest.fail("opening a FIFO the box planted blocked the worker")
    assert isinstance(outcome[0], boxfiles.BoxFileRefused) and "FIFO" in str(outcome[0])


def test_sockets_and_folders_are_refused(box: Path, resolver: str) -> None:
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(box / "params.f32"))
    (box / "states.npys").mkdir()
    try:
        with pytest.raises(boxfiles.BoxFileRefused, match="socket"):
            boxfiles.read_bytes(box, "params.f32", max_bytes=100)
        with pytest.raises(boxfiles.BoxFileRefused, match="folder"):
            boxfiles.read_bytes(box, "states.npys", max_bytes=100)
    finally:
        server.close()


def test_a_file_over_the_bound_is_refused_not_cut(box: Path) -> None:
    (box / "stats.log").write_bytes(b"x" * 101)
    with pytest.raises(boxfiles.BoxFileRefused, match="more than 100 bytes"):
        boxfiles.read_bytes(box, "stats.log", max_bytes=100)
    assert boxfiles.read_bytes(box, "stats.log", max_bytes=101) == b"x" * 101


def test_copy_out_takes_exactly_the_expected_size_into_a_new_file(box: Path, tmp_path: Path) -> None:
    (box / "params.f32").write_bytes(b"\x01" * 64)
    destination = tmp_path / "taken.f32"
    destination.write_bytes(b"old")
    assert boxfiles.copy_out(box, "params.f32", destination, max_bytes=64, exact_bytes=64)
    assert destination.read_bytes() == b"\x01" * 64 and oct(destination.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(boxfiles.BoxFileRefused, match="not the 32 expected"):
        boxfiles.copy_out(box, "params.f32", tmp_path / "short.f32", max_bytes=32, exact_bytes=32)
    assert not list(tmp_path.glob(".*partial"))


def test_a_race_swapping_the_file_for_a_link_never_yields_the_secret(box: Path, secret: Path, resolver: str) -> None:
    """A box loop that replaces a plain file by a link to a secret and back while the worker takes
    it: each take gives the plain bytes or a refusal, never a secret byte."""
    stop = threading.Event()
    plain = b"plain parameters\n"

    def swap() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            temporary = box / f".swap-{n}"
            if n % 2:
                temporary.write_bytes(plain)
            else:
                temporary.symlink_to(secret)
            os.replace(temporary, box / "params.f32")

    swapper = threading.Thread(target=swap, daemon=True)
    swapper.start()
    taken = refused = 0
    deadline = time.monotonic() + 1.5
    try:
        while time.monotonic() < deadline:
            try:
                data = boxfiles.read_bytes(box, "params.f32", max_bytes=1 << 16)
            except boxfiles.BoxFileRefused:
                refused += 1
                continue
            assert data in (plain, None)
            taken += 1
    finally:
        stop.set()
        swapper.join()
    assert taken and refused, (taken, refused)


def test_box_folders_are_registered_when_a_child_is_given_them(tmp_path: Path) -> None:
    from worker import sandbox

    writable, scratch = tmp_path / "out", tmp_path / "scratch"
    writable.mkdir()
    scratch.mkdir()
    child = sandbox.popen(["true"], limits=sandbox.SandboxLimits(None, None, None), env=sandbox.sandbox_env(scratch=scratch),
                          writable=[writable], scratch=scratch)
    child.wait(timeout=60)
    assert {os.path.abspath(writable), os.path.abspath(scratch)} <= boxfiles.box_folders()
