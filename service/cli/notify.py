"""`optdrift notify ...`: a project's GitHub integration and webhooks, through the API (admin
token). Secrets come from files or the environment, never from a command-line argument (which
other users of the machine can read in the process list): the GitHub token from
OPTDRIFT_GITHUB_TOKEN or --token-file, an App's key from --private-key-file, a webhook's secret
from OPTDRIFT_WEBHOOK_SECRET or --secret-file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from service.cli.common import DEFAULT_URL

notify_app = typer.Typer(help="GitHub check runs and PR comments, webhooks (docs/INTEGRATIONS.md); admin token",
                         no_args_is_help=True)

ProjectOption = Annotated[str, typer.Option(help="project name")]
UrlOption = Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")]


def _cli():  # noqa: ANN202
    from service.cli import common as cli_common  # imports rich's console: only where a command runs

    return cli_common


def _secret(*, env: str, path: Optional[Path], what: str, option: str) -> str:
    cli = _cli()
    if path is not None:
        try:
            value = path.read_text().strip()
        except OSError as exc:
            raise cli.fail(f"{option} {path}: cannot read it ({exc.strerror})", cli.EXIT_USAGE) from None
        if not value:
            raise cli.fail(f"{option} {path} is empty; it should hold the {what}", cli.EXIT_USAGE)
        return value
    value = os.environ.get(env, "").strip()
    if not value:
        raise cli.fail(f"no {what}: set {env} or pass {option} FILE", cli.EXIT_USAGE)
    return value


def _call(url: str, method: str, path: str, body: dict | None = None) -> dict | None:
    from service.cli.client import OptdriftClient

    with _cli().expected_failures(url):
        return OptdriftClient(url).request(method, path, json=body)


@notify_app.command("github")
def github(
    project: ProjectOption,
    repository: Annotated[str, typer.Option(help="owner/name of the project's GitHub repository")],
    app_id: Annotated[Optional[str], typer.Option(help="a GitHub App's id (App auth; else a token)")] = None,
    private_key_file: Annotated[Optional[Path], typer.Option(help="the App's PEM private key")] = None,
    installation_id: Annotated[Optional[int], typer.Option(help="the App's installation (looked up if omitted)")] = None,
    token_file: Annotated[Optional[Path], typer.Option(help="a file holding the GitHub token "
                                                      "(default: OPTDRIFT_GITHUB_TOKEN)")] = None,
    api_url: Annotated[str, typer.Option(help="GitHub's API (Enterprise Server: https://HOST/api/v3)")] = "https://api.github.com",
    check_name: str = "optdrift",
    pr_comments: Annotated[bool, typer.Option(help="comment on the commit's pull requests")] = True,
    dashboard_url: Annotated[Optional[str], typer.Option(help="base of the checks' Details link")] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Set the project's GitHub integration (replaces the previous one)."""
    body: dict = {"repository": repository, "api_url": api_url, "check_name": check_name,
                  "pr_comments": pr_comments, "dashboard_url": dashboard_url}
    if app_id is not None:
        body.update(auth="app", app_id=app_id, installation_id=installation_id,
                    private_key=_secret(env="OPTDRIFT_GITHUB_APP_KEY", path=private_key_file,
                                        what="GitHub App private key", option="--private-key-file"))
    else:
        body.update(auth="token", token=_secret(env="OPTDRIFT_GITHUB_TOKEN", path=token_file,
                                                what="GitHub token", option="--token-file"))
    answer = _call(url, "PUT", f"/api/v1/projects/{project}/github", body)
    print(f"{project}: GitHub {answer['repository']} ({answer['auth']} auth) at {answer['api_url']}")


@notify_app.command("webhook-add")
def webhook_add(
    project: ProjectOption,
    target: Annotated[str, typer.Option("--target", help="the URL to POST verdicts to")],
    secret_file: Annotated[Optional[Path], typer.Option(help="a file holding the signing secret "
                                                       "(default: OPTDRIFT_WEBHOOK_SECRET)")] = None,
    event: Annotated[Optional[list[str]], typer.Option(help="changed, broken, error, nondeterministic "
                                                      "(repeat; default the first three)")] = None,
    slack: Annotated[bool, typer.Option(help="send Slack's incoming-webhook shape")] = False,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """Add a webhook to the project: verdicts POSTed, signed as Standard Webhooks (webhook-signature)."""
    body = {"url": target, "payload_format": "slack" if slack else "json",
            "secret": _secret(env="OPTDRIFT_WEBHOOK_SECRET", path=secret_file, what="webhook secret",
                              option="--secret-file")}
    if event:
        body["events"] = event
    answer = _call(url, "POST", f"/api/v1/projects/{project}/webhooks", body)
    print(f"{project}: webhook {answer['id']} -> {answer['url']} on {', '.join(answer['events'])}")


@notify_app.command("deliveries")
def deliveries(
    project: ProjectOption,
    webhook: Annotated[int, typer.Option(help="the webhook's id (webhook-add prints it)")],
    limit: int = 20,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """The webhook's latest deliveries, one JSON line each (status code, attempts, error)."""
    answer = _call(url, "GET", f"/api/v1/projects/{project}/webhooks/{webhook}/deliveries?limit={limit}")
    for row in answer["data"]:
        print(json.dumps(row))
