"""`optdrift check` on a torch.compile project, cold and warm (worker/engine/compile_cache.py).

The project is the fixture adapter `compiled_adam` (tests/fixtures/adapters/compiled_adam.py: fp32
AdamW through torch.compile on the CPU; its library is the installed torch) in two trees, `base`
and `comment` (a comment changed: another build digest, so each side has its own compile cache).
One `optdrift check --source comment --baseline base --device cpu` each, in a fresh OPTDRIFT_HOME:

- cold: nothing built, nothing compiled;
- warm: the same home again (builds and compile cache warm);
- builds warm, compile cache removed (<build cache>/compile deleted): what the cache alone saves.

    .venv/bin/python bench/compile_cache_check.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ADAPTER = ROOT / "tests" / "fixtures" / "adapters" / "compiled_adam.py"
CONFIG = """[project]
adapter = "compiled_adam"
battery = "battery.json"
environments = ["cpu"]

[build]
kind = "command"
commands = ["true"]
library = "installed"
"""
BATTERY = """{"name": "compiled-adam", "version": 1,
 "description": "fp32 AdamW through torch.compile: two sizes (a compile each), open and closed streams",
 "groups": [{"optimizers": ["adam"], "families": ["32bit"], "sizes": [4096, 8192],
             "steps": 6, "gradients": [{"kind": "open"}, {"kind": "closed"}],
             "points": [{"lr": 0.1, "weight_decay": 0.1}]}]}
"""


def _tree(folder: Path, comment: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "optdrift.toml").write_text(CONFIG)
    (folder / "battery.json").write_text(BATTERY)
    (folder / "NOTES.md").write_text(f"# {comment}\n")
    return folder


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="compile-cache-bench-"))
    base, commit = _tree(work / "base", "base"), _tree(work / "comment", "a comment changed")
    home = work / "home"
    env = {**os.environ, "OPTDRIFT_HOME": str(home), "OPTDRIFT_BUILD_CACHE_DIR": str(home / "builds"),
           "OPTDRIFT_EXTRA_ADAPTERS": f"compiled_adam={ADAPTER}"}
    env.pop("OPTDRIFT_BUILD_CACHE", None)
    command = [str(Path(sys.executable).with_name("optdrift")), "check", "--source", str(commit),
               "--baseline", str(base), "--device", "cpu"]
    rows = []
    for label in ("cold (fresh home)", "warm (builds and compile cache)", "builds warm, compile cache removed"):
        if label.startswith("builds warm"):
            shutil.rmtree(home / "builds" / "compile")
        started = time.perf_counter()
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        last = [line for line in done.stdout.splitlines() if line.strip()][-1:] or [done.stderr[-300:]]
        rows.append((label, seconds, done.returncode, _folder_bytes(home / "builds" / "compile"), last[0]))
    print(f"optdrift check on compiled_adam, {os.cpu_count()} CPUs, one run each")
    print(f"{'':38} {'seconds':>8} {'exit':>5} {'compile cache':>14}  check's time line")
    for label, seconds, code, size, last in rows:
        print(f"{label:38} {seconds:8.1f} {code:5d} {size / 1024:11.0f} KiB  {last}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
