"""What a submission may name: a battery and the environments it runs in.

Both were passed to the worker as given. A battery is read by the worker as a *file path* when it
is not a built-in name, so `battery=$OPTDRIFT_HOME/admin-token` read the admin token into a public
run error (issue 13); an environment is a run and a Celery queue each, so one request could make
2000 runs for made-up environments. The API now refuses both with a 422 that says what is allowed.
"""

from __future__ import annotations

import re

from service.domain.errors import BadInputError

# The worker's built-in batteries (worker/battery.py BUILTIN_BATTERIES). Copied, not imported: the
# API does not import worker/ (torch). tests/service/api/test_request_rules.py checks the two lists agree.
BUILTIN_BATTERIES = ("quick", "standard", "ci")

MAX_BATTERY_PATH_CHARS = 200
# A relative path inside the submitted tree: components of letters, digits, `.`, `_`, `-`, none
# starting with `.` (so no `..`, no hidden tricks), joined by `/`. No leading `/`, backslash, NUL,
# spaces or `~` -- the worker resolves it under the tree, and nothing here can point elsewhere.
_RELATIVE_PATH = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")


def check_battery(battery: str | None) -> str | None:
    """`battery` unchanged when allowed (None: the project's default); else BadInputError."""
    if battery is None or battery in BUILTIN_BATTERIES:
        return battery
    if len(battery) <= MAX_BATTERY_PATH_CHARS and _RELATIVE_PATH.fullmatch(battery):
        return battery
    raise BadInputError(
        f"battery {battery[:80]!r} is not allowed: name a built-in battery "
        f"({', '.join(BUILTIN_BATTERIES)}) or a battery JSON file by its path relative to the "
        f"submitted tree (e.g. `batteries/mine.json`: letters, digits, `._-` and `/`, no leading "
        f"`/` or `.`, no `..`, at most {MAX_BATTERY_PATH_CHARS} characters)")


def check_environments(*, project_name: str, registered: list[str], requested: list[str] | None,
                       max_per_request: int) -> list[str]:
    """The environments to run in: the project's own when none are named; otherwise each must be
    one the project lists (registered by an admin at project creation), at most `max_per_request`,
    duplicates dropped in order."""
    if not requested:
        return list(registered)
    unique = list(dict.fromkeys(requested))
    if len(unique) > max_per_request:
        raise BadInputError(
            f"{len(unique)} environments named; a submission may name at most {max_per_request} "
            "(OPTDRIFT_MAX_ENVIRONMENTS_PER_REQUEST); leave `environments` empty to run in all of "
            f"project {project_name!r}'s")
    unknown = [name for name in unique if name not in registered]
    if unknown:
        shown = ", ".join(repr(name[:60]) for name in unknown[:5]) + (" ..." if len(unknown) > 5 else "")
        raise BadInputError(
            f"environment {shown} is not registered for project {project_name!r}; use one of "
            f"{', '.join(registered)} (or leave `environments` empty for all of them)")
    return unique
