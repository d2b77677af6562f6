"""Finding the processes a test started, by their command line (pgrep -f), and waiting on them."""

from __future__ import annotations

import subprocess
import time


def matching(pattern: str) -> list[int]:
    """PIDs of the processes whose command line contains `pattern` (a regular expression)."""
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def wait_for(pattern: str, count: int, timeout_s: float) -> list[int]:
    """Until at least `count` processes match (or the time is up); returns the matches."""
    deadline = time.monotonic() + timeout_s
    while len(found := matching(pattern)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def wait_gone(pattern: str, timeout_s: float) -> list[int]:
    """Until no process matches (or the time is up); returns what is left."""
    deadline = time.monotonic() + timeout_s
    while (left := matching(pattern)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left
