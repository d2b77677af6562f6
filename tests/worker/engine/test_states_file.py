"""worker/engine/states_file.py: the state leaves a kernel host writes for attribution, read back by
the worker as untrusted input (the host runs submitted code): what it wrote comes back exactly, with
the dtypes a float32 copy hides; a pickle, an object array, a record that claims more than the file
holds, a file over the case's bound, a link or a step too many is refused with a reason, never read."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from worker.engine import states_file
from worker.engine.states_file import StatesUnreadable, byte_limit, read, write_step

SIZE, STEPS = 7, 3


def _leaves(step: int) -> list[tuple[str, torch.Tensor]]:
    return [("exp_avg", torch.arange(SIZE, dtype=torch.float32) * step / 3),
            ("exp_avg_sq", (torch.arange(SIZE, dtype=torch.float32) / 7 + step).to(torch.bfloat16)),
            ("state1.codes", torch.arange(SIZE, dtype=torch.uint8) + step),
            ("absmax", torch.tensor([0.5 * step], dtype=torch.float64))]


def _write(path: Path, steps: int = STEPS) -> None:
    with open(path, "wb") as out:
        for step in range(1, steps + 1):
            write_step(out, _leaves(step))


def test_what_the_host_writes_comes_back_exactly_with_its_dtypes(tmp_path: Path) -> None:
    _write(tmp_path / "s.npys")
    states = read(tmp_path / "s.npys", steps=STEPS, max_bytes=byte_limit(SIZE, STEPS))
    assert len(states.steps) == STEPS
    for step, leaves in enumerate(states.steps, start=1):
        expected = dict(_leaves(step))
        assert list(leaves) == list(expected)
        for name, values in leaves.items():
            wanted = expected[name]
            wanted = wanted.float() if wanted.dtype == torch.bfloat16 else wanted
            assert np.array_equal(values, wanted.numpy()), name  # exact: bfloat16 widens exactly
    assert states.steps[0]["state1.codes"].dtype == np.uint8
    assert states.dtypes == {"exp_avg_sq": "bfloat16"}  # the leaf stored wider than it is


def _raw(*arrays: np.ndarray, allow_pickle: bool = False) -> bytes:
    out = io.BytesIO()
    for array in arrays:
        np.lib.format.write_array(out, array, allow_pickle=allow_pickle)
    return out.getvalue()


def _names(*names: str) -> np.ndarray:
    return np.array(names, dtype="<U256")


@pytest.mark.parametrize("body, reason", [
    (lambda: _raw(_names("a\tfloat32"), np.array([{"x": 1}], dtype=object), allow_pickle=True), "not a number"),
    (lambda: _raw(np.array([1.0], dtype="<f4")), "not a short list of names"),
    (lambda: _raw(_names("a\tfloat32", "a\tfloat32"), np.zeros(2, "<f4"), np.zeros(2, "<f4")), "repeated"),
    (lambda: _raw(_names("a\tfloat32"), np.zeros((2, 2), "<f4")), "not one-dimensional"),
    (lambda: b"\x93NUMPY garbage", "header is unreadable"),
    (lambda: b"", "header is unreadable"),
])
def test_a_malformed_record_is_refused_with_its_reason(tmp_path: Path, body, reason) -> None:  # noqa: ANN001
    (tmp_path / "s.npys").write_bytes(body())
    with pytest.raises(StatesUnreadable, match=reason):
        read(tmp_path / "s.npys", steps=1, max_bytes=byte_limit(SIZE, 1))


def test_a_record_claiming_more_than_the_file_holds_allocates_nothing(tmp_path: Path) -> None:
    # A header that declares 2**40 float32 values over a few bytes of data: refused from the bytes
    # left, before numpy is asked for 4 TiB.
    honest = _raw(_names("a\tfloat32"), np.zeros(4, "<f4"))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 40,)})
    forged = _raw(_names("a\tfloat32")) + header.getvalue() + b"\x00" * 16
    (tmp_path / "s.npys").write_bytes(forged)
    with pytest.raises(StatesUnreadable, match="cut short"):
        read(tmp_path / "s.npys", steps=1, max_bytes=len(honest) * 4)


def test_a_file_over_the_case_s_bound_is_not_read(tmp_path: Path) -> None:
    _write(tmp_path / "s.npys")
    size = (tmp_path / "s.npys").stat().st_size
    with pytest.raises(StatesUnreadable, match="more than the"):
        read(tmp_path / "s.npys", steps=STEPS, max_bytes=size - 1)
    assert read(tmp_path / "s.npys", steps=STEPS, max_bytes=size).steps  # the bound itself is allowed


def test_more_or_fewer_steps_than_the_case_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "s.npys")
    with pytest.raises(StatesUnreadable, match="more than the case's 2 steps"):
        read(tmp_path / "s.npys", steps=2, max_bytes=byte_limit(SIZE, STEPS))
    with pytest.raises(StatesUnreadable, match="step 4"):
        read(tmp_path / "s.npys", steps=4, max_bytes=byte_limit(SIZE, STEPS))


def test_a_link_or_a_missing_file_is_not_followed(tmp_path: Path) -> None:
    secret = tmp_path / "worker-token"
    _write(secret)
    os.symlink(secret, tmp_path / "link.npys")
    with pytest.raises(StatesUnreadable, match="could not be opened"):
        read(tmp_path / "link.npys", steps=STEPS, max_bytes=byte_limit(SIZE, STEPS))
    with pytest.raises(StatesUnreadable, match="could not be opened"):
        read(tmp_path / "absent.npys", steps=STEPS, max_bytes=byte_limit(SIZE, STEPS))


def test_the_bound_allows_many_states_the_size_of_the_parameters() -> None:
    # AdEMAMix's three float32 moments and blockwise scales fit well within the bound.
    assert byte_limit(4097, 20) >= 4 * 4 * 4097 * 20 and states_file.MAX_LEAVES >= 8
