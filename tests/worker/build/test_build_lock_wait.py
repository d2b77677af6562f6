"""A build another process finished while we waited for its lock is taken at once (worker/build/cache.py
`cached_build`). The first builder keeps a shared hold on its entry for as long as it uses the build
(a worker's whole run, a test process's whole session); a second process that began waiting for the
exclusive lock while the first was building used to wait out that shared hold until its lock timeout
(960 s in CI's sensitivity gate, beside a test process that had built the same mutant), then fail."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
BUILD_THEN_HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from worker.build.cache import BuildResult, cached_build

    def make(staging: Path) -> BuildResult:
        time.sleep(float(sys.argv[2]))           # building
        (staging / "lib.so").write_bytes(b"x")
        (staging / "build.log").write_text("built")
        return BuildResult(ok=True, digest="d1", library_path=str(staging / "lib.so"))

    result = cached_build(Path(sys.argv[1]), "d1", make, lock_timeout_s=float(sys.argv[3]))
    print("cached" if result.cached else "built", flush=True)
    time.sleep(float(sys.argv[4]))               # in use: the shared hold stays
""")


def _start(cache: Path, build_s: float, timeout_s: float, hold_s: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUILD_THEN_HOLD, str(cache), str(build_s), str(timeout_s),
                             str(hold_s)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_build_finished_while_we_waited_is_taken_without_waiting_out_its_builders_hold(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    builder = _start(cache, build_s=3.0, timeout_s=60, hold_s=60)
    try:
        time.sleep(1.0)                          # the builder holds the exclusive lock now
        began = time.monotonic()
        waiter = _start(cache, build_s=0.0, timeout_s=40, hold_s=0)
        out, err = waiter.communicate(timeout=50)
        waited = time.monotonic() - began
    finally:
        builder.kill()
        builder.communicate()
    assert waiter.returncode == 0, err[-2000:]
    # The waiter takes the builder's entry (never builds it again) within seconds of it appearing,
    # far inside its 40 s lock timeout and the builder's 60 s hold.
    assert out.strip() == "cached" and waited < 15, (out, waited, err[-500:])
