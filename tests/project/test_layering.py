"""The layering docs/DESIGN.md promises: the API process never imports torch or the worker package
(its memory, start time and attack surface stay those of a web service), and the CLI's client
commands run without them too. Checked in a fresh interpreter, so nothing this test process
already imported can hide an import."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import json, sys
{imports}
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "worker", "numpy")))
print(json.dumps(heavy))
"""


def _imported(imports: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_api_app_imports_neither_torch_nor_the_worker() -> None:
    assert _imported("from service.api.main import create_app; create_app()") == []


def test_the_cli_imports_neither_until_a_worker_command_runs() -> None:
    assert _imported("import service.cli.main, service.cli.client") == []


def test_the_probe_sees_an_import_when_there_is_one() -> None:
    # The probe itself must be able to fail: importing the worker's build module pulls it in.
    assert "worker.build" in _imported("import worker.build")
