"""The exit codes of the verdict commands (`submit --wait`, `verify`, `retry --wait`, `check`), named
for the command's modules (service.cli.common, which decides a run's code, and service.cli.report,
which prints it beside a no-baseline run). Their one definition, with the outcome each one says, is
service/core/outcomes.py."""

from service.core.outcomes import (  # noqa: F401
    EXIT_BROKEN, EXIT_CHANGED, EXIT_NO_BASELINE, EXIT_NONDETERMINISTIC, EXIT_NOT_BUILDABLE, EXIT_OK,
    EXIT_OPTDRIFT_ERROR, EXIT_PRECEDENCE, EXIT_USAGE,
)
