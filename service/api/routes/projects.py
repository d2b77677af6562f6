"""Projects: the list, registering one and changing its registered fields (admin), and one project with
what its runs really use (its newest commit's optdrift.toml over those fields)."""

from __future__ import annotations

from fastapi import APIRouter, status

from service.api.auth import AdminDep
from service.api.deps import SessionDep, SettingsDep
from service.api.schemas import (
    ProjectCreate, ProjectDetail, ProjectPublic, ProjectRegistered, ProjectsPublic, ProjectUpdate,
)
from service.domain import project_configuration, projects, registration_rules

router = APIRouter(prefix="/projects", tags=["projects"])


@router.get("", response_model=ProjectsPublic)
def list_projects(session: SessionDep) -> ProjectsPublic:
    return ProjectsPublic(data=projects.list_all(session=session))


@router.post("", response_model=ProjectRegistered, status_code=status.HTTP_201_CREATED)
def create_project(body: ProjectCreate, session: SessionDep, _principal: AdminDep) -> ProjectRegistered:
    """Register a project (admin). A battery, adapter or environment the service cannot run is a 422
    naming it and the valid choices; environments no live worker serves: see `allow_unserved`."""
    fields = body.model_dump(exclude={"allow_unserved"})
    warnings = registration_rules.check_registration(session=session, fields=fields,
                                                     allow_unserved=body.allow_unserved)
    project = projects.create(session=session, **fields)
    session.commit()
    return ProjectRegistered.model_validate({**ProjectPublic.model_validate(project).model_dump(),
                                             "warnings": warnings})


@router.get("/{project}", response_model=ProjectDetail)
def read_project(project: str, session: SessionDep, settings: SettingsDep) -> ProjectDetail:
    """The registered fields and, in `configuration`, what the newest commit's runs use: its tree's
    optdrift.toml over those fields, each with its origin."""
    row = projects.get_by_name(session=session, name=project)
    configuration = project_configuration.effective(session=session, settings=settings, project=row)
    return ProjectDetail.model_validate({**ProjectPublic.model_validate(row).model_dump(),
                                         "configuration": configuration})


@router.patch("/{project}", response_model=ProjectRegistered)
def update_project(project: str, body: ProjectUpdate, session: SessionDep, _principal: AdminDep) -> ProjectRegistered:
    """Change registered fields (admin), checked as at creation. Environments: submissions may name
    only these from now on; runs already queued keep theirs."""
    fields = body.model_dump(exclude_unset=True, exclude={"allow_unserved"})
    projects.get_by_name(session=session, name=project)  # an unknown project is a 404 before the checks
    warnings = registration_rules.check_registration(session=session, fields=fields,
                                                     allow_unserved=body.allow_unserved)
    row = projects.update(session=session, name=project, **fields)
    session.commit()
    return ProjectRegistered.model_validate({**ProjectPublic.model_validate(row).model_dump(),
                                             "warnings": warnings})
