"""The release a process serves is the one pyproject.toml names (docs/RELEASES.md): `/healthz`, the
OpenAPI document and `optdrift --version` say it. A stale install (metadata of an older version)
fails here: reinstall with `pip install -e .`."""

from __future__ import annotations

import tomllib

from typer.testing import CliRunner

from tests.service_fixtures import REPO_ROOT

VERSION = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_healthz_and_the_openapi_document_say_the_release(api) -> None:  # noqa: ANN001
    health = api.get("/healthz", headers={"Authorization": ""})  # public: no token needed
    assert health.status_code == 200 and health.json()["version"] == VERSION, health.text
    assert api.get("/openapi.json").json()["info"]["version"] == VERSION


def test_optdrift_version_says_the_release() -> None:
    from service.cli import app

    shown = CliRunner().invoke(app, ["--version"])
    assert shown.exit_code == 0 and shown.output.splitlines()[0] == f"optdrift {VERSION}", shown.output
