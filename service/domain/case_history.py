"""One case across a project's commit history: its distance to the float64 reference per commit,
the commits where its bits changed, acknowledgements and releases (the case history page and its
JSON API).

The points follow one line of history (service/domain/commit_lines.py): the first-parent chain of
the default branch's newest commit, or of `ref` (a sha or a branch name), in that chain's order, not
in submission order. Commits off it (a side branch, a pull request's merge commit) are no points of
it, so a side branch submitted between two of main's commits is never drawn as a drop in main's
line; the history counts them and `ref` shows their own line.

A commit's point is its run's trajectory of the case in one environment (a case id names its whole
spec, so runs of different batteries that share the case agree on what it is). "Changed here"
compares that trajectory with the one of the commit it descends from: the nearest older point on
the line that ran the case, else (the line's first point) its verdict's baseline run, through
service.core.verdicts.compare_case, the comparison every verdict makes (per-step digests; direction
against the float64 reference).

One query loads the case's rows (not the verdicts' case lists, which hold every case of a battery);
verdict details are read only at change points, for the fields the verdict adds to a changed case.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import Commit, Run, Trajectory, Verdict
from service.core import attribution_view
from service.domain import commit_lines
from service.domain.bisection import DIFFERING_VERDICTS
from service.domain.dashboard_queries import get_project
from service.domain.errors import NotFoundError
from service.domain.trajectories import row_to_case_result
from service.core.results import CaseResult
from service.core.verdicts import compare_case

DEFAULT_LIMIT = 200
MAX_LIMIT = 1000
# A changed case's fields from the verdict that this page shows beside its own comparison (the
# co-run's size of the change; the change relative to the case's own scale, where recorded).
VERDICT_CASE_FIELDS_SKIPPED = {"case_id", "optimizer", "verdict", "max_abs_diff_per_step", "message",
                               "first_divergent_step", "direction"}  # the point has its own


@dataclass
class HistoryPoint:
    sha: str
    message: str | None
    ref: str | None
    release_tag: str | None
    created_at: datetime
    run_id: int
    status: str                      # the case's status in this run: ok, broken, not_applicable
    final_distance: float | None     # |p - p_float64| after the last step (max over elements)
    max_distance: float | None       # the largest of those over the steps
    compared_with: str | None = None  # the sha whose trajectory this one is compared with
    change: str | None = None        # compare_case's verdict against it: changed, unchanged, broken...
    first_divergent_step: int | None = None
    direction: str | None = None
    acknowledged: bool = False
    acknowledged_by: str | None = None
    acknowledgement_note: str | None = None
    # What the run's verdict recorded for this case at a change point (e.g. the largest
    # |commit - baseline| from the co-run, and any scale-relative figures), verbatim.
    verdict_fields: dict[str, Any] = field(default_factory=dict)
    # The change relative to the case's own scale (service/core/attribution_view.py, once the
    # co-run has attributed it): kind, ulps at the first divergent step and at the peak, the change
    # over the baseline's own distance to float64, and the line the run page shows.
    attribution: dict[str, Any] | None = None

    @property
    def change_point(self) -> bool:
        # As bisect reads a case: changed, broken or nondeterministic; not a case that did not run
        # here (not applicable) or had nothing comparable before (new).
        return self.change in DIFFERING_VERDICTS


@dataclass
class CaseHistory:
    project: str
    case_id: str
    case: dict[str, Any]
    environment: str
    environments: list[str]
    points: list[HistoryPoint]        # oldest first, along the line
    truncated: bool
    line: str = ""                    # which line the points follow, and why (commit_lines.choose_tip)
    ref: str | None = None            # the `ref` asked for, None for the default branch
    tip: str | None = None            # the line's newest commit
    branch: str | None = None         # the branch the tip was chosen by, if any
    # Commits that ran the case here but are not on this line (side branches, pull requests):
    # left out of the points, never joined into the line.
    off_line: int = 0

    @property
    def change_points(self) -> list[HistoryPoint]:
        return [p for p in self.points if p.change_point]

    @property
    def releases(self) -> list[HistoryPoint]:
        return [p for p in self.points if p.release_tag]


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _distances(result: CaseResult) -> tuple[float | None, float | None]:
    series = result.trajectory.ref64_max_abs if result.trajectory else []
    if not series:
        return None, None
    # A NaN anywhere makes the peak NaN (shown as a gap), as service.core.verdicts reads peaks.
    peak = math.nan if any(math.isnan(v) for v in series) else max(series)
    return _finite(series[-1]), _finite(peak)


def case_history(*, session: Session, project_name: str, case_id: str, environment: str | None = None,
                 limit: int = DEFAULT_LIMIT, ref: str | None = None) -> CaseHistory:
    project = get_project(session=session, name=project_name)
    base = (select(Run.environment).join(Trajectory, Trajectory.run_id == Run.id)
            .where(Run.project_id == project.id, Run.commit_id.is_not(None), Trajectory.case_id == case_id))
    environments = sorted(set(session.scalars(base.distinct())))
    if not environments:
        raise NotFoundError(f"no commit of {project_name!r} has run a case {case_id!r}; the case ids are on "
                            "a commit's page and in /api/v1/runs/{id}/trajectories")
    line = commit_lines.line_of(session=session, project=project, ref=ref)
    position = {commit.id: index for index, commit in enumerate(line.commits)}  # 0: the tip
    if environment is None:
        # The latest run of the case on the line, else anywhere (the line may not have run it).
        environment = session.scalar(base.where(Run.commit_id.in_(list(position)))
                                     .order_by(Run.created_at.desc(), Run.id.desc()).limit(1)) \
            or session.scalar(base.order_by(Run.created_at.desc(), Run.id.desc()).limit(1))
    elif environment not in environments:
        raise NotFoundError(f"case {case_id!r} has no run in environment {environment!r}; it ran in "
                            f"{', '.join(environments)}")
    of_case = (Commit.project_id == project.id, Run.environment == environment, Trajectory.case_id == case_id)
    rows = session.execute(
        select(Commit, Run.id, Trajectory)
        .join(Run, Run.commit_id == Commit.id).join(Trajectory, Trajectory.run_id == Run.id)
        .where(*of_case, Commit.id.in_(list(position))).order_by(Run.id)
    ).all() if position else []
    off_line = session.scalar(
        select(func.count(func.distinct(Commit.id))).join(Run, Run.commit_id == Commit.id)
        .join(Trajectory, Trajectory.run_id == Run.id).where(*of_case, Commit.id.not_in(list(position)))) or 0
    # One point per commit of the line (its first run holding the case), in the line's order.
    by_sha: dict[str, tuple[Commit, int, CaseResult]] = {}
    for commit, run_id, row in rows:
        if commit.sha not in by_sha:
            by_sha[commit.sha] = (commit, run_id, row_to_case_result(row))
    on_line = sorted(by_sha.values(), key=lambda found: position[found[0].id], reverse=True)  # oldest first
    truncated = len(on_line) > limit or line.truncated
    first_kept = max(0, len(on_line) - limit)
    kept = on_line[first_kept:]
    verdicts = _verdicts(session, [run_id for _, run_id, _ in kept])
    points = []
    for index, (commit, run_id, result) in enumerate(kept, start=first_kept):
        final, peak = _distances(result)
        point = HistoryPoint(sha=commit.sha, message=commit.message, ref=commit.ref,
                             release_tag=commit.release_tag, created_at=commit.created_at, run_id=run_id,
                             status=result.status, final_distance=final, max_distance=peak)
        verdict = verdicts.get(run_id)
        reference = _reference(session, on_line[:index], verdict, case_id)
        if reference is not None:
            point.compared_with, reference_result = reference
            comparison = compare_case(result, reference_result)
            point.change, point.first_divergent_step, point.direction = (
                comparison.verdict, comparison.first_divergent_step, comparison.direction)
        if verdict is not None and verdict.acknowledged:
            point.acknowledged, point.acknowledged_by, point.acknowledgement_note = (
                True, verdict.acknowledged_by, verdict.acknowledgement_note)
        if point.change_point and verdict is not None:
            point.verdict_fields, point.attribution = _verdict_case_fields(session, verdict.id, case_id)
        points.append(point)
    spec = kept[-1][2].case.model_dump(mode="json") if kept else session.scalar(
        select(Trajectory.case).where(Trajectory.case_id == case_id, Trajectory.run_id.in_(
            select(Run.id).where(Run.project_id == project.id))).limit(1)) or {}
    return CaseHistory(project=project.name, case_id=case_id, case=spec, environment=environment,
                       environments=environments, points=points, truncated=truncated, line=line.chosen_by,
                       ref=ref, tip=line.tip.sha if line.tip else None, branch=line.branch,
                       off_line=off_line)


def _verdicts(session: Session, run_ids: list[int]) -> dict[int, Verdict]:
    if not run_ids:
        return {}
    # Without `detail` (every case of the battery): only the columns a point shows.
    rows = session.execute(
        select(Verdict.id, Verdict.run_id, Verdict.baseline_run_id, Verdict.acknowledged,
               Verdict.acknowledged_by, Verdict.acknowledgement_note).where(Verdict.run_id.in_(run_ids))
    ).all()
    return {row.run_id: row for row in rows}


def _reference(session: Session, older: list[tuple[Commit, int, CaseResult]], verdict,  # noqa: ANN001
               case_id: str) -> tuple[str, CaseResult] | None:
    """(sha, result) of the trajectory a point's is compared with: the nearest older point on the
    line whose run ran the case (not one that set it aside), else the verdict's baseline run's;
    None when neither exists (the project's first commit)."""
    for ancestor, _, result in reversed(older):
        if result.status != "not_applicable":
            return ancestor.sha, result
    if verdict is None or verdict.baseline_run_id is None:
        return None
    row = session.execute(
        select(Commit.sha, Trajectory).join(Run, Run.commit_id == Commit.id)
        .join(Trajectory, Trajectory.run_id == Run.id)
        .where(Run.id == verdict.baseline_run_id, Trajectory.case_id == case_id)
    ).first()
    return None if row is None else (row[0], row_to_case_result(row[1]))


def _verdict_case_fields(session: Session, verdict_id: int,
                         case_id: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The verdict's record of the case (its comparison's fields, the largest co-run |Δ|) and its
    attribution, if any."""
    detail = session.scalar(select(Verdict.detail).where(Verdict.id == verdict_id)) or {}
    fields: dict[str, Any] = {}
    for case in detail.get("cases", []):
        if case.get("case_id") == case_id:
            fields = {k: v for k, v in case.items() if k not in VERDICT_CASE_FIELDS_SKIPPED and v is not None}
            diffs = case.get("max_abs_diff_per_step")
            if diffs:
                fields["max_abs_diff"] = max(float(v) for v in diffs)
            break
    found = attribution_view.by_case(detail).get(case_id)
    attribution = None if found is None else {
        "kind": found.kind, "text": found.text, "first_step_ulps": found.first_step_ulps,
        "peak_ulps": found.peak_ulps, "change_vs_baseline_distance": found.change_vs_baseline_distance}
    return fields, attribution


def as_json(history: CaseHistory) -> dict[str, Any]:
    """JSON for the API and the page's chart: NaN and infinities as null (JSON has neither)."""
    def clean(value: Any) -> Any:  # noqa: ANN401
        if isinstance(value, float):
            return _finite(value)
        if isinstance(value, datetime):
            return value.isoformat()
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    points = [{**asdict(p), "change_point": p.change_point} for p in history.points]
    return clean({"project": history.project, "case_id": history.case_id, "case": history.case,
                  "environment": history.environment, "environments": history.environments,
                  "line": history.line, "ref": history.ref, "tip": history.tip, "branch": history.branch,
                  "off_line": history.off_line, "truncated": history.truncated, "points": points,
                  "change_points": [p.sha for p in history.change_points],
                  "releases": [{"tag": p.release_tag, "sha": p.sha} for p in history.releases]})
