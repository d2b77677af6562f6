"""The parameter file a kernel host leaves in its scratch is written by submitted code: the worker
takes it only as a plain file with one name. A link would turn the co-run's and attribution's
reads toward a file outside the box (a worker secret read back as float32 "parameters")."""

from __future__ import annotations

import os
from pathlib import Path

from worker.engine.host import take_params_file


def test_a_plain_parameter_file_is_taken(tmp_path: Path) -> None:
    written = tmp_path / "scratch.f32"
    written.write_bytes(b"\x00" * 16)
    assert take_params_file(written, tmp_path / "out.f32", max_bytes=16) is None
    assert (tmp_path / "out.f32").read_bytes() == b"\x00" * 16 and not written.exists()


def test_a_link_to_a_file_outside_the_box_is_refused(tmp_path: Path) -> None:
    secret = tmp_path / "worker-token"
    secret.write_text("not for the kernel")
    for name, make in (("symlink", os.symlink), ("hardlink", os.link)):
        written = tmp_path / f"{name}.f32"
        make(secret, written)
        reason = take_params_file(written, tmp_path / f"{name}-out.f32", max_bytes=1024)
        assert reason and "link" in reason, name
        assert not (tmp_path / f"{name}-out.f32").exists()


def test_no_file_is_no_parameters(tmp_path: Path) -> None:
    assert take_params_file(tmp_path / "absent.f32", tmp_path / "out.f32", max_bytes=16) is None
    assert not (tmp_path / "out.f32").exists()


def test_a_fifo_or_an_oversized_file_is_refused_without_waiting(tmp_path: Path) -> None:
    """Issue 43: a FIFO in the scratch blocked the worker's open for ever (no writer ever comes);
    a file larger than the case's parameters is refused, not read."""
    fifo = tmp_path / "fifo.f32"
    os.mkfifo(fifo)
    reason = take_params_file(fifo, tmp_path / "fifo-out.f32", max_bytes=16)
    assert reason and "FIFO" in reason
    big = tmp_path / "big.f32"
    big.write_bytes(b"\x00" * 17)
    reason = take_params_file(big, tmp_path / "big-out.f32", max_bytes=16)
    assert reason and "more than 16 bytes" in reason
    assert not (tmp_path / "fifo-out.f32").exists() and not (tmp_path / "big-out.f32").exists()
