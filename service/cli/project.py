"""`optdrift project create | show | update`: register a project and read what its runs use, through
the API. Creating and updating need an admin token; `show` is a read.

The registered fields (build kind, adapter, battery, environments) are defaults only: a tree's
optdrift.toml overrides each of them for its own runs, so `show` prints, beside them, the newest
commit's configuration with where each field came from."""

from __future__ import annotations

import json
import sys
from typing import Annotated, Optional

import typer

from service.cli.common import DEFAULT_URL

project_app = typer.Typer(help="register a project and show what its runs are configured with", no_args_is_help=True)

NameArgument = Annotated[str, typer.Argument(help="the project's name (letters, digits, . _ -)")]
UrlOption = Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")]
EnvironmentOption = Annotated[Optional[list[str]], typer.Option(
    "--environment", help="a registered environment (repeatable): `cpu`, `gpu.sm90`, ...; submissions may name "
                          "only these")]
BatteryOption = Annotated[Optional[str], typer.Option("--battery", help="the default battery (quick, standard, ci, "
                                                                      "...); a tree's optdrift.toml overrides it")]
AdapterOption = Annotated[Optional[str], typer.Option(help="the default adapter; a tree's optdrift.toml overrides it")]
BuildKindOption = Annotated[Optional[str], typer.Option("--build-kind", help="torch-extension or command (default "
                                                                           "for trees without optdrift.toml)")]
AllowUnservedOption = Annotated[bool, typer.Option(
    "--allow-unserved", help="register an environment no live worker serves yet (its worker starts later); "
                             "a warning names the worker setting that serves it")]
EXIT_CODES = "Exit codes: 0 done; 2 bad input or a refused request (not admin, unknown project, invalid field, " \
             "an unknown battery or adapter, an environment no live worker serves without --allow-unserved); " \
             "4 optdrift or service error."


def _cli():  # noqa: ANN202
    from service.cli import common as cli_common  # imports rich's console: only where a command runs

    return cli_common


def _call(url: str, method: str, path: str, body: dict | None = None) -> dict:
    from service.cli.client import OptdriftClient

    with _cli().expected_failures(url):
        return OptdriftClient(url).request(method, path, json=body)


def _fields(environment: list[str] | None, battery: str | None, adapter: str | None,
            build_kind: str | None) -> dict:
    named = {"environments": environment or None, "default_battery": battery, "adapter": adapter,
             "build_kind": build_kind}
    return {key: value for key, value in named.items() if value is not None}


def _warn(project: dict) -> None:
    """The service's registration warnings (an environment no live worker serves yet), on stderr."""
    for warning in project.get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)


@project_app.command("create", epilog=EXIT_CODES)
def create(name: NameArgument, environment: EnvironmentOption = None, battery: BatteryOption = None,
           adapter: AdapterOption = None, build_kind: BuildKindOption = None,
           allow_unserved: AllowUnservedOption = False, url: UrlOption = DEFAULT_URL) -> None:
    """Register a project (admin token). Fields left out take the service's defaults."""
    project = _call(url, "POST", "/api/v1/projects", {"name": name, **_fields(environment, battery, adapter,
                                                                               build_kind),
                                                       "allow_unserved": allow_unserved})
    _warn(project)
    print(f"project {project['name']} created: environments {', '.join(project['environments'])}, "
          f"default battery {project['default_battery']}")


@project_app.command("update", epilog=EXIT_CODES)
def update(name: NameArgument, environment: EnvironmentOption = None, battery: BatteryOption = None,
           adapter: AdapterOption = None, build_kind: BuildKindOption = None,
           allow_unserved: AllowUnservedOption = False, url: UrlOption = DEFAULT_URL) -> None:
    """Change registered fields (admin token); those not given stay as they are."""
    body = _fields(environment, battery, adapter, build_kind)
    if not body:
        cli = _cli()
        raise cli.fail("nothing to change: give --environment, --battery, --adapter or --build-kind", cli.EXIT_USAGE)
    project = _call(url, "PATCH", f"/api/v1/projects/{name}", {**body, "allow_unserved": allow_unserved})
    _warn(project)
    print(f"project {project['name']} updated: " + ", ".join(f"{key} {project[key]}" for key in body))


@project_app.command("show", epilog=EXIT_CODES)
def show(name: NameArgument, output: Annotated[str, typer.Option("--format", help="text or json")] = "text",
         url: UrlOption = DEFAULT_URL) -> None:
    """The registered fields and what the newest commit's runs use (its optdrift.toml over them)."""
    _cli().check_format(output)
    project = _call(url, "GET", f"/api/v1/projects/{name}")
    if output == "json":
        print(json.dumps(project, indent=2))
        return
    from rich.table import Table

    from service.cli.report import make_console

    console = make_console()
    console.print(f"project {project['name']}: environments {', '.join(project['environments'])}",
                  markup=False, highlight=False)
    configuration = project["configuration"]
    if configuration["commit"] is None:
        console.print("no commit submitted yet: runs will use the tree's optdrift.toml over the registered "
                      "defaults below", markup=False, highlight=False)
    else:
        where = f"the optdrift.toml of {configuration['commit']}" if configuration["has_file"] else \
            f"{configuration['commit']} (its tree has no optdrift.toml: the registered defaults)"
        console.print(f"configuration of the newest commit's runs, from {where}:", markup=False, highlight=False)
    if configuration.get("problem"):
        console.print(f"  cannot be read: {configuration['problem']}", markup=False, highlight=False)
    table = Table(show_header=True)
    for column in ("field", "value", "from"):
        table.add_column(column, overflow="fold")
    for field in configuration["fields"]:
        value = field["value"]
        shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
        table.add_row(field["name"], shown, "optdrift.toml" if field["origin"] == "tree" else "registered default")
    if configuration["fields"]:
        console.print(table)
