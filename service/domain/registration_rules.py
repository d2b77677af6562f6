"""What a project may be registered with (POST/PATCH /api/v1/projects, `optdrift project create |
update`): a default battery, an adapter and environments the service can run.

Each was stored as given, and the mistake surfaced later: `--battery quik` made every submission
fail; an environment no worker serves queued runs that waited for ever (issue 44). Registration now
refuses what can never run, naming the value and the valid choices, and says which worker setting
serves an environment that no live worker serves.

Environments are checked against the live workers (service/domain/workers.py). Workers may start
after the project is registered, so:
  - an environment that a live worker serves, or that the worker `optdrift serve` started will
    serve, is accepted;
  - while no worker at all is live (a service just set up, or every worker stopped) the service
    cannot tell what its workers will serve: the environment is accepted, with a warning naming
    the worker setting that serves it;
  - while workers are live and none serves it, it is refused (422) unless the request says
    `allow_unserved` (CLI `--allow-unserved`): then it is accepted with that warning.
"""

from __future__ import annotations

import difflib

from sqlalchemy.orm import Session

from service.domain import workers
from service.domain.errors import BadInputError
from service.domain.submission_rules import BUILTIN_BATTERIES

# The worker's built-in adapters (worker/adapters/__init__.py BUILTIN_ADAPTERS). Copied, not
# imported: the API does not import worker/ (torch). tests/service/api/test_registration_rules.py
# checks the two lists agree.
BUILTIN_ADAPTERS = ("bitsandbytes", "bundled", "lion_pytorch", "torchao")


def check_default_battery(name: str) -> None:
    """A default battery is a built-in name or the path of a battery file in the project's trees;
    a path is told by a `/` or a `.json` ending (a bare word is a built-in's name, so `quik` is a
    typo, not a file). The path itself is checked per submission, where the tree is known
    (service/domain/submissions.py)."""
    if name in BUILTIN_BATTERIES or "/" in name or name.endswith(".json"):
        return
    close = difflib.get_close_matches(name, BUILTIN_BATTERIES, n=1)
    raise BadInputError(
        f"unknown battery {name[:80]!r}: use one of {', '.join(sorted(BUILTIN_BATTERIES))}"
        f"{f' (did you mean {close[0]!r}?)' if close else ''}, or the path of a battery JSON file in the "
        "project's trees (e.g. batteries/mine.json)")


def check_adapter(name: str) -> None:
    """A built-in adapter, or the name the worker imports: an adapter its operator registered
    (OPTDRIFT_EXTRA_ADAPTERS) or a module a tree's optdrift.toml brings (adapter_path) -- dotted
    identifiers either way, as the worker reads a tree's `adapter` (service/core/project_config.py)."""
    if name in BUILTIN_ADAPTERS or all(part.isidentifier() for part in name.split(".")):
        return
    raise BadInputError(
        f"unknown adapter {name[:80]!r}: use one of {', '.join(BUILTIN_ADAPTERS)}, an adapter the workers' "
        "operator registered (OPTDRIFT_EXTRA_ADAPTERS) or an importable module name (identifiers separated "
        "by dots, e.g. myproject.adapter)")


def environment_warnings(*, session: Session, environments: list[str], allow_unserved: bool) -> list[str]:
    """The warnings for environments no live worker serves (accepted, see the module's note), or
    BadInputError naming each and the worker setting that serves it."""
    unserved = [reason for environment in environments
                if not workers.will_serve(session=session, environment=environment)
                and (reason := workers.unserved_reason(session=session, environment=environment))]
    if not unserved:
        return []
    if allow_unserved:
        return [f"{reason}; registered anyway (allow_unserved): its runs wait until such a worker starts"
                for reason in unserved]
    if not workers.live_workers(session=session):
        return [f"{reason}; registered anyway: no worker is live at all, so the service cannot tell what its "
                "workers will serve, and the runs wait until such a worker starts" for reason in unserved]
    raise BadInputError(
        f"{'; '.join(unserved)}. Start that worker first, or register the environment anyway with "
        "allow_unserved (`optdrift project create|update --allow-unserved`) if it starts later")


def check_registration(*, session: Session, fields: dict, allow_unserved: bool) -> list[str]:
    """Every registered field of `fields` (a create's or an update's) checked; the warnings to answer
    with (unserved environments accepted)."""
    if fields.get("default_battery") is not None:
        check_default_battery(fields["default_battery"])
    if fields.get("adapter") is not None:
        check_adapter(fields["adapter"])
    if fields.get("environments"):
        return environment_warnings(session=session, environments=fields["environments"],
                                    allow_unserved=allow_unserved)
    return []
