"""`optdrift`: the command line (typer + rich).

serve    API + a worker on the embedded default (SQLite + filesystem broker under OPTDRIFT_HOME,
         default ~/.local/share/optdrift), migrating first; `--demo` loads the bundled kernels at
         a few commits, the weight-decay reorder among them.
worker   a Celery worker for OPTDRIFT_WORKER_ENVIRONMENT's queue.
migrate  alembic upgrade head.
submit   CI: post a commit and its source; `--wait` shows progress and the verdict, exit 1 if flagged.
verify   a contributor's tree or patch against a known commit.
demo     submit the demo commits to a running service.
token    create (shown once) / list / revoke API tokens; clients read theirs from OPTDRIFT_TOKEN,
         OPTDRIFT_TOKEN_FILE or ~/.config/optdrift/token, never from a command-line argument.

Server-side modules are imported inside the commands, so the client install (httpx, typer, rich)
can run `submit` and `verify`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

app = typer.Typer(help="optdrift: did this commit change a training trajectory?", no_args_is_help=True)
console = Console()
DEFAULT_URL = os.environ.get("OPTDRIFT_URL", "http://127.0.0.1:8000")
UrlOption = Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")]
FLAGGED_EXIT_CODE = 1
REPO_ROOT = Path(__file__).resolve().parents[1]


@app.command()
def migrate() -> None:
    """Create or upgrade the database schema (alembic upgrade head)."""
    from service.db.migrate import upgrade_to_head
    from service.settings import get_settings

    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade_to_head()
    console.print(f"database at {settings.resolved_database_url.split('@')[-1]} is up to date")


@app.command()
def worker(
    pool: Annotated[str, typer.Option(help="celery pool: prefork (production) or solo")] = "prefork",
    concurrency: Annotated[int, typer.Option(help="runs at once; keep 1 per GPU")] = 1,
    loglevel: str = "INFO",
    gpus: Annotated[Optional[str], typer.Option(
        help="all or GPU indices (0,1): one worker process per GPU, CUDA_VISIBLE_DEVICES set, "
             "queue gpu.sm<cc> of its compute capability")] = None,
) -> None:
    """Run a Celery worker consuming OPTDRIFT_WORKER_ENVIRONMENT's queue (cpu, gpu.sm90, ...)."""
    if gpus is not None:
        from worker.gpu_workers import run_gpu_workers

        try:
            code = run_gpu_workers(gpus, worker_args=["--pool", pool, "--concurrency", str(concurrency),
                                                      "--loglevel", loglevel])
        except (RuntimeError, ValueError) as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from exc
        raise typer.Exit(code)
    from service.settings import get_settings
    from worker.celery_app import app as celery_app, worker_argv

    settings = get_settings()
    celery_app.worker_main(worker_argv(environment=settings.worker_environment,
                                       concurrency=concurrency, pool=pool, loglevel=loglevel))


@app.command()
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    with_worker: Annotated[bool, typer.Option("--worker/--no-worker",
                                              help="also start a local worker process")] = True,
    demo: Annotated[bool, typer.Option(help="load the bundled kernels at a few commits")] = False,
) -> None:
    """Start the API (and a local worker) on the configured database and broker; the embedded
    default needs no servers: data lives in OPTDRIFT_HOME (~/.local/share/optdrift)."""
    import uvicorn

    from service.db.migrate import upgrade_to_head
    from service.settings import get_settings

    public_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    if not os.environ.get("OPTDRIFT_PUBLIC_URL"):
        os.environ["OPTDRIFT_PUBLIC_URL"] = public_url
    get_settings.cache_clear()
    settings = get_settings()
    settings.home.mkdir(parents=True, exist_ok=True)
    upgrade_to_head()
    _bootstrap_tokens(settings)
    console.print(f"optdrift data in [bold]{settings.home}[/]; database "
                  f"{settings.resolved_database_url.split('@')[-1]}; broker "
                  f"{settings.resolved_broker_url.split('@')[-1]}")
    worker_process = None
    if with_worker:
        worker_process = subprocess.Popen(
            [sys.executable, "-m", "service.cli", "worker", "--pool", "solo", "--loglevel", "WARNING"],
            env={**os.environ, "OPTDRIFT_PUBLIC_URL": settings.public_url,
                 # the worker imports this checkout's packages even when run from another folder
                 "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
    if demo:
        threading.Thread(target=_demo_when_ready, args=(settings.public_url,), daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM and then re-raises it with the handler that was there
    # before; with the default one the process would die on the spot, skipping the `finally` below
    # and orphaning the worker (seen: `kill <serve>` left the worker running). As an exception the
    # signal unwinds through it instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run("service.api.main:create_app", factory=True, host=host, port=port,
                    log_level="warning")
    finally:
        if worker_process is not None:
            worker_process.terminate()
            worker_process.wait(timeout=30)


def _exit_on_sigterm(signum: int, frame: object) -> None:  # noqa: ARG001
    raise SystemExit(128 + signum)


def _bootstrap_tokens(settings) -> None:  # noqa: ANN001
    """First start: an admin token file (0600) so no write is ever open; a worker token for the
    local worker. Prints where they are, never the tokens."""
    from service.db.session import get_sessionmaker
    from service.domain.auth import bootstrap_tokens

    with get_sessionmaker()() as session:
        happened = bootstrap_tokens(session=session, admin_file=settings.admin_token_file,
                                    worker_file=settings.worker_token_file,
                                    worker_configured=settings.worker_token is not None)
    if happened["admin"] == "created":
        console.print(f"created an admin API token in [bold]{settings.admin_token_file}[/] (mode 0600); "
                      f"clients on this machine use it, elsewhere: "
                      f"export OPTDRIFT_TOKEN=$(cat {settings.admin_token_file})")
    elif happened["admin"] == "kept":
        console.print(f"admin API token: {settings.admin_token_file}")


token_app = typer.Typer(help="API tokens: create (shown once), list, revoke. Runs against the "
                             "configured database, so only someone on the server can do it.")
app.add_typer(token_app, name="token")


@token_app.command("create")
def token_create(
    name: Annotated[str, typer.Option(help="who or what holds it (e.g. 'ci-bitsandbytes')")],
    scope: Annotated[str, typer.Option(help="admin, submit (CI), verify (contributors) or worker")],
    project: Annotated[Optional[str], typer.Option(help="limit a submit/verify token to this project")] = None,
    expires_days: Annotated[Optional[float], typer.Option(help="expire after this many days")] = None,
    daily_quota: Annotated[Optional[int], typer.Option(help="verify runs per UTC day "
                                                        "(default OPTDRIFT_VERIFY_DAILY_QUOTA)")] = None,
) -> None:
    """Create a token and print it ONCE (only its sha256 is stored)."""
    from service.db.session import get_sessionmaker
    from service.domain.auth import create_token

    with get_sessionmaker()() as session:
        try:
            row, token = create_token(session=session, name=name, scope=scope, project=project,
                                      expires_in_days=expires_days, daily_quota=daily_quota)
        except ValueError as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from exc
        session.commit()
    # stderr for the words, stdout for the token alone: `optdrift token create ... > file` works.
    Console(stderr=True).print(f"token {row.id} ({scope}{' for ' + project if project else ''}); "
                               "shown once, store it now:")
    print(token)


@token_app.command("list")
def token_list() -> None:
    """Every token: id, name, scope, project, expiry, revocation (never the token)."""
    from service.db.session import get_sessionmaker
    from service.domain.auth import list_tokens

    table = Table(title="API tokens")
    for column in ("id", "name", "prefix", "scope", "project", "daily quota", "expires", "revoked"):
        table.add_column(column)
    with get_sessionmaker()() as session:
        for row in list_tokens(session=session):
            table.add_row(str(row.id), row.name, row.prefix + "...", row.scope, row.project or "*",
                          str(row.daily_quota or "-"),
                          row.expires_at.isoformat() if row.expires_at else "never",
                          row.revoked_at.isoformat() if row.revoked_at else "")
    console.print(table)


@token_app.command("revoke")
def token_revoke(token_id: Annotated[int, typer.Argument(help="the id `optdrift token list` shows")]) -> None:
    """Revoke a token at once (every later request with it answers 401)."""
    from service.db.session import get_sessionmaker
    from service.domain.auth import revoke

    with get_sessionmaker()() as session:
        try:
            row = revoke(session=session, token_id=token_id)
        except LookupError as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from exc
        session.commit()
    console.print(f"token {row.id} ({row.name}) revoked at {row.revoked_at.isoformat()}")


def _demo_when_ready(url: str) -> None:
    import httpx

    for _ in range(120):
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    try:
        load_demo(url)
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]demo failed:[/] {exc}")


def load_demo(url: str, project: str = "bundled") -> list[dict]:
    """Submit the bundled csrc at three commits: base, the decay-after-update reorder (flagged),
    a comment-only change (unchanged)."""
    import tempfile

    from service.client import OptdriftClient
    from worker.mutations import comment_only, copy_tree, decay_after_update

    client = OptdriftClient(url)
    client.ensure_project(project)
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    submitted = []
    with tempfile.TemporaryDirectory(prefix="optdrift-demo-") as tmp:
        buggy = decay_after_update(copy_tree(csrc, Path(tmp) / "decay-after-update"))
        commented = comment_only(copy_tree(buggy, Path(tmp) / "comment-only"))
        commits = [
            ("demo-base", [], csrc, "bundled kernels, decay before update (AdamW Algorithm 2)"),
            ("demo-decay-after-update", ["demo-base"], buggy,
             "apply weight decay after the update (the PR-2040 ordering bug)"),
            ("demo-comment-only", ["demo-decay-after-update"], commented, "comment-only change"),
        ]
        for sha, parents, tree, message in commits:
            answer = client.submit_commit(project=project, sha=sha, parents=parents,
                                          source_dir=tree, message=message)
            submitted.append(answer)
            console.print(f"demo: submitted {sha} -> run(s) {[r['id'] for r in answer['runs']]}")
    console.print(f"demo: watch {url}/api/v1/projects/{project}/commits")
    return submitted


@app.command("demo")
def demo_command(url: UrlOption = DEFAULT_URL, project: str = "bundled") -> None:
    """Submit the demo commits to a running service (see `serve --demo`)."""
    load_demo(url, project)


def _verdict_table(runs: list[dict]) -> Table:
    table = Table(title="optdrift verdict")
    for column in ("run", "commit", "environment", "status", "verdict", "changed cases",
                   "first step", "summary"):
        table.add_column(column)
    for run in runs:
        verdict = run.get("verdict") or {}
        outcome = verdict.get("outcome", "-")
        style = "red" if verdict.get("flagged") else ("green" if outcome == "unchanged" else "")
        table.add_row(str(run["id"]), run.get("commit_sha") or f"verify vs {run.get('base_sha')}",
                      run["environment"], run["status"], f"[{style}]{outcome}[/]" if style else outcome,
                      str(verdict.get("changed_cases", "-")),
                      str(verdict.get("first_divergent_step") or "-"),
                      (verdict.get("summary") or run.get("error") or "").splitlines()[0:1][0]
                      if (verdict.get("summary") or run.get("error")) else "")
    return table


def _changed_cases_table(runs: list[dict]) -> Table | None:
    rows = [(run["id"], case) for run in runs for case in
            ((run.get("verdict") or {}).get("detail", {}).get("cases", []))
            if case["verdict"] in ("changed", "broken")]
    if not rows:
        return None
    table = Table(title="changed cases")
    for column in ("run", "case", "verdict", "first step", "direction", "message"):
        table.add_column(column)
    for run_id, case in rows[:40]:
        table.add_row(str(run_id), case["case_id"], case["verdict"],
                      str(case.get("first_divergent_step") or "-"), case.get("direction") or "-",
                      (case.get("message") or "")[:80])
    if len(rows) > 40:
        table.caption = f"... and {len(rows) - 40} more"
    return table


def wait_and_report(client, run_ids: list[int]) -> int:  # noqa: ANN001
    """Progress bar while the runs go; then the verdict tables. Returns the exit code."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        tasks = {run_id: progress.add_task(f"run {run_id}", total=None) for run_id in run_ids}

        def update(current: list[dict]) -> None:
            for run in current:
                done, total = run["progress"]["cases_done"], run["progress"]["cases_total"]
                progress.update(tasks[run["id"]], completed=done, total=total,
                                description=f"run {run['id']} {run['status']}")

        final = client.wait(run_ids, on_update=update)
    console.print(_verdict_table(final))
    changed = _changed_cases_table(final)
    if changed is not None:
        console.print(changed)
    flagged = [run for run in final if (run.get("verdict") or {}).get("flagged")
               or (run["status"] == "failed" and not run.get("verdict"))]
    return FLAGGED_EXIT_CODE if flagged else 0


@app.command()
def submit(
    project: Annotated[str, typer.Option(help="project name")],
    commit: Annotated[str, typer.Option(help="commit sha")],
    source: Annotated[Path, typer.Option(help="the kernel source tree to upload", exists=True,
                                         file_okay=False)],
    parent: Annotated[Optional[list[str]], typer.Option(help="parent sha (repeat; first parent first)")] = None,
    ref: Optional[str] = None,
    release: Annotated[Optional[str], typer.Option(help="release tag of this commit")] = None,
    message: Optional[str] = None,
    battery: Optional[str] = None,
    wait: Annotated[bool, typer.Option(help="wait for the verdict; exit 1 if flagged")] = False,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """CI: submit a commit. With --wait, show progress and exit non-zero on a flagged verdict."""
    from service.client import ApiError, OptdriftClient

    client = OptdriftClient(url)
    try:
        answer = client.submit_commit(project=project, sha=commit, source_dir=source,
                                      parents=parent or [], ref=ref, release_tag=release,
                                      message=message, battery=battery,
                                      idempotency_key=f"{project}:{commit}:{battery or ''}")
    except ApiError as exc:
        console.print(f"[red]submission refused:[/] {exc}")
        raise typer.Exit(2) from exc
    run_ids = [run["id"] for run in answer["runs"]]
    console.print(f"{'submitted' if answer['created'] else 'already submitted'} {commit}: "
                  f"run(s) {run_ids}")
    if wait:
        raise typer.Exit(wait_and_report(client, run_ids))


@app.command()
def verify(
    project: Annotated[str, typer.Option(help="project name")],
    base: Annotated[str, typer.Option(help="the commit sha or release to compare with")],
    source: Annotated[Optional[Path], typer.Option(help="your kernel source tree", file_okay=False)] = None,
    patch: Annotated[Optional[Path], typer.Option(help="a git diff against --base", dir_okay=False)] = None,
    battery: Optional[str] = None,
    wait: Annotated[bool, typer.Option(help="wait for the verdict")] = True,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """A contributor without a GPU: run your tree (or patch) on the service's workers against --base."""
    from service.client import ApiError, OptdriftClient

    if (source is None) == (patch is None):
        console.print("[red]give exactly one of --source DIR or --patch FILE[/]")
        raise typer.Exit(2)
    client = OptdriftClient(url)
    try:
        run = client.verify(project=project, base=base, source_dir=source, patch=patch, battery=battery)
    except ApiError as exc:
        console.print(f"[red]verify refused:[/] {exc}")
        raise typer.Exit(2) from exc
    console.print(f"verify run {run['id']}: {url}{run['report_url']}")
    if wait:
        raise typer.Exit(wait_and_report(client, [run["id"]]))


@app.command()
def check(
    source: Annotated[Path, typer.Option(help="the kernel source tree to check (e.g. csrc)")],
    baseline: Annotated[Optional[Path], typer.Option(help="the tree to compare with")] = None,
    battery: Annotated[str, typer.Option(help="quick, standard or a battery JSON file")] = "quick",
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible), cpu or cuda")] = "auto",
    json_out: Annotated[Optional[Path], typer.Option(help="write both runs and the verdict as JSON")] = None,
    show_unchanged: bool = False,
) -> None:
    """No server: build SOURCE (and BASELINE), run a battery, print the verdict; exit 1 if flagged."""
    from worker.check import run_check

    raise typer.Exit(run_check(source, baseline, battery, device=device, json_out=json_out,
                               show_unchanged=show_unchanged))


if __name__ == "__main__":
    app()
