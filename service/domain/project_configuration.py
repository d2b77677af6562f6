"""What a project's runs are configured with: the latest commit's optdrift.toml over the project's
registered fields, each field with where it came from.

The registered fields (build kind, adapter, battery, environments) are only defaults: a tree's
optdrift.toml overrides any of them for every run of that tree (worker.pipeline.prepare). A
project registered by name alone would otherwise show `torch-extension / bundled / quick` while
its runs use what the tree says, so the project's API answer and page show this instead."""

from __future__ import annotations

import tomllib
from typing import Literal

from pydantic import BaseModel, Field
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.archives import ArchiveError, root_file_and_names
from service.core.project_config import CONFIG_FILE, ProjectConfigError, config_defaults, parse_config
from service.db.models import Commit, Project
from service.domain.storage import UnknownSourceError, archive_limits, get_archive
from service.settings import Settings

Origin = Literal["tree", "registered"]


class ConfiguredField(BaseModel):
    name: str = Field(description="the field as optdrift.toml names it: `adapter`, `build.kind`, ...")
    value: object
    origin: Origin = Field(description="`tree`: the commit's optdrift.toml sets it; `registered`: the "
                                       "project's registered default (the tree leaves it unset)")


class EffectiveConfiguration(BaseModel):
    commit: str | None = Field(description="the commit whose tree was read; None before any submission")
    has_file: bool = Field(description=f"whether that tree has an {CONFIG_FILE}")
    fields: list[ConfiguredField]
    problem: str | None = Field(None, description="why the tree's configuration could not be read, if so")


# The fields a reader compares, in the order a page shows them; the rest are on the tree.
_SHOWN = ("adapter", "battery", "environments", "repeats", "kernel_speed", "build.kind", "build.commands",
          "build.library", "build.source_dir")


def _tree_keys(text: str) -> set[str]:
    data = tomllib.loads(text)
    keys = set(data.get("project", {}))
    keys |= {f"build.{key}" for key in data.get("build", {})}
    return keys


def _value(config: dict, name: str) -> object:
    node: object = config
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def from_text(text: str | None, project: Project, *, commit: str | None) -> EffectiveConfiguration:
    """The configuration the worker will derive from a tree whose optdrift.toml is `text` (None: the
    tree has none), as the worker's own parser reads it."""
    defaults = config_defaults(project)
    set_by_tree: set[str] = set()
    try:
        config = parse_config(text, defaults=defaults, origin=CONFIG_FILE) if text is not None \
            else parse_config("", defaults=defaults)
        if text is not None:
            set_by_tree = _tree_keys(text)
    except ProjectConfigError as problem:
        return EffectiveConfiguration(commit=commit, has_file=text is not None, fields=[], problem=str(problem))
    dumped = config.model_dump(mode="json")
    fields = [ConfiguredField(name=name, value=_value(dumped, name),
                              origin="tree" if name in set_by_tree else "registered")
              for name in _SHOWN if _value(dumped, name) not in (None, [])]
    return EffectiveConfiguration(commit=commit, has_file=text is not None, fields=fields)


def effective(*, session: Session, settings: Settings, project: Project) -> EffectiveConfiguration:
    """The configuration of the project's newest commit's tree (by submission time)."""
    latest = session.scalar(select(Commit).where(Commit.project_id == project.id)
                            .order_by(Commit.created_at.desc(), Commit.id.desc()).limit(1))
    if latest is None:
        return from_text(None, project, commit=None)
    try:
        _, path = get_archive(session=session, settings=settings, digest=latest.source_digest, project=project)
        text, _names = root_file_and_names(path.read_bytes(), CONFIG_FILE, archive_limits(settings))
    except (UnknownSourceError, ArchiveError, OSError) as problem:
        return EffectiveConfiguration(commit=latest.sha, has_file=False, fields=[],
                                      problem=f"the tree of {latest.sha[:12]} could not be read: {problem}")
    return from_text(text, project, commit=latest.sha)
