"""The first-parent ancestry a client sends with a commit: what the baseline walk reads
(service/domain/baselines.py). Attacker input like any form field, so it is bounded and each entry
is checked as a commit sha is (1-64 visible characters: the project's own sha format; git's are 40
or 64 hex digits)."""

from __future__ import annotations

import re

from service.domain.errors import BadInputError

# How far back the client looks: `optdrift submit` and the Action send at most this many. A
# baseline further back than this is no baseline a reviewer can reason about.
MAX_ANCESTRY = 200
SHA_FORMAT = re.compile(r"[\x21-\x7e]{1,64}")


def check_ancestry(*, sha: str, ancestry: list[str]) -> list[str]:
    """The ancestry as given (parent first), or BadInputError naming the entry that is wrong."""
    if len(ancestry) > MAX_ANCESTRY:
        raise BadInputError(f"ancestry lists {len(ancestry)} commits; send at most {MAX_ANCESTRY} (the nearest "
                            "first: `git rev-list --first-parent --max-count=200 SHA^`)")
    seen: set[str] = set()
    for position, entry in enumerate(ancestry, start=1):
        if not SHA_FORMAT.fullmatch(entry):
            raise BadInputError(f"ancestry entry {position} ({entry[:80]!r}) is not a commit sha: 1-64 visible "
                                "characters, e.g. 40 hex digits from `git rev-list`")
        if entry == sha:
            raise BadInputError(f"ancestry entry {position} is the submitted commit {sha} itself; list its "
                                "ancestors only, its first parent first")
        if entry in seen:
            raise BadInputError(f"ancestry entry {position} ({entry}) is listed twice; a first-parent line "
                                "holds each commit once")
        seen.add(entry)
    return ancestry
