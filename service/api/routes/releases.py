"""The release matrix (issue 47): releases in version order × (optimizer · family · dtype), each cell
the change from the previous release in the row's own scale, its kind and first divergent step
(service/dashboard/release_matrix.py; the release page renders this same resource)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from service.api.deps import SessionDep
from service.api.release_schemas import ReleaseMatrix
from service.dashboard import release_matrix

router = APIRouter(prefix="/projects/{project}/releases", tags=["releases"])


@router.get("/matrix", response_model=ReleaseMatrix)
def read_release_matrix(
    project: str, session: SessionDep,
    environment: Annotated[str | None, Query(max_length=100, description="default: the environment and battery "
                                                                         "most releases ran")] = None,
    battery: Annotated[str | None, Query(max_length=200, description="the battery that ran (a requested name "
                                                                     "finds the battery that ran for it)")] = None,
    releases: Annotated[list[str] | None, Query(
        description="keep only these release tags (repeat the parameter), each compared with the one before it "
                    "among them: two tags compare any two releases (at most 50)")] = None,
) -> ReleaseMatrix:
    """Per row and release: the change from the previous release with data (a factor of its final
    distance to float64, or a move in quantization steps for 8-bit rows), its kind, the first
    divergent step, a colour intensity within the row's scale; per release why it has no data."""
    return release_matrix.build(session=session, project_name=project, environment=environment or None,
                                battery=battery or None, only=releases or None)
