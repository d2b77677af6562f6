"""Read-only queries behind the dashboard pages.

They select only the columns a page shows: a verdict's `detail` holds every case of a battery
(hundreds), and a trajectory's `series_data` every step, so the overview never loads either, and
the commit page loads series only for the one case it plots first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session

from service.core import attribution_view, outcomes
from service.core.results import ComparisonFigures
from service.core.not_buildable import refusal_in
from service.core.verdicts import figures, figures_of
from service.db.models import ERROR, FINAL_STATUSES, Commit, Project, Run, Trajectory, Verdict
from service.domain import commit_lines
from service.domain.errors import BadInputError, NotFoundError
from service.domain.trajectories import unpack_series

# Filter values of the overview's verdict selector. "running" = queued, building or running;
# "error" = runs that optdrift failed to do (status error: no verdict on the commit).
VERDICT_FILTERS = (*outcomes.FILTER_ORDER, "running", "error", "flagged")
PAGE_SIZE = 50

@dataclass(frozen=True)
class Badge:
    """What a verdict badge says (in words: colour only repeats it) and its CSS class."""

    text: str
    css: str
    title: str = ""


def badge(*, status: str, outcome: str | None, directions: Mapping[str, int] | None = None,
          acknowledged: bool = False, cases_done: int | None = None, cases_total: int | None = None,
          error: str | None = None) -> Badge:
    """`directions`: a changed verdict's cases per direction (its figures.directions); `error`: the
    run's, where known (a tree that refuses the toolchain is not broken: service/core/not_buildable.py)."""
    if outcome is None:
        if status == "failed" and refusal_in(error):
            return NOT_BUILDABLE_BADGE
        return _pending_badge(status, cases_done, cases_total)
    row = outcomes.BY_NAME.get(outcome, outcomes.BY_NAME["unchanged"])  # as before the table: unknown reads unchanged
    if row.name == "changed":  # says its direction (its own classes, changed-farther ...)
        return _changed_badge(directions or {}, acknowledged, row)
    suffix = " (acknowledged)" if acknowledged and row.flagged else ""
    return Badge(row.badge_text + suffix, row.badge_class, row.badge_title)


NOT_BUILDABLE_BADGE = Badge("not buildable here", "neutral", "this tree refuses this worker's toolchain: nothing "
                                                              "was checked (exit 8), the tree is not broken")
_PENDING_BADGES = {
    "failed": Badge("broken", "broken", "the run failed"),
    "error": Badge("optdrift error", "error", "optdrift could not run this commit (fetch, worker, database, "
                                              "disk or sandbox): not the commit's fault"),
    "cancelled": Badge("cancelled", "neutral", "the run was cancelled"),
}


def _pending_badge(status: str, cases_done: int | None, cases_total: int | None) -> Badge:
    """A run without a verdict: still going, failed, optdrift's error, cancelled, or waiting for its baseline."""
    if status in ("queued", "building", "running"):
        progress = f" {cases_done}/{cases_total}" if status == "running" and cases_total else ""
        return Badge(f"{status}{progress}", "running", "the run has not finished")
    return _PENDING_BADGES.get(status) or Badge("awaiting baseline", "neutral",
                                                "finished; the verdict waits for its baseline run")


def _changed_badge(directions: Mapping[str, int], acknowledged: bool, row: outcomes.Outcome) -> Badge:
    closer, farther = directions.get("closer", 0), directions.get("farther", 0)
    if farther and closer:
        text, css = f"changed → mixed: {farther} farther, {closer} closer", "changed-farther"
    elif farther:
        text, css = "changed → farther", "changed-farther"
    elif closer:
        text, css = "changed → closer", "changed-closer"
    else:
        text, css = "changed → same distance", "changed-same"
    if acknowledged:
        text, css = text + " (acknowledged)", "acknowledged"
    return Badge(text, css, row.badge_title)


# ----------------------------------------------------------------------------- overview
@dataclass
class OverviewRow:
    sha: str
    message: str | None
    ref: str | None
    release_tag: str | None
    created_at: datetime
    run_id: int | None
    environment: str | None
    status: str | None
    badge: Badge
    changed_cases: int | None
    first_divergent_step: int | None
    # Shown beside the badge, never in it: cases set aside (not applicable) and, when the verdict
    # itself is not nondeterministic (a broken run can have them too), cases that do not reproduce.
    side_notes: list[Badge] = field(default_factory=list)


def side_notes(*, outcome: str | None, not_applicable: int | None, nondeterministic: int | None) -> list[Badge]:
    notes = []
    if nondeterministic and outcome != outcomes.NONDETERMINISTIC:
        # The cases' count, in the nondeterministic outcome's colour.
        notes.append(Badge(f"{nondeterministic} nondeterministic", outcomes.BY_NAME[outcomes.NONDETERMINISTIC].badge_class,
                           "cases whose repeats on the same build differ; not part of the verdict"))
    if not_applicable:
        notes.append(Badge(f"{not_applicable} not applicable", "not-applicable",
                           "cases the adapter cannot run on this device; set aside, not part of the verdict"))
    return notes


@dataclass
class PullRequestGroup:
    """A pull request's submitted merge commits (refs/pull/N/merge), newest first: never a step of
    the default branch's line, so listed under their pull request."""

    number: int
    rows: list[OverviewRow]


@dataclass
class Overview:
    project: Project
    rows: list[OverviewRow]         # the line's commits (service/domain/commit_lines.py), newest first
    total: int
    page: int
    pages: int
    refs: list[str]                 # branch names commits were submitted under (pull requests' aside)
    ref: str | None
    verdict: str | None
    line: str = ""                  # which line `rows` follows, and why
    line_truncated: bool = False
    # Commits neither on the line nor a pull request's (another branch, a line whose parent was
    # never submitted), newest first, at most OFF_LINE_ROWS; off_line_total counts them all.
    off_line: list[OverviewRow] = field(default_factory=list)
    off_line_total: int = 0
    pull_requests: list[PullRequestGroup] = field(default_factory=list)
    pull_request_total: int = 0


# Rows of the overview's sections below the line (first page only): the newest, the rest counted.
OFF_LINE_ROWS = 50
PULL_REQUEST_ROWS = 50


def get_project(*, session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise NotFoundError(f"no project named {name!r}; see / for the list of projects")
    return project


def list_projects(*, session: Session) -> list[tuple[Project, int]]:
    counts = (select(Commit.project_id, func.count().label("n")).group_by(Commit.project_id).subquery())
    rows = session.execute(
        select(Project, func.coalesce(counts.c.n, 0)).outerjoin(counts, counts.c.project_id == Project.id)
        .order_by(Project.name)
    ).all()
    return [(project, count) for project, count in rows]


def overview(*, session: Session, project_name: str, ref: str | None = None, verdict: str | None = None,
             page: int = 1, page_size: int = PAGE_SIZE) -> Overview:
    """A project's commits with the verdict of their runs (one row per commit and environment run):
    the default branch's first-parent line (or `ref`'s: a sha or a branch name) newest first, then
    (first page) the commits off it and the pull requests' merge commits, grouped by pull request."""
    if verdict and verdict not in VERDICT_FILTERS:
        raise BadInputError(f"unknown verdict filter {verdict!r}; use one of {', '.join(VERDICT_FILTERS)}")
    if page < 1:
        raise BadInputError(f"page {page} does not exist; pages start at 1")
    project = get_project(session=session, name=project_name)
    line = commit_lines.line_of(session=session, project=project, ref=ref)
    position = {commit.id: index for index, commit in enumerate(line.commits)}
    query = _filtered(_overview_query(project), verdict)
    on_line = session.execute(query.where(Commit.id.in_(list(position)))).all() if position else []
    # The line's order, not submission order: a side branch submitted between two of its commits
    # is not between them here.
    on_line.sort(key=lambda row: (position[row.commit_id], row.run_id or 0))
    total = len(on_line)
    shown = on_line[(page - 1) * page_size:page * page_size]
    off_line, off_line_total, groups, pull_total = [], 0, [], 0
    if page == 1:
        newest_first = (Commit.created_at.desc(), Commit.id.desc(), Run.id)
        off = query.where(Commit.id.not_in(list(position)),
                          or_(Commit.ref.is_(None), ~commit_lines.pull_request_filter()))
        off_line_total = session.scalar(select(func.count()).select_from(off.subquery())) or 0
        off_line = _overview_rows(session, session.execute(off.order_by(*newest_first).limit(OFF_LINE_ROWS)).all())
        pulls = query.where(commit_lines.pull_request_filter())
        pull_total = session.scalar(select(func.count()).select_from(pulls.subquery())) or 0
        by_number: dict[int, PullRequestGroup] = {}
        for row in _overview_rows(session, session.execute(
                pulls.order_by(*newest_first).limit(PULL_REQUEST_ROWS)).all()):
            number = commit_lines.pull_request_number(row.ref)
            by_number.setdefault(number, PullRequestGroup(number=number, rows=[])).rows.append(row)
        groups = list(by_number.values())  # the pull request with the newest commit first
    refs = [r for r in session.scalars(
        select(Commit.ref).where(Commit.project_id == project.id, Commit.ref.is_not(None), Commit.ref != "",
                                 ~commit_lines.pull_request_filter())
        .distinct().order_by(Commit.ref)).all()]
    pages = max(1, -(-total // page_size))
    return Overview(project=project, rows=_overview_rows(session, shown), total=total, page=page, pages=pages,
                    refs=refs, ref=ref, verdict=verdict, line=line.chosen_by, line_truncated=line.truncated,
                    off_line=off_line, off_line_total=off_line_total, pull_requests=groups,
                    pull_request_total=pull_total)


def _overview_query(project: Project):  # noqa: ANN202
    # Two numbers from the verdict's counts, not its case list (hundreds of cases).
    not_applicable = Verdict.detail["counts"]["not_applicable"].as_integer()
    nondeterministic = Verdict.detail["counts"]["nondeterministic"].as_integer()
    return (
        select(Commit.sha, Commit.message, Commit.ref, Commit.release_tag, Commit.created_at,
               Commit.id.label("commit_id"), Run.id.label("run_id"), Run.environment, Run.status, Run.cases_done,
               Run.cases_total, Verdict.outcome, Verdict.acknowledged, Verdict.changed_cases,
               Verdict.first_divergent_step, Verdict.flagged, not_applicable, nondeterministic)
        .outerjoin(Run, Run.commit_id == Commit.id)
        .outerjoin(Verdict, Verdict.run_id == Run.id)
        .where(Commit.project_id == project.id)
    )


def _filtered(query, verdict: str | None):  # noqa: ANN001, ANN202
    if verdict == "running":
        return query.where(Run.status.not_in(FINAL_STATUSES))
    if verdict == "error":
        return query.where(Run.status == ERROR)
    if verdict == "flagged":
        return query.where(Verdict.flagged.is_(True))
    if verdict:
        return query.where(Verdict.outcome == verdict)
    return query


def _overview_rows(session: Session, rows: list) -> list[OverviewRow]:
    directions = _direction_counts(session, [row[6] for row in rows if row[11] == "changed"])
    out = []
    for (sha, message, commit_ref, release_tag, created_at, _cid, run_id, environment, status, done, total_cases,
         outcome, acknowledged, changed_cases, first_step, _flagged, n_not_applicable, n_nondeterministic) in rows:
        out.append(OverviewRow(
            sha=sha, message=message, ref=commit_ref, release_tag=release_tag, created_at=created_at,
            run_id=run_id, environment=environment, status=status,
            badge=badge(status=status or "queued", outcome=outcome, directions=directions.get(run_id),
                        acknowledged=bool(acknowledged), cases_done=done, cases_total=total_cases)
            if run_id is not None else Badge("no run", "neutral"),
            changed_cases=changed_cases, first_divergent_step=first_step,
            side_notes=side_notes(outcome=outcome, not_applicable=n_not_applicable,
                                  nondeterministic=n_nondeterministic),
        ))
    return out


def _direction_counts(session: Session, run_ids: list[int]) -> dict[int, dict[str, int]]:
    """run id -> its verdict's changed cases per direction: the stored figures' field, or for verdicts
    stored before the figures were, counted from their stored cases (only those rows load them)."""
    if not run_ids:
        return {}
    stored = dict(session.execute(
        select(Verdict.run_id, Verdict.detail["figures"]["directions"]).where(Verdict.run_id.in_(run_ids))).all())
    older = [run_id for run_id in run_ids if not stored.get(run_id)]
    if older:
        for run_id, cases in session.execute(
                select(Verdict.run_id, Verdict.detail["cases"]).where(Verdict.run_id.in_(older))).all():
            stored[run_id] = figures(cases or []).directions
    return stored


# ----------------------------------------------------------------------------- run / commit page
@dataclass
class ChangedCase:
    case_id: str
    verdict: str
    optimizer: str
    family: str | None
    dtype: str | None
    lr: float | None
    weight_decay: float | None
    seed: int | None
    gradient: str | None
    first_divergent_step: int | None
    max_abs_diff: float | None
    commit_final: float | None
    baseline_final: float | None
    direction: str | None
    message: str | None
    # The final-step judgement and the peak distances over the differing steps (the direction's
    # evidence); final_direction is shown where it disagrees with direction.
    final_direction: str | None = None
    commit_peak: float | None = None
    baseline_peak: float | None = None


@dataclass
class SetAsideCase:
    """A case listed apart from the verdict: not applicable (with the adapter's reason) or
    nondeterministic (with the repeat figures)."""

    case_id: str
    optimizer: str
    dtype: str | None
    family: str | None
    reason: str | None = None
    runs: int | None = None
    differing: int | None = None
    first_divergent_step: int | None = None
    # A nondeterministic case's blame (docs/ENGINE.md, Nondeterminism): introduced | pre-existing | None.
    nondeterminism: str | None = None


@dataclass
class RunPage:
    run: Run
    commit: Commit | None
    base_commit: Commit | None
    baseline_run: Run | None
    baseline_commit_sha: str | None
    verdict: Verdict | None
    badge: Badge
    summary: str
    changed: list[ChangedCase]
    counts: dict[str, int]
    figures: ComparisonFigures
    sibling_runs: list[tuple[int, str, str]] = field(default_factory=list)
    not_applicable: list[SetAsideCase] = field(default_factory=list)
    nondeterministic: list[SetAsideCase] = field(default_factory=list)
    side_notes: list[Badge] = field(default_factory=list)
    # The case tables show one page each (RUN_PAGE_CASES rows, `cases_page`); the totals say how many.
    cases_page: int = 1
    cases_per_page: int = 0
    changed_total: int = 0
    not_applicable_total: int = 0
    nondeterministic_total: int = 0

    @property
    def more_cases(self) -> bool:
        """Some table has rows past this page."""
        last_shown = self.cases_page * self.cases_per_page
        return max(self.changed_total, self.not_applicable_total, self.nondeterministic_total) > last_shown


# Rows per case table of a run page: the page's size never grows with the run's case count
# (docs/security/SERVICE.md "Bounded batteries"; the rest are a link away, and under /api/v1/runs/{id}/cases).
RUN_PAGE_CASES = 100


def _gradient_label(spec: dict[str, Any]) -> str:
    gradient = spec.get("gradient") or {}
    label = gradient.get("kind", "open")
    if gradient.get("zero_fraction"):
        label += f", {gradient['zero_fraction']:g} zeros"
    return label


def run_page(*, session: Session, run_id: int, cases_page: int = 1, cases_per_page: int | None = None) -> RunPage:
    """A run's page, its case tables showing page `cases_page` of `cases_per_page` rows (default
    RUN_PAGE_CASES; changed cases largest relative change first, as the page reads; set-aside cases
    in stored order)."""
    cases_per_page = cases_per_page or RUN_PAGE_CASES
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError(f"no run with id {run_id}")
    verdict = session.scalar(select(Verdict).where(Verdict.run_id == run_id))
    detail = verdict.detail if verdict is not None else {}
    all_changed = [c for c in detail.get("cases", []) if c.get("verdict") in ("changed", "broken")]
    all_set_aside = {kind: [c for c in detail.get("cases", []) if c.get("verdict") == kind]
                     for kind in ("not_applicable", "nondeterministic")}
    # Order before paging, so page 1 leads with what matters and pages do not overlap.
    rows = [_CaseRow(c["case_id"], c) for c in all_changed]
    attribution_view.order_by_relative_change(rows, detail)
    first = (cases_page - 1) * cases_per_page
    cases = [row.case for row in rows[first:first + cases_per_page]]
    set_aside = [c for kind in all_set_aside.values() for c in kind[first:first + cases_per_page]]
    wanted = [c["case_id"] for c in cases + set_aside]
    specs = dict(session.execute(
        select(Trajectory.case_id, Trajectory.case)
        .where(Trajectory.run_id == run_id, Trajectory.case_id.in_(wanted))
    ).all()) if wanted else {}
    changed = []
    for case in cases:
        spec = specs.get(case["case_id"], {})
        hyper = spec.get("hyper", {})
        diffs = case.get("max_abs_diff_per_step")
        changed.append(ChangedCase(
            case_id=case["case_id"], verdict=case["verdict"], optimizer=case["optimizer"],
            family=spec.get("family"), dtype=spec.get("param_dtype"), lr=hyper.get("lr"),
            weight_decay=hyper.get("weight_decay"), seed=spec.get("seed"),
            gradient=_gradient_label(spec) if spec else None,
            first_divergent_step=case.get("first_divergent_step"),
            max_abs_diff=max(float(v) for v in diffs) if diffs else None,
            commit_final=case.get("commit_final_ref64_distance"),
            baseline_final=case.get("baseline_final_ref64_distance"),
            direction=case.get("direction"), message=case.get("message"),
            final_direction=case.get("final_direction"), commit_peak=case.get("commit_peak_ref64_distance"),
            baseline_peak=case.get("baseline_peak_ref64_distance"),
        ))
    aside: dict[str, list[SetAsideCase]] = {"not_applicable": [], "nondeterministic": []}
    for case in set_aside:
        spec = specs.get(case["case_id"], {})
        repeats = case.get("repeat_check") or {}
        aside[case["verdict"]].append(SetAsideCase(
            case_id=case["case_id"], optimizer=case["optimizer"], dtype=spec.get("param_dtype"),
            family=spec.get("family"), reason=case.get("message"), runs=repeats.get("runs"),
            differing=repeats.get("differing"), first_divergent_step=repeats.get("first_divergent_step"),
            nondeterminism=case.get("nondeterminism")))
    counts = detail.get("counts", {})
    figured = figures_of(detail)
    baseline_run = session.get(Run, verdict.baseline_run_id) if verdict and verdict.baseline_run_id else None
    siblings = []
    if run.commit_id is not None:
        # Each named by the battery that ran (the tree's optdrift.toml may name its own).
        siblings = [(rid, env, (detail or {}).get("battery") or battery) for rid, env, battery, detail in session.execute(
            select(Run.id, Run.environment, Run.battery, Run.environment_detail)
            .where(Run.commit_id == run.commit_id).order_by(Run.id))]
    return RunPage(
        run=run, commit=run.commit, base_commit=run.base_commit, baseline_run=baseline_run,
        baseline_commit_sha=baseline_run.commit.sha if baseline_run and baseline_run.commit else None,
        verdict=verdict,
        badge=badge(status=run.status, outcome=verdict.outcome if verdict else None,
                    directions=figured.directions, acknowledged=bool(verdict and verdict.acknowledged),
                    cases_done=run.cases_done, cases_total=run.cases_total, error=run.error),
        summary=detail.get("summary") or run.error or "", changed=changed,
        counts=counts, figures=figured, sibling_runs=siblings, not_applicable=aside["not_applicable"],
        nondeterministic=aside["nondeterministic"],
        side_notes=side_notes(outcome=verdict.outcome if verdict else None,
                              not_applicable=counts.get("not_applicable"),
                              nondeterministic=counts.get("nondeterministic")),
        cases_page=cases_page, cases_per_page=cases_per_page, changed_total=len(all_changed),
        not_applicable_total=len(all_set_aside["not_applicable"]),
        nondeterministic_total=len(all_set_aside["nondeterministic"]),
    )


@dataclass(frozen=True)
class _CaseRow:
    """A stored case as attribution_view.order_by_relative_change sorts rows (by .case_id)."""

    case_id: str
    case: dict[str, Any]


def commit_run_id(*, session: Session, project_name: str, sha: str, run_id: int | None = None) -> int:
    """The run a commit page shows: the asked-for run of that commit, else its first."""
    project = get_project(session=session, name=project_name)
    commit = session.scalar(select(Commit).where(Commit.project_id == project.id, Commit.sha == sha))
    if commit is None:
        raise NotFoundError(f"project {project_name} has no commit {sha!r}")
    ids = list(session.scalars(select(Run.id).where(Run.commit_id == commit.id).order_by(Run.id)))
    if not ids:
        raise NotFoundError(f"commit {sha} has no run yet")
    if run_id is not None:
        if run_id not in ids:
            raise NotFoundError(f"run {run_id} is not a run of commit {sha}")
        return run_id
    return ids[0]


def baseline_run_of(*, session: Session, run_id: int) -> int | None:
    """The run `run_id`'s verdict compared against, or None (no verdict yet, or no baseline)."""
    return session.scalar(select(Verdict.baseline_run_id).where(Verdict.run_id == run_id))


def reference_distances(*, session: Session, run_id: int, baseline_run_id: int,
                        case_id: str) -> tuple[list[float], list[float]] | None:
    """One case's per-step max |parameters − float64 reference| in the run and in its baseline,
    read in one query of the two trajectory rows (no verdict detail: the commit page asks this for
    each case it draws before the co-run's diffs exist); None when either run lacks the series."""
    rows = session.execute(select(Trajectory.run_id, Trajectory.series_layout, Trajectory.series_data).where(
        Trajectory.run_id.in_((run_id, baseline_run_id)), Trajectory.case_id == case_id)).all()
    series = {row.run_id: unpack_series(row.series_layout, row.series_data).get("ref64_max_abs") for row in rows}
    ours, theirs = series.get(run_id), series.get(baseline_run_id)
    return None if ours is None or theirs is None else (ours, theirs)


def case_series(*, session: Session, run_id: int, case_id: str) -> dict[str, Any]:
    """Per-step series of one case for the commit's run and, when the verdict has one, its
    baseline run; plus the co-run |commit - baseline| when the verdict carries it."""
    row = session.scalar(select(Trajectory).where(Trajectory.run_id == run_id, Trajectory.case_id == case_id))
    if row is None:
        raise NotFoundError(f"run {run_id} has no case {case_id!r}")
    out: dict[str, Any] = {"run_id": run_id, "case_id": case_id, "case": row.case, "status": row.status,
                           "commit": unpack_series(row.series_layout, row.series_data),
                           "baseline": None, "baseline_run_id": None, "max_abs_diff_per_step": None}
    verdict = session.execute(
        select(Verdict.baseline_run_id).where(Verdict.run_id == run_id)).first()
    baseline_run_id = verdict[0] if verdict else None
    if baseline_run_id is not None:
        base = session.scalar(select(Trajectory).where(Trajectory.run_id == baseline_run_id,
                                                       Trajectory.case_id == case_id))
        if base is not None:
            out["baseline"] = unpack_series(base.series_layout, base.series_data)
            out["baseline_run_id"] = baseline_run_id
        # The co-run difference, when the worker recorded one, sits in the verdict's case detail.
        cases = session.scalar(select(Verdict.detail).where(Verdict.run_id == run_id)).get("cases", [])
        for case in cases:
            if case.get("case_id") == case_id:
                out["max_abs_diff_per_step"] = case.get("max_abs_diff_per_step")
                out["first_divergent_step"] = case.get("first_divergent_step")
                break
    return out

