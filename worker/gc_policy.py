"""Full garbage collections between runs, not inside one.

Now and then CPython's collector walks every container object the process tracks (a full, or
generation-2, collection). A worker or a kernel host has torch and the engine imported, about
175,000 tracked objects, and one full pass over them took 88 ms on the CPU machine. Replaying a
warm standard battery's answers through the parent 12 times in a row (bench/gc_pauses.py) set one
off in 4 of the 12 runs, three tries out of three: the slowest run took 0.21-0.22 s where the
others took 0.08-0.10 s. When one falls due depends only on how many objects have been allocated
since the last full pass, not on the run, so left alone it lands in some runs and not others
and makes the parent's share of a warm battery vary from run to run.

So while a run's results are on their way, the full pass is held off (`full_collections_held`).
The young generations are still collected, and a run's short-lived cycles die there. The full
pass is made once the run is over (`collect_after`: the worker's tasks; the kernel host after it
answered `done`), when nobody is waiting for this process.

CPython 3.11 and 3.12 (what optdrift runs on, here and on the H200) start a full collection only
once the middle generation has been collected more times than the oldest generation's threshold.
Raising that threshold out of reach holds the full pass off and leaves the young collections as
they were.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

# The oldest generation's threshold while held: more middle-generation collections than any run makes.
HELD_THRESHOLD = 1 << 30

T = TypeVar("T")


# The collector's thresholds are the process's, and runs hold them from several threads at once
# (a co-run's two hosts, each read from its own thread): the first holder raises the oldest
# generation's threshold, the last one out puts back what the first found. Each holder saving and
# restoring on its own would leave it raised forever whenever two holds overlap out of order.
_lock = threading.Lock()
_holders = 0
_saved_threshold = 0


@contextmanager
def full_collections_held() -> Iterator[None]:
    """No full collection starts inside (the young generations are collected as usual). Holds
    may nest and overlap across threads; the oldest generation's threshold comes back when the
    last one ends."""
    global _holders, _saved_threshold
    with _lock:
        if _holders == 0:
            young, middle, _saved_threshold = gc.get_threshold()
            gc.set_threshold(young, middle, max(_saved_threshold, HELD_THRESHOLD))
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                young, middle, _ = gc.get_threshold()
                gc.set_threshold(young, middle, _saved_threshold)


def holders() -> int:
    """How many holds are open in this process now."""
    return _holders


def collect_after(function: Callable[..., T]) -> Callable[..., T]:
    """`function` with full collections held off while it runs and one full collection after it
    returns or raises: for a worker's task, whose caller (Celery) then only waits for the next task."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs) -> T:  # noqa: ANN002, ANN003
        try:
            with full_collections_held():
                return function(*args, **kwargs)
        finally:
            gc.collect()

    return wrapped


def full_collections() -> int:
    """Full collections this process has made so far (a figure for profiles and tests)."""
    return gc.get_stats()[2]["collections"]
