"""A submitted tree's battery file, measured against the run's battery limits before any row is made.

The worker would refuse a battery past its limits too (worker/pipeline.py prepare), but only after
fetching the tree; here the submitter hears it at once, as a 422 naming the battery, the value and
the limit (service/core/battery_limits.py). The file is read from the archive with its bytes bounded
and parsed as JSON; what it declares is counted from its axis lengths, nothing expanded. The rest of
the battery's schema stays the worker's to judge (the API does not import worker/).
"""

from __future__ import annotations

import json

from service.core.archives import ArchiveError, ArchiveLimits, root_file_and_names
from service.core.battery_limits import BatteryLimitError, BatteryLimits, BatteryLoad, measure_battery
from service.domain.errors import BadInputError


def check_tree_battery(archive: bytes, *, name: str, origin: str, limits: BatteryLimits,
                       archive_limits: ArchiveLimits) -> BatteryLoad:
    """What the tree's battery file `name` declares, or BadInputError when it is over the byte limit,
    not JSON, or past a limit of the run's kind. `origin` says where the name came from."""
    try:
        text, _ = root_file_and_names(archive, name, archive_limits, max_bytes=limits.max_battery_bytes)
    except ArchiveError as exc:  # the file alone is over the byte limit: nothing of it was read
        raise BadInputError(f"{origin} {name[:120]!r}: {exc} in a {limits.kind} run "
                            f"({limits.setting('max_battery_bytes')})") from exc
    try:
        raw = json.loads(text or "")
    except ValueError as exc:
        raise BadInputError(f"{origin} {name[:120]!r} is not valid JSON ({str(exc)[:200]}): a battery file is "
                            "a JSON object (see docs/PROJECTS.md)") from exc
    try:
        return measure_battery(raw, battery=name, limits=limits)
    except BatteryLimitError as exc:
        raise BadInputError(str(exc)) from exc
