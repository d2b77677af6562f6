"""Projects: a kernel lineage, how to build it, which adapter drives it, where it runs."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.db.models import Project
from service.domain.errors import ConflictError, NotFoundError


def get_by_name(*, session: Session, name: str) -> Project:
    project = session.scalar(select(Project).where(Project.name == name))
    if project is None:
        raise NotFoundError(f"unknown project {name!r}; create it with POST /api/v1/projects")
    return project


def lookup(*, session: Session, project_id: int) -> Project | None:
    return session.get(Project, project_id)


def list_all(*, session: Session) -> list[Project]:
    return list(session.scalars(select(Project).order_by(Project.name)))


def create(
    *,
    session: Session,
    name: str,
    build_kind: str = "torch-extension",
    build_command: str | None = None,
    adapter: str = "bundled",
    default_battery: str = "quick",
    environments: list[str] | None = None,
) -> Project:
    project = Project(
        name=name, build_kind=build_kind, build_command=build_command, adapter=adapter,
        default_battery=default_battery, environments=environments or ["cpu"],
    )
    try:
        with session.begin_nested():
            session.add(project)
    except IntegrityError as exc:
        raise ConflictError(f"project {name!r} already exists") from exc
    return project


_UPDATABLE = ("build_kind", "build_command", "adapter", "default_battery", "environments")


def update(*, session: Session, name: str, **fields) -> Project:  # noqa: ANN003
    """Set the registered `fields` (any of build_kind, build_command, adapter, default_battery,
    environments) of the project `name`."""
    project = get_by_name(session=session, name=name)
    unknown = set(fields) - set(_UPDATABLE)
    if unknown:
        raise ValueError(f"not a registered field: {sorted(unknown)}")
    for field, value in fields.items():
        setattr(project, field, value)
    return project


def ensure(*, session: Session, name: str, **fields) -> Project:  # noqa: ANN003
    """The project, created with `fields` if it does not exist (the demo and tests use this)."""
    existing = session.scalar(select(Project).where(Project.name == name))
    return existing if existing is not None else create(session=session, name=name, **fields)
