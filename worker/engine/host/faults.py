"""Test-only fault injection of the kernel host (tests/worker/engine/test_engine_host.py, tests/scenarios/test_faults.py).

OPTDRIFT_TEST_HOST_FAULT="abort:TEXT" calls os.abort(), "segv:TEXT" reads address 0 and
"hang:TEXT" sleeps forever when a case id contains TEXT. A host runs submitted code, so it may
also lie: "garbage:TEXT" answers a line that is not JSON, "flood:TEXT" sends bytes without end of
line, "foreign:TEXT" answers a result for another case, "series:TEXT" claims a known series nobody
gave it. Nothing else reads the variable; the sandbox passes it through (it carries no secret).
"""

from __future__ import annotations

import os
import time
from typing import TextIO

from service.core.results import CaseResult, CaseSpec
from worker.engine.host.protocol import known_series_line, result_line

FAULT_ENV = "OPTDRIFT_TEST_HOST_FAULT"


def _fault_for(case: CaseSpec) -> str | None:
    kind, _, text = os.environ.get(FAULT_ENV, "").partition(":")
    return kind if text and text in case.case_id else None


def inject(case: CaseSpec) -> None:
    """Crash or hang as a bad kernel would, when the fault names `case`."""
    kind = _fault_for(case)
    if kind == "abort":
        os.abort()
    if kind == "segv":  # a real invalid read: the kernel delivers SIGSEGV, as a bad kernel would
        import ctypes

        ctypes.string_at(0)
    if kind == "hang":
        while True:
            time.sleep(3600)


def lie(case: CaseSpec, protocol: TextIO, index: int = 0) -> bool:
    """Answer falsely for `case` (asked for as `index`) as hostile code in the host could; True if
    it did."""
    kind = _fault_for(case)
    if kind not in ("garbage", "flood", "foreign", "series"):
        return False
    if kind == "series":  # a known series claimed by a key nobody gave it
        protocol.write(known_series_line(index, "0" * 32, 0.0))
    elif kind == "garbage":
        protocol.write("this is not a protocol line\n")
    elif kind == "flood":
        for _ in range(80):
            protocol.write("x" * (1 << 20))
        protocol.write("\n")
    else:
        other = case.model_copy(update={"seed": case.seed + 1})
        protocol.write(result_line(CaseResult(case=other, status="broken",
                                              message="a result for a case nobody asked for"), index=0, restart=False))
    protocol.flush()
    return True
