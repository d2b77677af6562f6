"""Environments × releases for one project: where did which toolchain move the trajectories?

Rows are the project's releases (newest first), columns its environments other than the reference
one (the first registered, or the one asked for); a cell is that release as the column's
environment ran it, judged against the reference environment's run of it
(service/domain/environment_compare.py): unchanged, or how many cases changed, from which step,
and how many moved farther from / closer to float64. A cell without both runs done says which is
missing, so a reader knows to run the upgrade check (`optdrift compare --run`).
"""

from __future__ import annotations

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.wording import headline_kind, looks_like_headline
from service.db.models import Commit, Project
from service.domain import environment_attribution, environment_compare
from service.domain.errors import BadInputError, ConflictError, NotFoundError

MAX_RELEASES = 20


class MatrixCell(BaseModel):
    environment: str
    state: str = Field(description="unchanged, changed, broken, nondeterministic, or missing (no finished run to "
                                   "compare)")
    changed: int = 0
    first_step: int | None = None
    farther: int = 0
    closer: int = 0
    # With farther and closer these add up to `changed`: "same" moved no distance either way, "not
    # judged" has no direction (its references changed, or the figures it is judged on are missing).
    same: int = 0
    not_judged: int = 0
    note: str | None = Field(None, description="why a cell is missing")
    attribution_status: str | None = Field(None, description="the co-run of a build variant with its base "
                                                             "environment's build (environment_compare)")
    looks_like: str | None = Field(None, description="what the changed cases look like, most common first, with "
                                                     "the flags each call rests on")


class MatrixRow(BaseModel):
    release: str
    sha: str
    cells: list[MatrixCell]


class EnvironmentMatrix(BaseModel):
    project: str
    reference: str = Field(description="the environment every other column is judged against")
    environments: list[str]
    rows: list[MatrixRow]


def _missing(environment: str, why: Exception) -> MatrixCell:
    return MatrixCell(environment=environment, state="missing", note=str(why))


def _row(session: Session, project: Project, commit: Commit, reference: str, others: list[str]) -> MatrixRow:
    """One release: the reference environment's results loaded once, each other environment's
    judged against them."""
    try:
        base = environment_compare.Side(session, project=project, commit=commit, environment=reference, battery=None)
    except (NotFoundError, ConflictError) as missing:
        return MatrixRow(release=commit.release_tag, sha=commit.sha, cells=[_missing(name, missing) for name in others])
    return MatrixRow(release=commit.release_tag, sha=commit.sha,
                     cells=[_cell(session, project, commit, base, name) for name in others])


def _cell(session: Session, project: Project, commit: Commit, base: environment_compare.Side,
          environment: str) -> MatrixCell:
    try:
        side = environment_compare.Side(session, project=project, commit=commit, environment=environment,
                                        battery=base.run.battery)
        answer = environment_compare.compare_sides(project, commit, base, side, environment_attribution.find(
            session=session, run_a_id=base.run.id, run_b_id=side.run.id))
    except (NotFoundError, ConflictError, BadInputError) as missing:
        return _missing(environment, missing)
    moved = [case for case in answer.comparison.cases if case.verdict == "changed"]
    steps = [case.first_divergent_step for case in moved if case.first_divergent_step]
    return MatrixCell(environment=environment, state=answer.comparison.verdict, changed=len(moved),
                      first_step=min(steps) if steps else None,
                      farther=sum(case.direction == "farther" for case in moved),
                      closer=sum(case.direction == "closer" for case in moved),
                      same=sum(case.direction == "same" for case in moved),
                      not_judged=sum(case.direction not in ("farther", "closer", "same") for case in moved),
                      attribution_status=answer.attribution_status,
                      looks_like=looks_like_headline([(headline_kind(case.attribution.looks_like,
                                                                     case.attribution.evidence),
                                                       tuple(case.attribution.evidence.get("flags") or ()))
                                                      for case in moved if case.attribution]))


def matrix(*, session: Session, project: Project, reference: str | None = None) -> EnvironmentMatrix:
    reference = reference or project.environments[0]
    if reference not in project.environments:
        raise BadInputError(f"environment {reference[:60]!r} is not registered for project {project.name!r}; "
                            f"use one of {', '.join(project.environments)}")
    others = [name for name in project.environments if name != reference]
    releases = list(session.scalars(
        select(Commit).where(Commit.project_id == project.id, Commit.release_tag.is_not(None))
        .order_by(Commit.created_at.desc(), Commit.id.desc()).limit(MAX_RELEASES)))
    rows = [_row(session, project, commit, reference, others) for commit in releases]
    return EnvironmentMatrix(project=project.name, reference=reference, environments=others, rows=rows)
