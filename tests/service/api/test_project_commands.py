"""A project set up without curl: `optdrift project create | show | update`, PATCH
/api/v1/projects/{p}, and what a project's runs really use (its newest commit's optdrift.toml over
the registered fields, each field with its origin) on the API and in the command."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from service.cli import app as cli_app
from tests.service_fixtures import make_archive

TREE_TOML = """
[project]
battery = "ci"
repeats = 2
"""


def _submit(api, project: str, sha: str, files: dict) -> None:  # noqa: ANN001
    answer = api.post(f"/api/v1/projects/{project}/commits", data={"sha": sha},
                      files={"archive": ("s.tar.gz", make_archive(files), "application/gzip")})
    assert answer.status_code in (200, 201, 202), answer.text


def _fields(detail: dict) -> dict[str, tuple[object, str]]:
    return {field["name"]: (field["value"], field["origin"]) for field in detail["configuration"]["fields"]}


def test_a_project_registered_by_name_shows_what_its_trees_configure(api) -> None:  # noqa: ANN001
    assert api.post("/api/v1/projects", json={"name": "byname"}).status_code == 201
    before = api.get("/api/v1/projects/byname").json()
    assert before["configuration"]["commit"] is None
    assert _fields(before)["battery"] == ("quick", "registered")

    _submit(api, "byname", "a" * 40, {"optdrift.toml": TREE_TOML, "csrc/ops.cpp": "// kernels\n"})
    detail = api.get("/api/v1/projects/byname").json()
    fields = _fields(detail)
    assert detail["configuration"]["commit"] == "a" * 40 and detail["configuration"]["has_file"]
    # What the tree sets is shown as the tree's; the rest as the registered defaults they are.
    assert fields["battery"] == ("ci", "tree") and fields["repeats"] == (2, "tree")
    assert fields["adapter"] == ("bundled", "registered")
    assert fields["build.kind"] == ("torch-extension", "registered")
    # The registered row itself is unchanged (it is only the defaults).
    assert detail["default_battery"] == "quick"
    # The project's page says the same.
    page = api.get("/projects/byname").text
    assert "optdrift.toml of <span class=\"sha\" title=\"" + "a" * 40 in page
    assert "<tr><td><code>battery</code></td><td>ci</td><td>optdrift.toml</td></tr>" in page
    assert "<tr><td><code>adapter</code></td><td>bundled</td><td>registered default</td></tr>" in page

    # The newest commit decides: a tree without optdrift.toml runs on the registered fields.
    _submit(api, "byname", "b" * 40, {"csrc/ops.cpp": "// kernels, v2\n"})
    newest = api.get("/api/v1/projects/byname").json()
    assert newest["configuration"]["commit"] == "b" * 40 and not newest["configuration"]["has_file"]
    assert _fields(newest)["battery"] == ("quick", "registered")


def test_registered_fields_are_updated_by_an_admin_and_checked(api) -> None:  # noqa: ANN001
    assert api.post("/api/v1/projects", json={"name": "upd"}).status_code == 201
    changed = api.patch("/api/v1/projects/upd", json={"environments": ["cpu", "gpu.sm90"],
                                                      "default_battery": "standard"})
    assert changed.status_code == 200, changed.text
    assert changed.json()["environments"] == ["cpu", "gpu.sm90"]
    assert changed.json()["default_battery"] == "standard" and changed.json()["adapter"] == "bundled"

    # A default battery is a built-in name or a path in the tree (checked per submission, where the
    # tree is known); one that can never be a tree's file is refused now, with the valid names.
    outside = api.patch("/api/v1/projects/upd", json={"default_battery": "../batteries/x.json"})
    assert outside.status_code == 422 and "quick" in outside.text
    assert api.patch("/api/v1/projects/upd", json={"adapter": None}).status_code == 422
    assert api.patch("/api/v1/projects/upd", json={"builder": "x"}).status_code == 422  # unknown field
    assert api.post("/api/v1/projects", json={"name": "x", "builder": "x"}).status_code == 422
    assert api.patch("/api/v1/projects/nope", json={"adapter": "x"}).status_code == 404
    anonymous = api.patch("/api/v1/projects/upd", json={"adapter": "x"}, headers={"Authorization": ""})
    assert anonymous.status_code == 401
    assert api.get("/api/v1/projects/upd").json()["adapter"] == "bundled"


def test_the_project_command_creates_shows_and_updates(live_api, admin_token, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("OPTDRIFT_TOKEN", admin_token)
    runner = CliRunner()

    created = runner.invoke(cli_app, ["project", "create", "clik", "--environment", "cpu", "--battery", "ci",
                                      "--url", live_api])
    assert created.exit_code == 0, created.output
    assert "project clik created: environments cpu, default battery ci" in created.output

    shown = runner.invoke(cli_app, ["project", "show", "clik", "--url", live_api])
    assert shown.exit_code == 0, shown.output
    assert "no commit submitted yet" in shown.output and "registered default" in shown.output

    as_json = runner.invoke(cli_app, ["project", "show", "clik", "--format", "json", "--url", live_api])
    assert json.loads(as_json.output)["default_battery"] == "ci"

    updated = runner.invoke(cli_app, ["project", "update", "clik", "--environment", "cpu", "--environment",
                                      "gpu.sm90", "--url", live_api])
    assert updated.exit_code == 0 and "environments ['cpu', 'gpu.sm90']" in updated.output

    # Bad input: one line and exit 2, never a traceback.
    nothing = runner.invoke(cli_app, ["project", "update", "clik", "--url", live_api])
    assert nothing.exit_code == 2 and "nothing to change" in nothing.output
    outside = runner.invoke(cli_app, ["project", "update", "clik", "--battery", "/etc/x.json", "--url", live_api])
    assert outside.exit_code == 2 and "Traceback" not in outside.output and "quick" in outside.output
    unknown = runner.invoke(cli_app, ["project", "show", "nope", "--url", live_api])
    assert unknown.exit_code == 2 and "unknown project 'nope'" in unknown.output
    taken = runner.invoke(cli_app, ["project", "create", "clik", "--url", live_api])
    assert taken.exit_code == 2 and "already exists" in taken.output
