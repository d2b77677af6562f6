"""A run's outcomes, in one table: what each one is called, whether it is a finding, the command's
exit code, the GitHub check's conclusion and title, the dashboard's badge and filter, and which
sentence the run page says it with. Every surface reads it (the command, `optdrift check`, the
GitHub notifier, the dashboard, the API's stored verdict); none keeps its own table.

Pure data: the standard library only (the import contract in pyproject.toml says so), so the
client install, the kernel box and the Action's output helper may all read it.

A new outcome touches this table, the code that decides it (service/core/verdicts.py
compare_runs), its sentence on the run page (the builder named by `page_sentence`, in
service/dashboard/wording.py) and its badge's colour (service/dashboard/static/dashboard.css,
`.badge-<badge_class>`). tests/service/core/test_outcomes.py holds the rest to this table.

The names are stored (Verdict.outcome, the API's `outcome`, the Action's `verdict` output): never
rename one.
"""

from __future__ import annotations

from dataclasses import dataclass

# ----------------------------------------------------------------------------- exit codes
# The exit codes of the verdict commands (`submit --wait`, `verify`, `retry --wait`, `check`,
# `compare`). service/cli/exit_codes.py names them for the command's modules.
EXIT_OK = 0               # unchanged, a change a maintainer acknowledged, or an allowed no-baseline
EXIT_CHANGED = 1          # a trajectory changed
EXIT_USAGE = 2            # bad input or usage: an option, a file, a folder, a 4xx from the service
EXIT_BROKEN = 3           # the commit's fault: it does not build, its kernels crash, hang or go NaN
EXIT_OPTDRIFT_ERROR = 4   # optdrift's fault: service unreachable, 5xx, a run in status `error`
EXIT_NONDETERMINISTIC = 5  # a kernel does not reproduce itself on the same build
# Nothing to compare with: no commit on the first-parent line has a finished run in the environment
# (issue 44: never a silent pass). `submit --allow-no-baseline` (a project's first commit) makes it 0.
EXIT_NO_BASELINE = 7  # not 6: `optdrift speed --fail-on-slowdown` says "slower" with 6
# The tree refuses this environment's toolchain ("CUDA Version > 12 is not supported" in its CMake):
# nothing was checked, and neither the commit (3) nor optdrift (4) failed (issue 47;
# service/core/not_buildable.py, worker/build/refusal.py). A run status, not an outcome: the run
# has no verdict.
EXIT_NOT_BUILDABLE = 8

# GitHub's check-run conclusions this project gives (GitHub has more: skipped, timed_out, stale).
SUCCESS, NEUTRAL, FAILURE, ACTION_REQUIRED, CANCELLED = (
    "success", "neutral", "failure", "action_required", "cancelled")


@dataclass(frozen=True)
class Outcome:
    """One outcome of a finished run that has a verdict.

    flagged: a finding on the commit that a maintainer may acknowledge (stored as Verdict.detail
      `flagged`; the badge says "(acknowledged)" after it).
    fails_gate: without an acknowledgement or an allowance, CI fails (exit code not 0, GitHub
      conclusion failure). no-baseline fails the gate without being a finding: nothing was checked.
    exit_code: the command's exit code for a run with this outcome, before any acknowledgement
      or allowance (`--allow-no-baseline` makes no-baseline EXIT_OK).
    acknowledged_exit_code: the exit code once a maintainer acknowledged it: only an acknowledged
      change passes; an acknowledged broken or nondeterministic run keeps its code (its GitHub
      conclusion is success all the same: service/notify/conclusions.py).
    conclusion, check_title: the GitHub check run's (service/notify/conclusions.py).
    badge_text, badge_class, badge_title: the dashboard badge's words, CSS class (`badge-<class>`)
      and tooltip; a changed badge says its direction instead (service/domain/dashboard_queries.py).
    filter_label: the overview's verdict selector's option text.
    page_sentence: the run page's sentence builder, a function of service/dashboard/wording.py.
    """

    name: str
    flagged: bool
    fails_gate: bool
    exit_code: int
    acknowledged_exit_code: int
    conclusion: str
    check_title: str
    badge_text: str
    badge_class: str
    badge_title: str
    filter_label: str
    page_sentence: str


# In precedence order: where several runs of one submission end differently, the first of these
# that any has decides the exit code; within one run, service/core/verdicts.py decides in this order
# too (a run without a baseline has no changed case, so no-baseline and changed never compete).
OUTCOMES: tuple[Outcome, ...] = (
    Outcome("broken", flagged=True, fails_gate=True, exit_code=EXIT_BROKEN,
            acknowledged_exit_code=EXIT_BROKEN, conclusion=FAILURE,
            check_title="broken: the commit does not build or its kernels fail",
            badge_text="broken", badge_class="broken", badge_title="a build failure, crash or NaN",
            filter_label="broken", page_sentence="_broken"),
    Outcome("nondeterministic", flagged=True, fails_gate=True, exit_code=EXIT_NONDETERMINISTIC,
            acknowledged_exit_code=EXIT_NONDETERMINISTIC, conclusion=FAILURE,
            check_title="nondeterministic: a kernel does not reproduce itself",
            badge_text="nondeterministic", badge_class="nondeterministic",
            badge_title="some case does not reproduce itself on the same build (and its baseline's build does, "
                        "or was not repeated)",
            filter_label="nondeterministic", page_sentence="_nondeterministic"),
    Outcome("changed", flagged=True, fails_gate=True, exit_code=EXIT_CHANGED,
            acknowledged_exit_code=EXIT_OK, conclusion=FAILURE,
            check_title="changed: a trajectory differs from the baseline's",
            badge_text="changed", badge_class="changed",
            badge_title="some trajectory changed against the baseline; direction is relative to the float64 "
                        "reference",
            filter_label="changed", page_sentence="_changed"),
    Outcome("no-baseline", flagged=False, fails_gate=True, exit_code=EXIT_NO_BASELINE,
            acknowledged_exit_code=EXIT_NO_BASELINE, conclusion=FAILURE,
            check_title="no baseline: no ancestor of this commit has a finished run here",
            badge_text="no baseline", badge_class="neutral", badge_title="nothing earlier to compare with",
            filter_label="no-baseline", page_sentence="_no_baseline"),
    Outcome("unchanged", flagged=False, fails_gate=False, exit_code=EXIT_OK,
            acknowledged_exit_code=EXIT_OK, conclusion=SUCCESS,
            check_title="unchanged: every trajectory equals the baseline's",
            badge_text="unchanged", badge_class="unchanged",
            badge_title="every per-step digest equal to the baseline's",
            filter_label="unchanged", page_sentence="_unchanged"),
)
BY_NAME: dict[str, Outcome] = {outcome.name: outcome for outcome in OUTCOMES}
NAMES: tuple[str, ...] = tuple(BY_NAME)
# The names, for the code that asks about one outcome (a stray literal elsewhere fails
# tests/service/core/test_outcomes.py).
BROKEN, NONDETERMINISTIC, CHANGED, NO_BASELINE, UNCHANGED = NAMES
FLAGGED: tuple[str, ...] = tuple(outcome.name for outcome in OUTCOMES if outcome.flagged)
# The overview's verdict selector lists the outcomes in this order (then its own run states).
FILTER_ORDER: tuple[str, ...] = ("unchanged", "changed", "broken", "nondeterministic", "no-baseline")

# The Action's `verdict` output for an exit code that an outcome gives (0 is every passing run's:
# the run says which).
OUTCOME_BY_EXIT_CODE: dict[int, str] = {outcome.exit_code: outcome.name for outcome in OUTCOMES
                                        if outcome.exit_code != EXIT_OK}

# Where several runs end differently, the exit code is the first of these that any run has: an
# incomplete answer first, then the commit's own failure, then the findings (in the outcomes'
# order), then a tree this environment cannot build, then a pass.
EXIT_PRECEDENCE: tuple[int, ...] = (
    EXIT_OPTDRIFT_ERROR,
    *(outcome.exit_code for outcome in OUTCOMES if outcome.exit_code != EXIT_OK),
    EXIT_NOT_BUILDABLE, EXIT_OK)


def outcome(name: str) -> Outcome:
    """The table's row for a stored outcome name (ValueError naming the known ones otherwise)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown run outcome {name!r}; known: {', '.join(NAMES)}") from None


def exit_code(name: str, *, acknowledged: bool = False, no_baseline_allowed: bool = False) -> int:
    """A verdict's exit code: its outcome's, unless a maintainer acknowledged the finding or the
    submission allowed a missing baseline (a project's first commit)."""
    row = outcome(name)
    if acknowledged:
        return row.acknowledged_exit_code
    if no_baseline_allowed and row.name == "no-baseline":
        return EXIT_OK
    return row.exit_code
