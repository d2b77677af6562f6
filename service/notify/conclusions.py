"""What a run's verdict means on GitHub: the check run's conclusion and title.

GitHub's conclusions: success, neutral, failure, action_required, cancelled, skipped, timed_out
(stale is GitHub's own). A required check passes on success, neutral and skipped.

- unchanged → success: every digest equals the baseline's.
- acknowledged → success: a maintainer accepted the change; `optdrift submit --wait` exits 0 too,
  and children compare with this run.
- no-baseline → failure: no commit on this one's first-parent line (the ancestry the client sent)
  has a finished run in the environment, so nothing was checked; a gate that passed here would
  pass a PR whose base was never submitted, bug and all (issue 44). The CLI exits 7. A submission
  that allows it (`--allow-no-baseline`, Action input `allow-no-baseline: true`: a project's first
  commit) gets neutral instead, and the CLI exits 0.
- changed → failure: a trajectory moved; CI fails until someone acknowledges it (CLI exit 1).
- broken → failure: the commit does not build or its kernels crash / go NaN (CLI exit 3).
- nondeterministic → failure: the kernel does not reproduce itself; a finding to fix (CLI exit 5).
- error (run status error: optdrift's failure, not the commit's) → action_required: calling it
  failure would blame the commit, neutral would let an unchecked commit pass a required check;
  action_required blocks the merge and says a person must act (`optdrift retry RUN`, on the page
  details_url opens).
- cancelled → cancelled.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.core import outcomes
from service.core.outcomes import ACTION_REQUIRED, CANCELLED, FAILURE, NEUTRAL, SUCCESS  # noqa: F401

# The outcomes' conclusions and titles are the table's (service/core/outcomes.py); the states a
# run has beside its outcome (acknowledged, error, cancelled) are GitHub's words alone.
_BY_STATE: dict[str, tuple[str, str]] = {
    **{row.name: (row.conclusion, row.check_title) for row in outcomes.OUTCOMES},
    "acknowledged": (SUCCESS, "changed, acknowledged by a maintainer"),
    "error": (ACTION_REQUIRED, "optdrift error, not a verdict on the commit: retry the run"),
    "cancelled": (CANCELLED, "cancelled"),
}
STATES = tuple(_BY_STATE)


@dataclass(frozen=True)
class Conclusion:
    state: str
    conclusion: str
    title: str


def state_of(*, run_status: str, outcome: str | None, acknowledged: bool) -> str | None:
    """The one word a finished run is described by; None while it has no final state."""
    if run_status == "error":
        return "error"
    if run_status == "cancelled":
        return "cancelled"
    if outcome is None:
        return None
    if acknowledged:
        return "acknowledged"
    return outcome


# A no-baseline run whose submission allowed it (the first adoption): no claim either way.
NO_BASELINE_ALLOWED = (NEUTRAL, "no baseline to compare with (allowed by the submission)")


def conclusion_for(state: str, *, no_baseline_allowed: bool = False) -> Conclusion:
    if state not in _BY_STATE:
        raise ValueError(f"no GitHub conclusion for state {state!r}; known: {', '.join(STATES)}")
    conclusion, title = NO_BASELINE_ALLOWED if state == outcomes.NO_BASELINE and no_baseline_allowed else _BY_STATE[state]
    return Conclusion(state=state, conclusion=conclusion, title=title)
