"""A tree that cannot be built in an environment because it refuses the toolchain there (issue 47):
how it is said, in one place, for `optdrift check`, the worker's run error and the CLI's exit code.

Not the commit's fault (`broken`) nor optdrift's: an old release states in its build files that
it does not support this CUDA, compiler or torch (worker/build/refusal.py finds the line). The
run's error is the sentence `not buildable in <environment>: <the tree's line>`; the command exits
EXIT_NOT_BUILDABLE (8, service/core/outcomes.py) for it: nothing was checked, so it is never a
silent pass, and a script sweeping releases tells it from a broken one.
"""

from __future__ import annotations

PREFIX = "not buildable in "


def sentence(environment: str, line: str) -> str:
    """'not buildable in gpu.sm90: CUDA Version > 12 is not supported'."""
    return f"{PREFIX}{environment}: {line}"


def refusal_in(error: str | None) -> str | None:
    """The sentence, when a run's error is one (else None)."""
    return error if error and error.startswith(PREFIX) else None
