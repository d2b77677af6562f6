"""The Python client's public import path is `service.cli.client` (docs/PROJECTS.md, "Public
adapter API"); a script written when it was `service.client` still drives the service, and is told,
on stderr at its own import line, what to import instead (issue 48: the move broke such scripts).

The script runs as a program of its own (its own interpreter, default warning filters: Python
shows a DeprecationWarning raised at `__main__`'s code) against the real API on a port over the
test's PostgreSQL session.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

OLD_SCRIPT = textwrap.dedent("""\
    import sys

    from service.client import ApiError, OptdriftClient

    client = OptdriftClient(sys.argv[1], token=sys.argv[2])
    print("project", client.ensure_project("oldclient", environments=["cpu"])["name"])
    try:
        client.run(987654)
    except ApiError as error:
        print("missing run", error.status_code)
""")


def test_a_script_with_the_old_client_import_still_drives_the_service(live_api, admin_token, tmp_path: Path) -> None:  # noqa: ANN001
    script = tmp_path / "drive_optdrift.py"
    script.write_text(OLD_SCRIPT)
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OPTDRIFT_", "PYTHONWARNINGS"))}
    env["PYTHONPATH"] = str(REPO)
    done = subprocess.run([sys.executable, str(script), live_api, admin_token], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["project oldclient", "missing run 404"], done.stdout
    # One warning, at the script's import line, naming the public path.
    assert f"{script}:3: DeprecationWarning: service.client is deprecated: import from service.cli.client" \
        in done.stderr, done.stderr
    assert done.stderr.count("DeprecationWarning") == 1, done.stderr


def test_the_client_has_one_public_path_and_the_old_one_is_the_same_object() -> None:
    import warnings

    from service.cli import client

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from service import client as old

    assert old.OptdriftClient is client.OptdriftClient and old.ApiError is client.ApiError
    assert {"OptdriftClient", "ApiError", "resolve_token"} <= set(old.__all__)
