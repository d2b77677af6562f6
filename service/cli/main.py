"""`optdrift`: the command line (typer + rich).

serve    API + a worker on the embedded default (SQLite + filesystem broker under OPTDRIFT_HOME,
         default ~/.local/share/optdrift), migrating first; `--demo` loads the bundled kernels at
         a few commits, the weight-decay reorder among them.
worker   a Celery worker for OPTDRIFT_WORKER_ENVIRONMENT's queue.
migrate  alembic upgrade head.
submit   CI: post a commit and its source; `--wait` shows progress, the verdict and exits with it.
verify   a contributor's tree or patch against a known commit.
retry    re-queue a run that ended in `error` (optdrift's failure, not the commit's).
training a run's training impact: reference models trained with its optimizer and its baseline's.
demo     submit the demo commits to a running service.
token    create (shown once) / list / revoke API tokens; clients read theirs from OPTDRIFT_TOKEN,
         OPTDRIFT_TOKEN_FILE or ~/.config/optdrift/token, never from a command-line argument.

Server-side modules are imported inside the commands, so the client install (httpx, typer, rich)
can run `submit` and `verify`.

Exit codes (README "Exit codes"): 0 unchanged / no baseline / acknowledged, 1 changed, 2 bad input
or usage, 3 broken commit, 4 optdrift or service error, 5 nondeterministic. An expected failure
(server down, a missing file, a refused request) is one line on stderr, never a traceback.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from service.cli.report import make_console
from service.core import not_buildable, outcomes
from service.cli.common import (  # noqa: F401  (the names the commands below use)
    DEFAULT_URL, ENGINE_MODULES, EXIT_BROKEN, EXIT_CHANGED, EXIT_NO_BASELINE, EXIT_NONDETERMINISTIC,
    EXIT_NOT_BUILDABLE, EXIT_OK, EXIT_OPTDRIFT_ERROR, EXIT_USAGE, SERVER_EXIT_CODES, SERVER_MODULES,
    VERDICT_EXIT_CODES, WORKER_MODULES, _EXIT_PRECEDENCE, console,
)
from service.cli.common import check_format as _format, cuda_visible as _cuda_visible  # noqa: F401
from service.cli.common import expected_failures as _expected_failures, fail as _fail, needs_extra as _needs_extra

app = typer.Typer(help="optdrift: did this commit change a training trajectory?", no_args_is_help=True)
UrlOption = Annotated[str, typer.Option("--url", help="the optdrift API (env OPTDRIFT_URL)")]
REPO_ROOT = Path(__file__).resolve().parents[2]  # service/cli/main.py -> the checkout



FormatOption = Annotated[str, typer.Option("--format", help="text (tables) or json (one JSON document "
                                                              "on stdout, progress on stderr)")]
# After a changed verdict the worker co-runs the baseline on the changed cases: the size of the
# change (max |Δ|) and its kind (ulp, kind) arrive after the verdict, so --wait waits for them too.
DetailOption = Annotated[bool, typer.Option(
    "--detail/--no-detail",
    help="with a changed verdict, also wait for the co-run detail (each changed case's max |commit − "
         "baseline|, ulp and kind); --no-detail reports the verdict as soon as it exists")]
DetailTimeoutOption = Annotated[float, typer.Option(
    "--detail-timeout", min=0, help="seconds to wait for the co-run detail after the verdict; past it the "
                                    "verdict is reported and the detail follows on the run page")]
DEFAULT_DETAIL_TIMEOUT_S = 600.0
# After the co-run of a changed run the worker trains reference models with both optimizers
# (issue 46): --wait waits for that verdict too, after the trajectory verdict's tables.
TrainingOption = Annotated[bool, typer.Option(
    "--training/--no-training",
    help="with a changed verdict, also wait for its training impact (reference models trained with the "
         "commit's and the baseline's optimizer) and print a line per model and configuration after the "
         "verdict; it never changes the exit code. --no-training skips the wait")]
TrainingTimeoutOption = Annotated[float, typer.Option(
    "--training-timeout", min=0, help="seconds to wait for the training impact after the verdict; past it "
                                      "the command ends and `optdrift training RUN_ID` shows it later")]
DEFAULT_TRAINING_TIMEOUT_S = 900.0
# The verdict tables fit the terminal (service/core/terminal_tables.py): at a narrow one the columns
# of least use are left out, and their caption names them; --wide shows them all.
WideOption = Annotated[bool, typer.Option(
    "--wide", help="every column of the verdict tables, however narrow the terminal (the lines are then "
                   "wider than it); without it the tables fit the terminal and name the columns left out")]


def _version(value: bool) -> None:
    """The installed package's version and the public adapter API's (worker.adapters.api, which
    imports no torch, so a client install answers too)."""
    if value:
        from importlib.metadata import PackageNotFoundError, version

        from worker.adapters.api import API_VERSION

        try:
            print(f"optdrift {version('optdrift')}")
        except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
            print("optdrift (not installed)")
        print(f"adapter API {API_VERSION}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def main(_version_option: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True,
        help="print optdrift's version and its adapter API's, and exit")] = False) -> None:
    """optdrift: did this commit change a training trajectory?"""


def _needs_bundled_kernels(command: str) -> Path:
    csrc = REPO_ROOT / "csrc"
    if not csrc.is_dir():
        raise _fail(f"`optdrift {command}` submits the bundled kernels, which only a checkout of optdrift "
                    f"has ({csrc} is missing); run it from a clone: pip install -e '.[worker]'", EXIT_USAGE)
    return csrc


def _source_folder(source: Path | None) -> None:
    if source is not None and not source.is_dir():
        raise _fail(f"--source {source} is not a folder; pass the kernel source tree (e.g. csrc)", EXIT_USAGE)


@app.command(epilog=SERVER_EXIT_CODES)
def migrate() -> None:
    """Create or upgrade the database schema (alembic upgrade head)."""
    _needs_extra("migrate", "server", SERVER_MODULES)
    from service.db.migrate import upgrade_to_head
    from service.home_modes import secure_home
    from service.settings import get_settings

    settings = get_settings()
    secure_home(settings)
    upgrade_to_head()
    console.print(f"database at {settings.resolved_database_url.split('@')[-1]} is up to date")


@app.command(epilog=SERVER_EXIT_CODES)
def worker(
    pool: Annotated[str, typer.Option(help="celery pool: prefork (production) or solo")] = "prefork",
    concurrency: Annotated[int, typer.Option(help="runs at once; keep 1 per GPU")] = 1,
    loglevel: str = "INFO",
    gpus: Annotated[Optional[str], typer.Option(
        help="all or GPU indices (0,1): one worker process per GPU, CUDA_VISIBLE_DEVICES set, "
             "queue gpu.sm<cc> of its compute capability")] = None,
    name: Annotated[Optional[str], typer.Option(
        help="this worker's name (letters, digits, - and _), to run several workers of one queue on one host")] = None,
) -> None:
    """Run a Celery worker consuming OPTDRIFT_WORKER_ENVIRONMENT's queue (cpu, gpu.sm90, ...)."""
    _needs_extra("worker", "worker", WORKER_MODULES)
    if gpus is not None:
        from worker.gpu_workers import run_gpu_workers

        try:
            code = run_gpu_workers(gpus, worker_args=["--pool", pool, "--concurrency", str(concurrency),
                                                      "--loglevel", loglevel])
        except (RuntimeError, ValueError) as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from exc
        raise typer.Exit(code)
    if name is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", name):
        raise _fail(f"--name {name!r}: use 1-40 letters, digits, '-' or '_'", EXIT_USAGE)
    # Root only to launch the box (worker/sandbox/privilege.py): as root, become OPTDRIFT_WORKER_USER
    # now, before Celery, its pool and any thread start. (`--gpus` above supervises and starts the
    # per-GPU workers, each of which drops here; it touches no file, database or network itself.)
    from service.settings import get_settings
    from worker.sandbox.privilege import DropRefused, drop_for_worker

    try:
        drop_for_worker(get_settings())
    except DropRefused as exc:
        raise _fail(f"the worker cannot drop root: {exc}", EXIT_USAGE) from None
    get_settings.cache_clear()  # read again as the worker user: HOME and the preloaded secrets changed
    from worker.celery_app import app as celery_app, worker_argv

    settings = get_settings()
    celery_app.worker_main(worker_argv(environment=settings.worker_environment,
                                       concurrency=concurrency, pool=pool, loglevel=loglevel, name=name,
                                       variants=list(settings.build_variants)))


@app.command(epilog=SERVER_EXIT_CODES)
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    with_worker: Annotated[bool, typer.Option("--worker/--no-worker",
                                              help="also start a local worker process")] = True,
    demo: Annotated[bool, typer.Option(help="load the bundled kernels at a few commits")] = False,
) -> None:
    """Start the API (and a local worker) on the configured database and broker; the embedded
    default needs no servers: data lives in OPTDRIFT_HOME (~/.local/share/optdrift)."""
    _needs_extra("serve", "server", SERVER_MODULES)
    if with_worker:
        _needs_extra("serve (with its local worker; --no-worker serves the API alone)", "worker",
                     WORKER_MODULES)
    if demo:
        _needs_bundled_kernels("serve --demo")
    from service.cli.serve_lock import ServeAlreadyRunning, ServeLock
    from service.settings import get_settings

    public_url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    # One serve per OPTDRIFT_HOME (service/cli/serve_lock.py), held until this process ends.
    try:
        home_lock = ServeLock(get_settings().home, public_url).acquire()
    except ServeAlreadyRunning as running:
        raise _fail(str(running), EXIT_USAGE) from None
    # First, before minutes of anything: a port someone else holds is the commonest failure.
    _port_free_or_fail(host, port)
    import uvicorn

    from service.db.migrate import upgrade_to_head
    from service.home_modes import secure_home

    if not os.environ.get("OPTDRIFT_PUBLIC_URL"):
        os.environ["OPTDRIFT_PUBLIC_URL"] = public_url
    get_settings.cache_clear()
    settings = get_settings()
    # OPTDRIFT_HOME 0700, the SQLite database and the secret files 0600 (service/home_modes.py).
    secure_home(settings)
    upgrade_to_head()
    _bootstrap_tokens(settings)
    _seal_credentials(settings)
    # A worker started apart (`optdrift worker`) from the same OPTDRIFT_HOME reads this to find
    # the API (Settings.resolved_public_url), so serve on any port needs no OPTDRIFT_PUBLIC_URL.
    settings.api_url_file.write_text(public_url + "\n")
    console.print(f"optdrift data in [bold]{settings.home}[/]; database "
                  f"{settings.resolved_database_url.split('@')[-1]}; broker "
                  f"{settings.resolved_broker_url.split('@')[-1]}", highlight=False)
    worker_process = None
    worker_log = settings.home / "logs" / "worker.log"
    if with_worker:
        # Celery's banner and warnings go to the log file, not the console: the console is for
        # the one line a person needs (where the dashboard is).
        worker_log.parent.mkdir(parents=True, exist_ok=True)
        with worker_log.open("ab") as log:
            worker_process = subprocess.Popen(
                [sys.executable, "-m", "service.cli", "worker", "--pool", "solo", "--loglevel", "WARNING"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env={**os.environ, "OPTDRIFT_PUBLIC_URL": settings.public_url,
                     # the worker imports this checkout's packages even when run from another folder
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))})
        from service.domain import workers

        # the API below runs in this process: until that worker beats, runs wait for it, not for a person
        workers.embedded_worker_started(environment=settings.worker_environment,
                                        variants=sorted(settings.build_variants))
    from service.api.slow_clients import uvicorn_options

    # Idle keep-alive, slow-header and slow-body connections are closed (service/api/slow_clients.py).
    server = uvicorn.Server(uvicorn.Config("service.api.main:create_app", factory=True, host=host, port=port,
                                           log_level="warning", **uvicorn_options(settings)))
    threading.Thread(target=_announce_when_listening,
                     args=(server, public_url, worker_log if with_worker else None, demo), daemon=True).start()
    # uvicorn shuts down gracefully on SIGTERM and then re-raises it with the handler that was there
    # before; with the default one the process would die on the spot, skipping the `finally` below
    # and orphaning the worker (seen: `kill <serve>` left the worker running). As an exception the
    # signal unwinds through it instead.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        try:
            server.run()
        except SystemExit:
            if not server.started:  # the port was taken between our check and uvicorn's bind
                raise _fail(_busy_port_message(host, port), EXIT_USAGE) from None
            raise
    finally:
        _remove_api_url_file(settings.api_url_file, public_url)
        if worker_process is not None:
            worker_process.terminate()
            worker_process.wait(timeout=30)
        home_lock.release()


def _busy_port_message(host: str, port: int) -> str:
    return (f"port {port} on {host} is already in use (another `optdrift serve`, or another program); "
            f"pick another with `optdrift serve --port {port + 1}`, or stop what listens there "
            f"(`ss -ltnp 'sport = :{port}'` shows it)")


def _port_free_or_fail(host: str, port: int) -> None:
    """Bind the address once, as uvicorn will: a taken port is one line and exit 2, not Errno 98."""
    import errno
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise _fail(_busy_port_message(host, port), EXIT_USAGE) from None
            raise _fail(f"cannot listen on {host}:{port}: {exc.strerror}; check --host and --port",
                        EXIT_USAGE) from None


def _announce_when_listening(server, public_url: str, worker_log: Path | None, demo: bool) -> None:  # noqa: ANN001
    """The one line a person looks for, printed as soon as uvicorn accepts connections."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.05)
    worker = f"; worker log {worker_log}" if worker_log is not None else ""
    print(f"optdrift serving {public_url}/ (dashboard; API docs {public_url}/docs{worker}); "
          "Ctrl-C stops it", flush=True)
    if demo:
        _demo(public_url)


def _remove_api_url_file(path: Path, public_url: str) -> None:
    """Remove serve's api-url file unless another serve of the same home has replaced it since."""
    try:
        if path.read_text().strip() == public_url:
            path.unlink()
    except OSError:
        pass


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


def _seal_credentials(settings) -> None:  # noqa: ANN001
    """First start: the secrets key (<home>/secrets-key, 0600, unless one is configured); every
    start: credentials stored before encryption are encrypted in place (service/notify/sealing.py)."""
    from service.db.session import get_engine, get_sessionmaker
    from service.notify.sealing import (
        SecretsKeyError, ensure_key, forget_plaintext_pages, seal_stored_credentials,
    )

    try:
        where = ensure_key(settings)
        with get_sessionmaker()() as session:
            sealed = seal_stored_credentials(session, settings)
            session.commit()
    except SecretsKeyError as exc:
        raise _fail(str(exc), EXIT_USAGE) from None
    if sealed:
        forget_plaintext_pages(get_engine())
        console.print(f"encrypted {sealed} stored credential(s) with the secrets key from {where}")


token_app = typer.Typer(help="API tokens: create (shown once), list, revoke. Runs against the "
                             "configured database, so only someone on the server can do it.")
app.add_typer(token_app, name="token")


@token_app.callback()
def token_main() -> None:
    """API tokens: create (shown once), list, revoke."""
    _needs_extra("token", "server", SERVER_MODULES)


@token_app.command("create", epilog=SERVER_EXIT_CODES)
def token_create(
    name: Annotated[str, typer.Option(help="who or what holds it (e.g. 'ci-bitsandbytes')")],
    scope: Annotated[str, typer.Option(help="admin, submit (CI), verify (contributors), maintain "
                                                 "(acknowledging changes) or worker")],
    project: Annotated[Optional[str], typer.Option(help="limit a submit/verify/maintain token to this project")] = None,
    expires_days: Annotated[Optional[float], typer.Option(help="expire after this many days")] = None,
    daily_quota: Annotated[Optional[int], typer.Option(help="verify runs per UTC day "
                                                        "(default OPTDRIFT_VERIFY_DAILY_QUOTA)")] = None,
) -> None:
    """Create a token and print it ONCE (only its sha256 is stored)."""
    from service.db.session import get_sessionmaker
    from service.domain.auth import create_token
    from service.domain.errors import NotFoundError
    from service.domain.projects import get_by_name

    with get_sessionmaker()() as session:
        if project:
            try:
                get_by_name(session=session, name=project)
            except NotFoundError:
                # Made anyway (an admin may create the project next), but never silently: a
                # misspelt name would otherwise give a token that is refused on every request.
                print(f"warning: project {project!r} does not exist (yet); the token is refused until "
                      f"an admin creates it (POST /api/v1/projects {{\"name\": \"{project}\"}}); "
                      "`optdrift token revoke ID` if the name is misspelt", file=sys.stderr)
        try:
            row, token = create_token(session=session, name=name, scope=scope, project=project,
                                      expires_in_days=expires_days, daily_quota=daily_quota)
        except ValueError as exc:
            console.print(f"[red]{exc}[/]")
            raise typer.Exit(2) from exc
        session.commit()
    # stderr for the words, stdout for the token alone: `optdrift token create ... > file` works.
    make_console(stderr=True).print(f"token {row.id} ({scope}{' for ' + project if project else ''}); "
                               "shown once, store it now:")
    print(token)


@token_app.command("list", epilog=SERVER_EXIT_CODES)
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


@token_app.command("revoke", epilog=SERVER_EXIT_CODES)
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


def _demo(url: str) -> None:
    """serve --demo: submit the demo commits, then say how they go until their verdicts."""
    try:
        submitted = load_demo(url)
        watch_demo(url, [run["id"] for answer in submitted for run in answer["runs"]])
    except Exception as exc:  # noqa: BLE001
        print(f"demo failed: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)


def watch_demo(url: str, run_ids: list[int]) -> None:
    """Progress lines (the first build takes minutes on a small machine), then the verdicts."""
    from service.cli.report import ProgressLines
    from service.cli.client import OptdriftClient

    client = OptdriftClient(url)
    lines = ProgressLines(lambda text: print(text, flush=True), interval_s=15.0, prefix="demo: ")
    final = client.wait(run_ids, on_update=lines.update, poll_s=2.0)
    for run in final:
        outcome = (run.get("verdict") or {}).get("outcome", run["status"])
        print(f"demo: {run['commit_sha']}: {outcome} {client.dashboard_url(run['id'])}", flush=True)
    print(f"demo: done; the commits and their verdicts: {url}/projects/bundled", flush=True)


def load_demo(url: str, project: str = "bundled") -> list[dict]:
    """Submit the bundled csrc at three commits: base, the decay-after-update reorder (flagged),
    a comment-only change (unchanged)."""
    import tempfile

    from service.cli.client import OptdriftClient
    from worker.mutations import comment_only, copy_tree, decay_after_update

    client = OptdriftClient(url)
    client.ensure_project(project)
    csrc = _needs_bundled_kernels("demo")
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
            print(f"demo: submitted {sha} -> run(s) {[r['id'] for r in answer['runs']]}", flush=True)
    print(f"demo: follow them on {url}/projects/{project}", flush=True)
    return submitted


@app.command("demo", epilog=SERVER_EXIT_CODES)
def demo_command(url: UrlOption = DEFAULT_URL, project: str = "bundled") -> None:
    """Submit the demo commits to a running service (see `serve --demo`)."""
    _needs_bundled_kernels("demo")
    with _expected_failures(url):
        load_demo(url, project)


def run_exit_code(run: dict) -> int:
    """One final run's exit code: its status first (error: optdrift's failure, failed: the
    commit's), then its verdict."""
    verdict = run.get("verdict") or {}
    outcome = verdict.get("outcome")
    if run["status"] in ("error", "cancelled"):
        return EXIT_OPTDRIFT_ERROR
    if run["status"] == "failed" and not_buildable.refusal_in(run.get("error")):
        return EXIT_NOT_BUILDABLE  # the tree refuses the worker's toolchain: not broken (issue 47)
    if run["status"] == "failed":
        return EXIT_BROKEN
    if outcome not in outcomes.BY_NAME:  # no verdict (a cancelled baseline's child), as before the table
        return EXIT_OK
    # The outcome's code (service/core/outcomes.py): only an acknowledged change passes; a missing
    # baseline fails unless the submission allowed it (never a silent pass, issue 44).
    return outcomes.exit_code(outcome, acknowledged=bool(verdict.get("acknowledged")),
                              no_baseline_allowed=bool(verdict.get("no_baseline_allowed")))


def wait_and_report(client, run_ids: list[int], *, output: str = "text", detail: bool = True,  # noqa: ANN001
                    detail_timeout_s: float = DEFAULT_DETAIL_TIMEOUT_S, wide: bool = False,
                    training: bool = False, training_timeout_s: float = DEFAULT_TRAINING_TIMEOUT_S) -> int:
    """Progress while the runs go (a bar at a terminal, lines in a log, stderr for `--format
    json`); with `detail`, then the co-run detail of changed verdicts (at most `detail_timeout_s`);
    then the verdict tables or the JSON document; with `training`, the training impact of changed
    runs after the tables (service/cli/training.py; in the JSON document as `training`). Returns the
    exit code (neither the detail nor the training impact changes it)."""
    from service.cli.training import wait_and_print as wait_for_training_impact
    from service.cli.report import (detail_still_coming, json_report, print_report, wait_for_detail_with_progress,
                                    wait_with_progress)

    progress_console = make_console(stderr=True) if output == "json" else console
    final = wait_with_progress(client, run_ids, progress_console)
    pending: list[int] = []
    if detail:
        final, pending = wait_for_detail_with_progress(client, final, progress_console,
                                                       timeout_s=detail_timeout_s)
    codes = {run["id"]: run_exit_code(run) for run in final}
    exit_code = next(code for code in _EXIT_PRECEDENCE if code in codes.values())
    if output == "json":
        impacts = wait_for_training_impact(client, final, console=console, progress_console=progress_console,
                                           timeout_s=training_timeout_s, output=output) if training else {}
        print(json_report(final, exit_code, detail_still_coming=pending,
                          dashboard_urls={run["id"]: client.dashboard_url(run["id"]) for run in final},
                          **({"training": {str(run_id): job for run_id, job in impacts.items()}} if training else {})))
    else:
        print_report(console, final, wide=wide)
    for run in final:
        if run["id"] in pending:
            print(detail_still_coming(run, timeout_s=detail_timeout_s, dashboard_url=client.dashboard_url(run["id"])),
                  file=sys.stderr)
    for run in final:
        if run["status"] == "failed" and (refused := not_buildable.refusal_in(run.get("error"))):
            print(f"warning: run {run['id']}: {refused} (the tree refuses this worker's toolchain; "
                  f"exit {EXIT_NOT_BUILDABLE}, not broken)", file=sys.stderr)
        if run["status"] == "error":  # not the commit's fault: say so, and how to run it again
            print(f"error: run {run['id']} failed in optdrift, not in the commit: "
                  f"{' '.join((run.get('error') or 'no detail').split())}; "
                  f"`optdrift retry {run['id']}` runs it again", file=sys.stderr)
    if training and output == "text":  # after the verdict it reads beside: the tables are not held back for it
        wait_for_training_impact(client, final, console=console, progress_console=progress_console,
                                 timeout_s=training_timeout_s, output=output)
    return exit_code


@app.command(epilog=VERDICT_EXIT_CODES)
def submit(
    project: Annotated[str, typer.Option(help="project name")],
    commit: Annotated[str, typer.Option(help="commit sha")],
    source: Annotated[Path, typer.Option(help="the kernel source tree to upload")],
    parent: Annotated[Optional[list[str]], typer.Option(help="parent sha (repeat; first parent first)")] = None,
    ref: Optional[str] = None,
    release: Annotated[Optional[str], typer.Option(help="release tag of this commit")] = None,
    message: Optional[str] = None,
    battery: Optional[str] = None,
    wait: Annotated[bool, typer.Option(help="wait for the verdict and exit with it")] = False,
    url: UrlOption = DEFAULT_URL,
    output: FormatOption = "text",
    detail: DetailOption = True,
    detail_timeout: DetailTimeoutOption = DEFAULT_DETAIL_TIMEOUT_S,
    wide: WideOption = False,
    training: TrainingOption = True,
    training_timeout: TrainingTimeoutOption = DEFAULT_TRAINING_TIMEOUT_S,
    allow_no_baseline: Annotated[bool, typer.Option(
        "--allow-no-baseline", help="accept having nothing to compare with (a project's first commit): a "
                                    "no-baseline verdict then exits 0 (neutral on GitHub) instead of 6")] = False,
    ancestry: Annotated[bool, typer.Option(
        "--ancestry/--no-ancestry", help="send the commit's first-parent ancestors (up to 200, read with git "
                                         "from the clone holding --source) so the service compares with the "
                                         "nearest one it has a finished run of")] = True,
) -> None:
    """CI: submit a commit. With --wait, show progress and exit with the verdict's code; a changed
    verdict's training impact follows it (--no-training skips it) and never changes the exit code."""
    from service.cli.client import OptdriftClient
    from service.core.archives import ArchiveError

    _format(output)
    _source_folder(source)
    client = OptdriftClient(url)
    say = print if output == "text" else _to_stderr
    ancestors = _ancestry_of(source, commit, say) if ancestry else []
    with _expected_failures(url):
        try:
            answer = client.submit_commit(project=project, sha=commit, source_dir=source,
                                          parents=parent or [], ref=ref, release_tag=release,
                                          message=message, battery=battery,
                                          idempotency_key=f"{project}:{commit}:{battery or ''}",
                                          ancestry=ancestors, allow_no_baseline=allow_no_baseline)
        except ArchiveError as exc:
            raise _fail(f"--source {source}: {exc}", EXIT_USAGE) from None
        run_ids = [run["id"] for run in answer["runs"]]
        # With --format json stdout is the JSON document alone; the words go to stderr.
        say(f"{'submitted' if answer['created'] else 'already submitted'} {commit}: run(s) {run_ids}")
        for run_id in run_ids:
            say(f"run {run_id}: {client.dashboard_url(run_id)}")
        if wait:
            raise typer.Exit(wait_and_report(client, run_ids, output=output, detail=detail,
                                             detail_timeout_s=detail_timeout, wide=wide, training=training,
                                             training_timeout_s=training_timeout))
        if output == "json":
            from service.cli.report import json_report

            print(json_report(answer["runs"], EXIT_OK, created=answer["created"],
                              dashboard_urls={run_id: client.dashboard_url(run_id) for run_id in run_ids}))


def _to_stderr(text: str) -> None:
    print(text, file=sys.stderr)


def _ancestry_of(source: Path, commit: str, say) -> list[str]:  # noqa: ANN001
    """The commit's first-parent ancestors from the git clone holding --source (nearest first), or
    none, saying why, when the folder is no clone or lacks the commit: the service then knows only
    --parent, and answers no-baseline if that was never submitted."""
    from service.cli.git_history import GitError, first_parent_ancestry
    from service.domain.ancestry import MAX_ANCESTRY

    try:
        in_clone = subprocess.run(["git", "-C", str(source), "rev-parse", "--git-dir"], capture_output=True,
                                  check=False).returncode == 0
    except FileNotFoundError:  # no git on this machine: --parent alone
        in_clone = False
    if not in_clone:
        return []  # not a clone (a tree exported for the upload): nothing to read, nothing to say
    try:
        return first_parent_ancestry(source, commit, MAX_ANCESTRY)
    except GitError as exc:
        say(f"note: no ancestry sent ({exc}); the service compares with --parent only. Fetch the history "
            "(actions/checkout fetch-depth: 0, or `git fetch --deepen=200`) so it can find the nearest "
            "submitted ancestor")
        return []


@app.command(epilog=VERDICT_EXIT_CODES)
def verify(
    project: Annotated[str, typer.Option(help="project name")],
    base: Annotated[str, typer.Option(help="the commit sha or release to compare with")],
    source: Annotated[Optional[Path], typer.Option(help="your kernel source tree")] = None,
    patch: Annotated[Optional[Path], typer.Option(
        help="a git diff against --base, from the repository root or from the source folder")] = None,
    battery: Optional[str] = None,
    wait: Annotated[bool, typer.Option(help="wait for the verdict")] = True,
    url: UrlOption = DEFAULT_URL,
    output: FormatOption = "text",
    detail: DetailOption = True,
    detail_timeout: DetailTimeoutOption = DEFAULT_DETAIL_TIMEOUT_S,
    wide: WideOption = False,
    training: TrainingOption = True,
    training_timeout: TrainingTimeoutOption = DEFAULT_TRAINING_TIMEOUT_S,
) -> None:
    """A contributor without a GPU: run your tree (or patch) on the service's workers against --base."""
    from service.cli.client import OptdriftClient
    from service.core.archives import ArchiveError

    _format(output)
    if (source is None) == (patch is None):
        raise _fail("give exactly one of --source DIR or --patch FILE", EXIT_USAGE)
    _source_folder(source)
    if patch is not None and not patch.is_file():
        raise _fail(f"--patch {patch} is not a file; pass a diff made with `git diff` against --base",
                    EXIT_USAGE)
    client = OptdriftClient(url)
    with _expected_failures(url):
        try:
            run = client.verify(project=project, base=base, source_dir=source, patch=patch, battery=battery)
        except ArchiveError as exc:
            raise _fail(f"--source {source}: {exc}", EXIT_USAGE) from None
        say = print if output == "text" else _to_stderr
        if run.get("patch_layout"):
            say(run["patch_layout"])
        say(f"verify run {run['id']}: {client.dashboard_url(run['id'])}")
        if wait:
            raise typer.Exit(wait_and_report(client, [run["id"]], output=output, detail=detail,
                                             detail_timeout_s=detail_timeout, wide=wide, training=training,
                                             training_timeout_s=training_timeout))
        if output == "json":
            from service.cli.report import json_report

            print(json_report([run], EXIT_OK, dashboard_urls={run["id"]: client.dashboard_url(run["id"])}))


@app.command(epilog=VERDICT_EXIT_CODES)
def retry(
    run_id: Annotated[int, typer.Argument(help="the run's id (submit and verify print it)")],
    wait: Annotated[bool, typer.Option(help="wait for the verdict and exit with it")] = False,
    url: UrlOption = DEFAULT_URL,
    detail: DetailOption = True,
    detail_timeout: DetailTimeoutOption = DEFAULT_DETAIL_TIMEOUT_S,
    wide: WideOption = False,
) -> None:
    """Re-queue a run whose status is `error` (optdrift failed, not the commit)."""
    from service.cli.client import OptdriftClient

    client = OptdriftClient(url)
    with _expected_failures(url):
        run = client.retry(run_id)
        print(f"run {run['id']} queued again: {client.dashboard_url(run['id'])}")
        if wait:
            raise typer.Exit(wait_and_report(client, [run["id"]], detail=detail, detail_timeout_s=detail_timeout,
                                             wide=wide))


@app.command(epilog="Exit codes: 0 acknowledged; 2 bad input or a refused request (no maintain or admin token, "
                    "no verdict yet, nothing to acknowledge: the run is unchanged or has no baseline); "
                    "4 optdrift or service error.")
def ack(
    run_id: Annotated[int, typer.Argument(help="the run whose change is intended (submit prints it)")],
    note: Annotated[str, typer.Option(help="why the change is intended (kept with the verdict)")],
    by: Annotated[Optional[str], typer.Option(help="who acknowledges (default: the token's name)")] = None,
    url: UrlOption = DEFAULT_URL,
) -> None:
    """A maintainer (a maintain or admin token) acknowledges a changed verdict as intended: CI then
    exits 0 for it, later commits compare with this run, and a later commit making the same change
    (main's merge commit of an acknowledged pull request) is acknowledged automatically."""
    from service.cli.client import OptdriftClient

    if not note.strip():
        raise _fail("--note is empty; say why the change is intended", EXIT_USAGE)
    client = OptdriftClient(url)
    with _expected_failures(url):
        verdict = client.acknowledge(run_id, note=note, by=by)
    print(f"run {run_id}: {verdict['outcome']} acknowledged"
          f"{' by ' + verdict['acknowledged_by'] if verdict.get('acknowledged_by') else ''}: "
          f"{verdict.get('acknowledgement_note')}; {client.dashboard_url(run_id)}")


@app.command(epilog=VERDICT_EXIT_CODES)
def check(
    source: Annotated[Path, typer.Option(help="the kernel source tree to check (e.g. csrc)")],
    baseline: Annotated[Optional[Path], typer.Option(help="the tree to compare with")] = None,
    battery: Annotated[Optional[str], typer.Option(
        help="quick, standard, ci or a battery JSON file; default: the tree's optdrift.toml battery, else quick")] = None,
    device: Annotated[str, typer.Option(help="auto (cuda when a GPU is visible), cpu or cuda")] = "auto",
    json_out: Annotated[Optional[Path], typer.Option(help="write both runs and the verdict as JSON")] = None,
    show_unchanged: bool = False,
    attribution: Annotated[bool, typer.Option(
        help="say what kind of change each changed case is (rounding-level, or which semantic change); "
             "it re-runs the changed cases on both builds")] = True,
    output: FormatOption = "text",
    wide: WideOption = False,
) -> None:
    """No server: build SOURCE (and BASELINE), run a battery, print the verdict and exit with it.

    Time: both builds (cached by digest after the first), the battery on both trees (quick and ci: seconds when warm on a 2-core CPU; standard: minutes on a CPU, seconds on a GPU; docs/PERFORMANCE.md), and for a changed tree the co-run of its changed cases and the attribution of at most 32 of them. Each phase is said as it starts; the last line says where the time went."""  # noqa: E501 (one paragraph: the help wraps it)
    _needs_extra("check", "worker", ENGINE_MODULES)
    from service.cli.check import run_check

    if device.startswith("cuda") and not _cuda_visible():
        raise _fail(f"--device {device}: no CUDA GPU is visible on this machine (torch.cuda.is_available() "
                    "is False); use --device cpu, or run on a machine with a GPU", EXIT_USAGE)
    _format(output)
    if output == "text":
        raise typer.Exit(run_check(source, baseline, battery, device=device, json_out=json_out,
                                   show_unchanged=show_unchanged, console=console, attribute=attribution,
                                   wide=wide))
    # JSON: the tables go to stderr, the document (both runs and the verdict) to stdout.
    import json
    import tempfile

    with tempfile.TemporaryDirectory(prefix="optdrift-check-") as tmp:
        document = json_out or Path(tmp) / "check.json"
        code = run_check(source, baseline, battery, device=device, json_out=document,
                         show_unchanged=show_unchanged, console=make_console(stderr=True), attribute=attribution,
                         wide=wide)
        body = json.loads(document.read_text()) if document.is_file() else {}
    print(json.dumps({"exit_code": code, **body}, indent=2))
    raise typer.Exit(code)


from service.cli import speed as cli_speed  # noqa: E402  (the kernels' own speed of a run; it imports this module lazily)

app.command("speed", epilog=cli_speed.EXIT_CODES)(cli_speed.speed)

from service.cli import bisect as cli_bisect  # noqa: E402  (`optdrift bisect`: the first commit that changed each case)

app.command("bisect", epilog=cli_bisect.BISECT_EXIT_CODES)(cli_bisect.bisect)

from service.cli import sensitivity as cli_sensitivity  # noqa: E402  (`optdrift sensitivity`: the mutation catalogue against a battery)

app.command("sensitivity", epilog=cli_sensitivity.EXIT_CODES)(cli_sensitivity.sensitivity)

from service.cli import adapter_check as cli_adapter_check  # noqa: E402  (`optdrift adapter-check`: both engines on an adapter)

app.command("adapter-check", epilog=cli_adapter_check.EXIT_CODES)(cli_adapter_check.adapter_check)

from service.cli import notify as cli_notify  # noqa: E402  (`optdrift notify`: GitHub checks and comments, webhooks)

app.add_typer(cli_notify.notify_app, name="notify")

from service.cli import project as cli_project  # noqa: E402  (`optdrift project`: register a project, show what its runs use)

app.add_typer(cli_project.project_app, name="project")

from service.cli import compare as cli_compare  # noqa: E402  (`optdrift compare`: one commit in two environments)

app.command("compare", epilog=cli_compare.EXIT_CODES)(cli_compare.compare)

from service.cli import training as cli_training  # noqa: E402  (`optdrift training`: a run's training impact)

app.command("training", epilog=cli_training.EXIT_CODES)(cli_training.training)
