"""Bounded answers for what grows with a run's case count (docs/security/SERVICE.md "Bounded batteries").

A run's verdict stores one entry per case, and a run stores one trajectory row per case. An answer that
carried them all grew with the battery: a 64,800-case verify run made a 79 MB run page that took 12 s
of the API per anonymous request. Every answer now carries at most one page of them, says the total,
and names where the rest are:

- GET /runs/{id} (and every answer that embeds a verdict): the verdict's `detail.cases` holds at most
  VERDICT_CASES_SHOWN cases (those that matter first: broken, changed, nondeterministic, new,
  not applicable, then unchanged; stored order within each), with `cases_total` and `cases_url`;
- GET /runs/{id}/cases: every case comparison, `limit`/`offset` pages in stored order;
- GET /runs/{id}/trajectories and trajectories.csv: `limit`/`offset` pages of cases;
- GET /projects/{p}/verdicts: `limit`/`offset` pages of verdicts with `count`.

A page's own size is bounded by its limit times what one case may hold (its steps: the battery limits,
service/core/battery_limits.py), never by the number of cases.
"""

from __future__ import annotations

from typing import Any

# Cases a verdict embedded in another answer shows; the rest are under cases_url.
VERDICT_CASES_SHOWN = 50
# GET /runs/{id}/cases
CASES_PAGE_DEFAULT, CASES_PAGE_MAX = 100, 500
# GET /runs/{id}/trajectories (each row holds every step's series) and trajectories.csv
TRAJECTORIES_PAGE_DEFAULT, TRAJECTORIES_PAGE_MAX = 50, 200

# The order in which cases earn a place on a bounded page: what a reader acts on first.
_SHOWN_FIRST = ("broken", "changed", "nondeterministic", "new", "not_applicable", "unchanged")


def cases_url(run_id: int) -> str:
    return f"/api/v1/runs/{run_id}/cases"


def cases_shown_first(cases: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    """At most `limit` of `cases`: all of them, as stored, when they fit; else those that matter
    first (broken, changed, ...), each kind in stored order."""
    if len(cases) <= limit:
        return cases
    rank = {name: index for index, name in enumerate(_SHOWN_FIRST)}
    ordered = sorted(range(len(cases)), key=lambda i: (rank.get(cases[i].get("verdict"), len(rank)), i))
    return [cases[i] for i in ordered[:limit]]


def detail_for_cases(detail: dict[str, Any], shown: list[dict[str, Any]]) -> dict[str, Any]:
    """The verdict's stored detail with only the `shown` cases, and the attribution of those alone (its
    `error`, when the attribution failed, kept): a client still tells 'not attributed yet' (no key)
    from 'attributed' (the key, maybe empty on this page)."""
    trimmed = {**detail, "cases": shown}
    stored = detail.get("attribution")
    if isinstance(stored, dict):
        ids = {case.get("case_id") for case in shown}
        trimmed["attribution"] = {key: value for key, value in stored.items() if key == "error" or key in ids}
    return trimmed
