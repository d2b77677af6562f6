"""One commit across two environments (issue 36): B's trajectories judged against A's, with what
differs between the two environments' fingerprints (service/domain/environment_compare.py)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import SessionDep
from service.domain import environment_compare, environment_matrix, projects

router = APIRouter(prefix="/projects/{project}", tags=["environments"])



@router.get("/environment-comparison", response_model=environment_compare.EnvironmentComparison)
def read_environment_comparison(
    project: str, session: SessionDep,
    commit: Annotated[str, Query(min_length=1, max_length=200, description="a sha, unique sha prefix or release tag")],
    a: Annotated[str, Query(min_length=1, max_length=100, description="the environment compared against")],
    b: Annotated[str, Query(min_length=1, max_length=100, description="the environment judged")],
    battery: Annotated[str | None, Query(max_length=200, description="default: the battery of A's run")] = None,
) -> environment_compare.EnvironmentComparison:
    """Per case: unchanged, or changed from step N and closer to or farther from float64, as
    environment B ran the commit against environment A's run of it. 404 when either environment has
    no run of the commit; 409 while one is not done."""
    row = projects.get_by_name(session=session, name=project)
    return environment_compare.compare(session=session, project=row, ref=commit, environment_a=a,
                                       environment_b=b, battery=battery)


@router.get("/environment-matrix", response_model=environment_matrix.EnvironmentMatrix)
def read_environment_matrix(
    project: str, session: SessionDep,
    reference: Annotated[str | None, Query(max_length=100, description="default: the first registered "
                                                                        "environment")] = None,
) -> environment_matrix.EnvironmentMatrix:
    """Releases (newest first) × environments: each release as each environment ran it, judged
    against the reference environment's run of it; `missing` where a run is not there or not done."""
    row = projects.get_by_name(session=session, name=project)
    return environment_matrix.matrix(session=session, project=row, reference=reference)
