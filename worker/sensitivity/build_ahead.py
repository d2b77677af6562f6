"""Mutant builds made ahead of the mutant being judged, so compiling overlaps the batteries.

A catalogue run alternates a build (compilers: one translation unit for a one-file mutant, so one
core) with a battery (the kernel host). Judged one after the other, the cores a build leaves idle
stay idle while the battery runs, and the other way round. `BuildAhead` keeps up to `jobs` builds
running in threads while the caller judges mutants in their order: when the caller takes mutant k,
mutants k+1 .. k+jobs are building (or built). Each build is the same `pipeline.build` of the same
patched tree as a sequential run makes (same flags, sandbox, digest cache, ccache); only when it
runs changes. `jobs=0` builds each mutant when it is taken, as before.

Threads, not processes: a build is a sandboxed child process that the thread waits on, so the
thread holds no core itself. The thread that starts a build child also waits for it, which
PR_SET_PDEATHSIG (worker.sandbox) needs: it signals the child when the *thread* that forked it ends.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

from worker.sensitivity.catalogue import Mutant

Built = TypeVar("Built")


class BuildAhead(Generic[Built]):
    """`build(mutant)` for each of `order`, up to `jobs` mutants ahead of the one taken."""

    def __init__(self, build: Callable[[Mutant], Built], order: list[Mutant], jobs: int) -> None:
        if jobs < 0:
            raise ValueError(f"build jobs must be 0 or more, got {jobs}")
        self._build = build
        self._position = {mutant.id: index for index, mutant in enumerate(order)}
        self._order = order
        self._jobs = jobs
        self._pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="mutant-build") if jobs else None
        self._pending: dict[str, Future[Built]] = {}
        self._submitted = 0  # how many of `order` have been handed to the pool

    def start(self) -> None:
        """Start the first builds (call once the unmutated build is in the compiler cache, so each
        mutant recompiles only what its patch reaches)."""
        self._fill(taken=-1)

    def take(self, mutant: Mutant) -> Built:
        """The build of `mutant` (waiting for it), after queueing the builds that follow it."""
        if self._pool is None:
            return self._build(mutant)
        self._fill(taken=self._position[mutant.id])
        future = self._pending.pop(mutant.id, None) or self._pool.submit(self._build, mutant)
        return future.result()

    def close(self) -> None:
        """Drop the builds not started yet; wait for the running ones (a build child is waited on by
        its thread, and a half-written build never enters the digest cache)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> BuildAhead[Built]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fill(self, taken: int) -> None:
        # `taken` itself, then `jobs` more: the pool's `jobs` threads are busy while `taken` is judged.
        while self._submitted < len(self._order) and self._submitted <= taken + self._jobs:
            mutant = self._order[self._submitted]
            self._pending[mutant.id] = self._pool.submit(self._build, mutant)
            self._submitted += 1
