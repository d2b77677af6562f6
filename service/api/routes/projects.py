"""Projects: the list, registering one and changing its registered fields (admin), and one project with
what its runs really use (its newest commit's optdrift.toml over those fields)."""

from __future__ import annotations

from fastapi import APIRouter, status

from service.api.auth import AdminDep
from service.api.deps import SessionDep, SettingsDep
from service.api.schemas import ProjectCreate, ProjectDetail, ProjectPublic, ProjectsPublic, ProjectUpdate
from service.domain import project_configuration, projects

router = APIRouter(prefix="/projects", tags=["projects"])


@router.get("", response_model=ProjectsPublic)
def list_projects(session: SessionDep) -> ProjectsPublic:
    return ProjectsPublic(data=projects.list_all(session=session))


@router.post("", response_model=ProjectPublic, status_code=status.HTTP_201_CREATED)
def create_project(body: ProjectCreate, session: SessionDep, _principal: AdminDep):  # noqa: ANN201
    project = projects.create(session=session, **body.model_dump())
    session.commit()
    return project


@router.get("/{project}", response_model=ProjectDetail)
def read_project(project: str, session: SessionDep, settings: SettingsDep) -> ProjectDetail:
    """The registered fields and, in `configuration`, what the newest commit's runs use: its tree's
    optdrift.toml over those fields, each with its origin."""
    row = projects.get_by_name(session=session, name=project)
    configuration = project_configuration.effective(session=session, settings=settings, project=row)
    return ProjectDetail.model_validate({**ProjectPublic.model_validate(row).model_dump(),
                                         "configuration": configuration})


@router.patch("/{project}", response_model=ProjectPublic)
def update_project(project: str, body: ProjectUpdate, session: SessionDep, _principal: AdminDep):  # noqa: ANN201
    """Change registered fields (admin). Environments: submissions may name only these from now on;
    runs already queued keep theirs."""
    row = projects.update(session=session, name=project, **body.model_dump(exclude_unset=True))
    session.commit()
    return row
