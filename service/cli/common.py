"""What every `optdrift` command shares: the console, the exit codes, one-line failures and the
check that an extra is installed. Its own module so the commands' modules (service/cli*.py) import it
instead of each other (service.cli registers them; none imports it back)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

# Exit codes: CI branches on them, so each means one thing (README "Exit codes"); defined in
# service.cli.exit_codes, named here too for the commands that import them from this module.
from service.cli.exit_codes import (  # noqa: F401
    EXIT_BROKEN, EXIT_CHANGED, EXIT_NO_BASELINE, EXIT_NONDETERMINISTIC, EXIT_NOT_BUILDABLE, EXIT_OK,
    EXIT_OPTDRIFT_ERROR, EXIT_PRECEDENCE, EXIT_USAGE,
)
from service.cli.report import make_console
from service.core import outcomes

# At a terminal its width; in a CI log full-width lines (rich would cut tables at 80 columns).
console = make_console()
DEFAULT_URL = os.environ.get("OPTDRIFT_URL", "http://127.0.0.1:8000")
# Where several runs end differently, the exit code is the first of these that any run has
# (service/core/outcomes.py: an incomplete answer first, then the commit's own failure, then the findings).
_EXIT_PRECEDENCE = EXIT_PRECEDENCE
VERDICT_EXIT_CODES = ("Exit codes: 0 unchanged / acknowledged / no baseline allowed by --allow-no-baseline; "
                      "1 changed; 2 bad input or usage; 3 broken commit; 4 optdrift or service error; "
                      "5 nondeterministic; 7 no baseline (no ancestor has a finished run); 8 not buildable here "
                      "(the tree refuses this environment's CUDA, compiler or torch).")
SERVER_EXIT_CODES = "Exit codes: 0 done; 2 bad input or usage; 4 optdrift error."
# A verdict's exit code where no submission exists that could allow a missing baseline (`check`:
# a tree checked without one; `compare`: run A is always there to compare with): it passes there.
EXIT_BY_VERDICT = {name: outcomes.exit_code(name, no_baseline_allowed=True) for name in outcomes.NAMES}


# Which extra a command needs, and the modules that tell whether it is installed (looked up, not
# imported: the check costs nothing). The client install (`pip install optdrift`) has none.
# psycopg is not among them: the embedded default (SQLite) runs without it, and a PostgreSQL URL
# without it fails with SQLAlchemy's own message naming the driver.
SERVER_MODULES = ("fastapi", "uvicorn", "sqlalchemy", "alembic", "celery")
ENGINE_MODULES = ("torch", "numpy")  # building and running kernels on this machine (the worker extra)
WORKER_MODULES = (*SERVER_MODULES, *ENGINE_MODULES)


def needs_extra(command: str, extra: str, modules: tuple[str, ...]) -> None:
    """A command that needs an extra, run from the client install: one line naming the extra, exit 2.
    Every command that builds or runs kernels here (worker, check, sensitivity, adapter-check,
    bisect --local) calls it with ENGINE_MODULES before importing worker code
    (tests/service/cli/test_cli_ergonomics.py walks every command on a client install)."""
    import importlib.util

    missing = [name for name in modules if importlib.util.find_spec(name) is None]
    if missing:
        where = ("builds and runs kernels on this machine" if extra == "worker" and "torch" in missing
                 else "runs on the server side")
        raise fail(f"`optdrift {command}` {where} and needs the {extra} packages "
                   f"(missing: {', '.join(missing)}); install them with: pip install 'optdrift[{extra}]'",
                   EXIT_USAGE)


def fail(message: str, code: int) -> typer.Exit:
    """Print one line to stderr (plain print: rich would wrap it) and return the Exit to raise."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    return typer.Exit(code)


@contextmanager
def expected_failures(url: str) -> Iterator[None]:
    """Turn the failures a user can act on into one line and the right exit code."""
    import httpx

    from service.cli.client import ApiError

    try:
        yield
    except ApiError as exc:
        # 4xx: the request was wrong (the server's detail says how); 5xx: the service failed.
        raise fail(str(exc), EXIT_USAGE if exc.status_code < 500 else EXIT_OPTDRIFT_ERROR) from None
    except httpx.TransportError as exc:
        raise fail(f"cannot reach the optdrift service at {url}: {exc or type(exc).__name__}; "
                   "start it (`optdrift serve`) or point --url / OPTDRIFT_URL at it",
                   EXIT_OPTDRIFT_ERROR) from None
    except TimeoutError as exc:
        raise fail(f"{exc}; the runs go on, follow them on the dashboard", EXIT_OPTDRIFT_ERROR) from None


def check_format(output: str) -> None:
    if output not in ("text", "json"):
        raise fail(f"--format {output}: use text or json", EXIT_USAGE)


def cuda_visible() -> bool:
    """Asked in a child process: the CLI process itself stays clear of CUDA (the kernel hosts it
    starts use the GPU), and the answer takes seconds, not the minutes a run of broken cases does."""
    probe = "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0
