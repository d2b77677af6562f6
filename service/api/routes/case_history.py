"""A case across a project's commits: its distance to the float64 reference per commit, where its
bits changed, acknowledgements and releases (the JSON of the dashboard's case history page)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query

from service.api.deps import SessionDep
from service.api.params import limit_param
from service.domain import case_history

router = APIRouter(prefix="/projects/{project}", tags=["history"])


@router.get("/case-history")
def read_case_history(
    project: str, session: SessionDep,
    case: Annotated[str, Query(min_length=1, max_length=255, description="the case id (a commit's page lists them)")],
    environment: Annotated[str | None, Query(max_length=100, description="default: the case's latest run's")] = None,
    limit: limit_param(case_history.DEFAULT_LIMIT, case_history.MAX_LIMIT) = case_history.DEFAULT_LIMIT,
    ref: Annotated[str | None, Query(max_length=255, description=(
        "the line to follow: a commit sha or a branch name (its newest submitted commit); default: the "
        "default branch's"))] = None,
) -> dict[str, Any]:
    """Along one first-parent line (`line` says which; commits off it, such as side branches and
    pull requests' merge commits, are counted in `off_line`, never points), oldest commit first: per
    commit the final and the largest per-step distance to the float64 reference, and against the
    nearest older commit of the line that ran the case (else its verdict's baseline) whether the
    case's digests changed, from which step, in which direction; acknowledgements and release tags.
    NaN and infinite distances are null."""
    return case_history.as_json(case_history.case_history(
        session=session, project_name=project, case_id=case, environment=environment, limit=limit,
        ref=ref or None))
