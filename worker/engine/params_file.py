"""The co-run's parameter file: what a kernel host writes and how the parent reads it back.

A fast co-run (worker.engine.corun) sends a chunk of cases to each kernel host with a file name in
the host's scratch folder. The host writes, for each case of the request in request order, the
parameters after every step as float32 (exact for float32/float16/bfloat16), row-major
[steps, size]; case i starts `regions(cases)[i].offset` elements into the file. The parent maps
both hosts' files and computes the per-step max |commit - baseline| vectorised.

The file comes from a process that runs submitted code, so the parent opens it without following
links (a host could leave a symlink to one of the worker's files there), insists on a regular file
of exactly the expected size, and reads nothing else. numpy only: safe in a Celery parent.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.core.results import CaseSpec

# Rows of float64 work per diff task: bounds the parent's temporary memory (~3 x 8 bytes each).
DIFF_BLOCK_ELEMENTS = 1 << 22


@dataclass(frozen=True)
class Region:
    offset: int  # elements from the start of the file
    steps: int
    size: int

    @property
    def elements(self) -> int:
        return self.steps * self.size


def regions(cases: list[CaseSpec]) -> list[Region]:
    """Where each case's [steps, size] float32 block lies in a parameter file, in case order."""
    out, at = [], 0
    for case in cases:
        out.append(Region(at, case.steps, case.size))
        at += case.steps * case.size
    return out


def total_elements(cases: list[CaseSpec]) -> int:
    return sum(case.steps * case.size for case in cases)


class RegionWriter:
    """One case's [steps, size] block of a parameter file, written by the host with pwrite.

    pwrite copies into the page cache in the kernel: writing through a mapping of the new file
    instead faults every page of the new file in first, which costs more than the copy itself."""

    def __init__(self, fd: int, region: Region) -> None:
        self.fd, self.region = fd, region

    def __call__(self, first_step: int, rows: np.ndarray) -> None:
        """rows: [n, size] float32, the case's parameters after steps first_step .. first_step+n-1."""
        rows = np.ascontiguousarray(rows, dtype="<f4")
        if rows.ndim != 2 or rows.shape[1] != self.region.size or first_step + rows.shape[0] > self.region.steps:
            raise ValueError(f"rows {rows.shape} from step {first_step} do not fit a "
                             f"[{self.region.steps}, {self.region.size}] region")
        at = (self.region.offset + first_step * self.region.size) * 4
        view = memoryview(rows).cast("B")
        while view:  # pwrite may write less than asked (a signal, a large write)
            written = os.pwrite(self.fd, view, at)
            view, at = view[written:], at + written


def create_for_writing(path: str | Path, cases: list[CaseSpec]) -> tuple[int, list[RegionWriter]]:
    """A new parameter file of exactly the cases' size (zeros until written) and a writer per case,
    in case order; the caller closes the descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.ftruncate(fd, total_elements(cases) * 4)
    except OSError:
        os.close(fd)
        raise
    return fd, [RegionWriter(fd, region) for region in regions(cases)]


class ParamsFileError(RuntimeError):
    """A parameter file that is not what the protocol says (missing, a link, the wrong size)."""


def open_checked(path: Path, expected_elements: int) -> np.ndarray:
    """The file's float32 elements, mapped read-only, after checking it is a regular file (not
    followed through a link) of exactly `expected_elements` x 4 bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as error:
        raise ParamsFileError(f"parameter file {path} cannot be opened as a plain file: {error.strerror}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ParamsFileError(f"parameter file {path} is not a regular file")
        if info.st_size != expected_elements * 4:
            raise ParamsFileError(f"parameter file {path} holds {info.st_size} bytes, "
                                  f"not the {expected_elements * 4} its cases need")
        if expected_elements == 0:
            return np.zeros(0, dtype="<f4")
        return np.memmap(handle, dtype="<f4", mode="r", shape=(expected_elements,))


def _block_max(commit: np.ndarray, baseline: np.ndarray) -> np.ndarray:
    # Differences in float64, as the one-case co-run computes them (per_step_max_abs_diff).
    # A non-finite parameter on both sides (a float16 case gone to inf) has no difference: NaN, kept.
    with np.errstate(invalid="ignore"):
        return np.max(np.abs(commit.astype(np.float64) - baseline.astype(np.float64)), axis=1)


def per_step_max_abs_diffs(pairs: list[tuple[np.ndarray, np.ndarray]], *, threads: int | None = None,
                           ) -> list[list[float]]:
    """For each (commit, baseline) pair of [steps, size] float32 arrays, max |commit - baseline|
    per step, in float64: the same numbers as per_step_max_abs_diff on each step's row. Blocks of
    steps run in threads (numpy releases the GIL in these loops)."""
    tasks = []
    for pair_index, (commit, baseline) in enumerate(pairs):
        steps, size = commit.shape
        block = max(1, DIFF_BLOCK_ELEMENTS // max(1, size))
        tasks += [(pair_index, start, min(steps, start + block)) for start in range(0, steps, block)]
    out: list[list[float]] = [[0.0] * pair[0].shape[0] for pair in pairs]

    def work(task: tuple[int, int, int]) -> None:
        pair_index, start, stop = task
        commit, baseline = pairs[pair_index]
        out[pair_index][start:stop] = _block_max(commit[start:stop], baseline[start:stop]).tolist()

    workers = threads or max(1, min(8, os.cpu_count() or 1))
    if workers == 1 or len(tasks) <= 1:
        for task in tasks:
            work(task)
    else:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="optdrift-diffs") as pool:
            list(pool.map(work, tasks))
    return out
