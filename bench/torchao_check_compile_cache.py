"""`optdrift check` on torchao 0.18.0 (installed; tests/fixtures/torchao_project) cold and warm:
the seconds of one check (comment commit against its base, both built, both batteries run) with
a fresh OPTDRIFT_HOME (builds and compile cache cold), again (both warm), and with the builds warm
but the compile cache (<build cache>/compile, worker/engine/compile_cache.py) removed.

    .venv/bin/python bench/torchao_check_compile_cache.py
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    import pytest  # noqa: F401 - the test module's fixtures are plain functions underneath

    from tests.scenarios import test_real_library_torchao as t

    work = Path(tempfile.mkdtemp(prefix="torchao-bench-"))

    class Factory:
        def mktemp(self, name: str) -> Path:
            path = work / name
            path.mkdir()
            return path

    history = t.history.__wrapped__(Factory())
    home = work / "home"
    home.mkdir()
    for label in ("cold (fresh home)", "warm (builds and compile cache)", "builds warm, compile cache removed"):
        if label.startswith("builds warm"):
            shutil.rmtree(home / "builds" / "compile")
        started = time.perf_counter()
        code, _, _ = t.check(history, "comment", "base", home)
        print(f"{label}: {time.perf_counter() - started:.1f} s (exit {code})", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    subprocess.run(["nproc"], check=False)
    main()
