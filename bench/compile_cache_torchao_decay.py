"""`optdrift check` of torchao 0.18.0's decay-after-update commit against its comment commit
(tests/scenarios/test_real_library_torchao.py's history): a changed check, so beside both batteries
it co-runs the changed cases and attributes them, four more kernel hosts, each given its build's
compile cache (worker/engine/compile_cache.py). Run twice in one OPTDRIFT_HOME (cold, then warm);
each check's closing time line says where its time went.

    .venv/bin/python bench/compile_cache_torchao_decay.py
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from tests.scenarios import test_real_library_torchao as scenario

    work = Path(tempfile.mkdtemp(prefix="torchao-decay-bench-"))

    class Factory:  # the fixture's tmp_path_factory
        def mktemp(self, name: str) -> Path:
            path = work / name
            path.mkdir()
            return path

    history = scenario.history.__wrapped__(Factory())
    home = work / "home"
    home.mkdir()
    print(f"optdrift check decay against comment, torchao 0.18.0, {os.cpu_count()} CPUs, one run each")
    for label in ("cold (fresh home)", "warm (builds and compile cache)"):
        started = time.perf_counter()
        code, _, output = scenario.check(history, "decay", "comment", home)
        seconds = time.perf_counter() - started
        line = next((m.group(0) for m in re.finditer(r"\(\d[\d.]* s: builds.*\)", output)), "")
        print(f"{label:34} {seconds:7.1f} s  exit {code}  {line}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
