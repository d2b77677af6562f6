from __future__ import annotations

from fastapi import APIRouter, status

from service.api.auth import AdminDep
from service.api.deps import SessionDep
from service.api.schemas import ProjectCreate, ProjectPublic, ProjectsPublic
from service.domain import projects

router = APIRouter(prefix="/projects", tags=["projects"])


@router.get("", response_model=ProjectsPublic)
def list_projects(session: SessionDep) -> ProjectsPublic:
    return ProjectsPublic(data=projects.list_all(session=session))


@router.post("", response_model=ProjectPublic, status_code=status.HTTP_201_CREATED)
def create_project(body: ProjectCreate, session: SessionDep, _principal: AdminDep):  # noqa: ANN201
    project = projects.create(session=session, **body.model_dump())
    session.commit()
    return project


@router.get("/{project}", response_model=ProjectPublic)
def read_project(project: str, session: SessionDep):  # noqa: ANN201
    return projects.get_by_name(session=session, name=project)
