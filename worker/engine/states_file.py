"""The attribution's state file: every step's optimizer state leaves, as a kernel host writes them
and as the worker reads them back.

Attribution judges a change by the states as well as the parameters (worker/attribution/states.py):
a contraction that moves a float32 moment by one ulp while the bfloat16 parameters stay put is
rounding-level, a moved quantization code is its own class. The kernel host (which runs submitted
code, in the box) writes, per step, one `.npy` record naming the leaves ("name<TAB>dtype", the
torch dtype) and then one record per leaf, in that order: floating-point leaves as float32 (exact
for float16, bfloat16 and the float8 formats), float64 as itself, integer and bool leaves as they are.

The reader (the worker, numpy only) treats the file as untrusted input: opened without following a
link, a plain file within a size bound, records read by their header with a dtype allow-list (no
pickles, no object arrays), each record's declared size checked against what is left of the file
before anything is allocated, and exactly the expected number of steps.
"""

from __future__ import annotations

import io
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

# What a leaf may be stored as (numpy's dtype.str): float32 / float64, integers, bool.
_LEAF_DTYPES = {"<f4", "<f8", "|u1", "|i1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "|b1"}
# The names record: unicode strings of at most this many characters each, at most this many leaves.
_NAME_CHARS = 256
MAX_LEAVES = 64
# A state may be larger than the parameters (AdEMAMix keeps three moments; a blockwise state adds
# scales), but not without bound: the reader refuses a file above this many times the parameters'
# float32 bytes (plus a fixed allowance for the records' headers).
STATE_BYTES_PER_PARAM_BYTE = 16
_HEADER_ALLOWANCE = 1 << 20


class StatesUnreadable(ValueError):
    """The state file is missing, malformed or larger than allowed: attribution reads the parameters alone."""


def write_step(out: BinaryIO, named: list[tuple[str, object]]) -> None:
    """One step's leaves, (name, plain torch tensor) in the order the digest reads them."""
    import torch

    names, arrays = [], []
    for name, tensor in named[:MAX_LEAVES]:
        values = tensor.detach().reshape(-1).cpu()
        if values.is_floating_point():
            values = values if values.dtype == torch.float64 else values.float()
        names.append(f"{str(name)[:_NAME_CHARS - 16]}\t{str(tensor.dtype).removeprefix('torch.')}")
        arrays.append(values.numpy())
    np.lib.format.write_array(out, np.array(names, dtype=f"<U{_NAME_CHARS}"), allow_pickle=False)
    for values in arrays:
        np.lib.format.write_array(out, np.ascontiguousarray(values), allow_pickle=False)


@dataclass
class States:
    """What a state file held: per step, leaf name -> values; the torch dtype of each float leaf
    stored wider than it is (bfloat16, float16, float8), for its ulps."""

    steps: list[dict[str, np.ndarray]]
    dtypes: dict[str, str]


def byte_limit(param_elements: int, steps: int) -> int:
    """The largest state file accepted for a case of `param_elements` parameters and `steps` steps."""
    return STATE_BYTES_PER_PARAM_BYTE * 4 * param_elements * steps + _HEADER_ALLOWANCE


def read(path: str | Path, *, steps: int, max_bytes: int) -> States:
    """The file's `steps` steps (module doc: read as untrusted). Raises StatesUnreadable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        raise StatesUnreadable(f"the state file could not be opened ({error.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StatesUnreadable("the state file is not a plain file")
        if info.st_size > max_bytes:
            raise StatesUnreadable(f"the state file holds {info.st_size} bytes, more than the {max_bytes} allowed "
                                   f"for this case")
        with os.fdopen(os.dup(fd), "rb") as handle:
            data = handle.read(max_bytes + 1)
    finally:
        os.close(fd)
    stream = io.BytesIO(data)
    out, dtypes = [], {}
    for step in range(1, steps + 1):
        names = _record(stream, names=True, step=step)
        leaves = {}
        for entry in names:
            name, _, dtype = str(entry).partition("\t")
            if not name or name in leaves:
                raise StatesUnreadable(f"step {step}: a leaf name is empty or repeated ({name!r})")
            leaves[name] = _record(stream, names=False, step=step)
            if dtype in ("bfloat16", "float16") or dtype.startswith("float8"):
                dtypes[name] = dtype
        out.append(leaves)
    if stream.read(1):
        raise StatesUnreadable(f"the state file holds more than the case's {steps} steps")
    return States(steps=out, dtypes=dtypes)


def _record(stream: io.BytesIO, *, names: bool, step: int) -> np.ndarray:
    """One .npy record, its header checked before its data is taken."""
    try:
        version = np.lib.format.read_magic(stream)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
        else:
            raise StatesUnreadable(f"step {step}: a record of .npy version {version}")
    except (ValueError, EOFError) as error:  # a cut or garbled header
        raise StatesUnreadable(f"step {step}: a record's header is unreadable ({error})") from None
    if fortran or len(shape) != 1:
        raise StatesUnreadable(f"step {step}: a record is not one-dimensional")
    if names:
        if dtype.kind != "U" or dtype.itemsize > 4 * _NAME_CHARS or shape[0] > MAX_LEAVES:
            raise StatesUnreadable(f"step {step}: the leaf names record is not a short list of names")
    elif dtype.str not in _LEAF_DTYPES:
        raise StatesUnreadable(f"step {step}: a leaf of dtype {dtype.str!r}, not a number")
    size = shape[0] * dtype.itemsize
    data = stream.read(size)
    if len(data) != size:
        raise StatesUnreadable(f"step {step}: a record is cut short")
    return np.frombuffer(data, dtype=dtype).copy()
