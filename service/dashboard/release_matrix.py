"""Release drift: releases x (optimizer, kernel family, parameter dtype), each cell the largest
final-step distance to the float64 reference over the group's cases, marked where any case's
trajectory (its per-step digests) differs from the previous release's.

Reads only what it needs from each trajectory row: the last float64 of `ref64_max_abs` (located
through the series layout, without unpacking the other series) and the digests text.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.core.wording import number
from service.db.models import DONE, Commit, Run, Trajectory
from service.domain.dashboard_queries import get_project

GroupKey = tuple[str, str, str]  # optimizer, family, param dtype
# Colour buckets by decade of the final distance; the cell also prints the number, so the colour
# only repeats what the text says.
DECADE_BUCKETS = 6


def final_ref64_distance(layout: list[dict[str, Any]], data: bytes) -> float | None:
    offset = 0
    for entry in layout:
        size = entry["length"] * 8
        if entry["name"] == "ref64_max_abs":
            if entry["length"] == 0:
                return None
            return struct.unpack_from("<d", data, offset + size - 8)[0]
        offset += size
    return None


def case_label(case: dict[str, Any]) -> str:
    hyper = case.get("hyper", {})
    gradient = case.get("gradient") or {}
    zeros = f" z{gradient['zero_fraction']:g}" if gradient.get("zero_fraction") else ""
    return (f"lr {hyper.get('lr', 0):g} wd {hyper.get('weight_decay', 0):g} "
            f"{gradient.get('kind', 'open')}{zeros} n{case.get('size')} s{case.get('seed')}")


@dataclass
class Cell:
    value: float | None          # largest final distance to the float64 reference, None: no data
    cases: int = 0
    changed: int = 0             # cases whose trajectory differs from the previous release's
    broken: int = 0
    not_applicable: int = 0      # cases the adapter cannot run there: neither broken nor compared
    compared: bool = False       # there was a previous release with this group to compare with
    bucket: int | None = None

    @property
    def text(self) -> str:
        return number(self.value, missing="no data")


@dataclass
class ReleaseMatrix:
    releases: list[tuple[str, str, int | None]]          # (tag, sha, run id or None)
    groups: list[GroupKey]
    cells: dict[tuple[GroupKey, int], Cell]               # (group, release index) -> cell
    environment: str | None
    battery: str | None
    choices: list[tuple[str, str]]                        # (environment, battery) pairs seen
    # group label -> case label -> per-release final distance (None where absent), for the plot
    lines: dict[str, dict[str, list[float | None]]] = field(default_factory=dict)

    def cell(self, group: GroupKey, index: int) -> Cell:
        return self.cells.get((group, index), Cell(value=None))


def group_label(group: GroupKey) -> str:
    return f"{group[0]} · {group[1]} · {group[2]}"


def build(*, session: Session, project_name: str, environment: str | None = None,
          battery: str | None = None) -> ReleaseMatrix:
    project = get_project(session=session, name=project_name)
    releases = session.execute(
        select(Commit.id, Commit.release_tag, Commit.sha)
        .where(Commit.project_id == project.id, Commit.release_tag.is_not(None))
        .order_by(Commit.created_at, Commit.id)
    ).all()
    release_ids = [r[0] for r in releases]
    runs = session.execute(
        select(Run.id, Run.commit_id, Run.environment, Run.battery)
        .where(Run.commit_id.in_(release_ids), Run.status == DONE)
    ).all() if release_ids else []
    pairs = Counter((env, bat) for _rid, _cid, env, bat in runs)
    choices = sorted(pairs)
    if environment is None or battery is None:
        if pairs:
            (default_env, default_battery), _n = pairs.most_common(1)[0]
            environment = environment or default_env
            battery = battery or default_battery
    run_of_commit = {cid: rid for rid, cid, env, bat in runs if env == environment and bat == battery}
    release_list = [(tag, sha, run_of_commit.get(cid)) for cid, tag, sha in releases]

    # case id -> per release index -> (final distance, digests, status); and case id -> spec.
    finals: dict[str, dict[int, tuple[float | None, str, str]]] = {}
    specs: dict[str, dict[str, Any]] = {}
    index_of_run = {run_id: index for index, (_t, _s, run_id) in enumerate(release_list) if run_id}
    if index_of_run:
        rows = session.execute(
            select(Trajectory.run_id, Trajectory.case_id, Trajectory.case, Trajectory.status,
                   Trajectory.series_layout, Trajectory.series_data, Trajectory.digests)
            .where(Trajectory.run_id.in_(list(index_of_run)))
        ).all()
        for run_id, case_id, case, status, layout, data, digests in rows:
            final = final_ref64_distance(layout, data) if status == "ok" else None
            finals.setdefault(case_id, {})[index_of_run[run_id]] = (final, digests, status)
            specs.setdefault(case_id, case)

    cells: dict[tuple[GroupKey, int], Cell] = {}
    lines: dict[str, dict[str, list[float | None]]] = {}
    for case_id, by_release in finals.items():
        spec = specs[case_id]
        group = (spec["optimizer"], spec.get("family", "32bit"), spec.get("param_dtype", "float32"))
        line = lines.setdefault(group_label(group), {}).setdefault(
            f"{case_label(spec)} · {case_id}", [None] * len(release_list))
        previous = None
        for index in range(len(release_list)):
            entry = by_release.get(index)
            if entry is None:
                continue
            final, digests, status = entry
            cell = cells.setdefault((group, index), Cell(value=None))
            if status == "not_applicable":
                cell.not_applicable += 1
                continue
            cell.cases += 1
            if status != "ok":
                cell.broken += 1
            elif final is not None and math.isfinite(final):
                cell.value = final if cell.value is None else max(cell.value, final)
                line[index] = final
            if previous is not None:
                cell.compared = True
                if previous[1] != digests or previous[2] != status:
                    cell.changed += 1
            previous = entry
    _assign_buckets(cells)
    groups = sorted({group for group, _index in cells})
    return ReleaseMatrix(releases=release_list, groups=groups, cells=cells, environment=environment,
                         battery=battery, choices=choices, lines=lines)


def _assign_buckets(cells: dict[tuple[GroupKey, int], Cell]) -> None:
    """Decade buckets spread over the matrix's own range (smallest decade -> 0)."""
    decades = [math.floor(math.log10(c.value)) for c in cells.values() if c.value and c.value > 0]
    if not decades:
        return
    low, high = min(decades), max(decades)
    span = max(1, high - low)
    for cell in cells.values():
        if cell.value is None:
            continue
        if cell.value <= 0:
            cell.bucket = 0
            continue
        decade = math.floor(math.log10(cell.value))
        cell.bucket = min(DECADE_BUCKETS - 1, round((decade - low) * (DECADE_BUCKETS - 1) / span))
