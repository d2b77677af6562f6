"""Release drift: releases × (optimizer, kernel family, parameter dtype), each cell the change from the
previous release (service/api/release_schemas.py says what each field is; the page renders that).

* Releases are ordered by their tags read as PEP 440 versions (`v0.14.2`, `ds-0.14.10`: what comes
  before the first digit is a prefix) where every tag parses, else by ancestry (how many other
  releases a release descends from), then by submission time: a back-filled old release lands
  before the newer ones, so each change is measured against its real predecessor.
* A cell compares each case with the same case in the nearest earlier release that has data (a done
  run of the chosen environment and battery): digests equal -> unchanged; otherwise the final
  distance to the float64 reference as a factor of the earlier one (quantized rows: the move of the
  states' distance to the quantization-aware reference, in quantization steps), the first step whose
  digest differs, and what kind of change it is: the stored attribution's class where the release's
  verdict was judged against that same run, and the build flags where the two runs' recorded builds
  differ.
* Colour is the size of the change within the row's scale; an unchanged cell is neutral, whatever
  its distance (an 8-bit row's distance to float64 is its quantization error, by design).
* A release whose tree refuses the environment's toolchain (its latest run there failed with
  service.core.not_buildable's sentence: bitsandbytes 0.47.0 refusing CUDA 13) is its own column
  status, `not_buildable` with the tree's line: not broken, and not an unexplained "no data".
* A column's run carries its training impact (issue 46): the latest job's state and the most severe
  verdict over its models, linking to the run page's section.
* The battery is the one that ran (the run's recorded battery; the tree's optdrift.toml may name its
  own), not the name a submission asked for.
* Any two releases compare in ulps: each cell carries a lower bound of how many ulps of its
  parameter dtype the two releases' parameters are apart at some step, made from what each run
  stored alone (service/core/ulp_bounds.py says why it is a bound). `only` keeps a subset of the
  releases (two tags: those two compared, whatever lies between them).

Reads only what it needs: the final value of two series and the whole relative-error series
(located through the series layout), the digests text, and of each verdict only its attribution.
"""

from __future__ import annotations

import math
import re
import struct
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.release_schemas import (
    BatteryChoice, CaseLine, ReleaseCell, ReleaseColumn, ReleaseMatrix, ReleaseRow, ReleaseTraining,
)
from service.core import attribution_view, environment_attribution, ulp_bounds
from service.core.case_names import case_name
from service.core.results import QUANTIZED_FAMILY_PREFIX
from service.core.wording import first_line, number, ratio
from service.db.models import CANCELLED, DONE, ERROR, FAILED, Commit, Run, Trajectory, Verdict
from service.dashboard.wording import not_buildable_line
from service.domain import training_impacts
from service.domain.dashboard_queries import get_project
from service.domain.errors import BadInputError

GroupKey = tuple[str, str, str]  # optimizer, family, param dtype

# Colour steps of a change, by its size in the row's scale (intensity 1..5; 0 is neutral). A factor
# is measured as |log10(factor)|: within 1 % (a few roundings) is 1, ×100 and beyond is 5. A move in
# quantization steps by its absolute size: a hundredth of a step is 1, ten steps and beyond 5.
RATIO_STEPS = (0.005, 0.05, 1.0, 2.0)
QUANT_STEPS = (0.01, 0.1, 1.0, 10.0)

SCALE_TEXT = {"ratio": "× its previous final distance to float64",
              "quantization-steps": "move of the states' distance to the quantization-aware reference, "
                                    "in quantization steps"}
SPARKLINE_OF = {"ratio": "the row's largest final distance to the float64 reference",
                "quantization-steps": "the row's largest final distance to the quantization-aware reference "
                                      "(quantization steps)"}


# ----------------------------------------------------------------------------- release order
_VERSION_START = re.compile(r"\d")


def tag_version(tag: str) -> Version | None:
    """The tag as a PEP 440 version (`v1.2.0`, `ds-0.14.3`, `1.2.3-rc.1`), or None."""
    start = _VERSION_START.search(tag)
    if start is None:
        return None
    try:
        return Version(tag[start.start():])
    except InvalidVersion:
        return None


@dataclass(frozen=True)
class _Release:
    commit_id: int
    tag: str
    sha: str
    parents: tuple[str, ...]
    ancestry: tuple[str, ...]
    created_at: Any


def order_releases(releases: list[_Release], parents_of: dict[str, tuple[str, ...]]) -> tuple[list[_Release], str]:
    """Version order where every tag parses; else ancestry (releases descended from fewer other
    releases first), then submission time."""
    versions = {r.commit_id: tag_version(r.tag) for r in releases}
    if releases and all(v is not None for v in versions.values()):
        return sorted(releases, key=lambda r: (versions[r.commit_id], r.created_at, r.commit_id)), "version"
    shas = {r.sha for r in releases}
    # A release's own parents and sent ancestry lead on from it when another release reaches it.
    parents_of = {**parents_of, **{r.sha: tuple(dict.fromkeys(parents_of.get(r.sha, ()) + r.parents + r.ancestry))
                                   for r in releases}}

    def release_ancestors(release: _Release) -> int:
        # The sent first-parent ancestry, and every parent reachable through submitted commits.
        seen: set[str] = set()
        todo = list(release.parents) + list(release.ancestry)
        while todo:
            sha = todo.pop()
            if sha not in seen:
                seen.add(sha)
                todo.extend(parents_of.get(sha, ()))
        return len((seen & shas) - {release.sha})

    return sorted(releases, key=lambda r: (release_ancestors(r), r.created_at, r.commit_id)), "ancestry"


# ----------------------------------------------------------------------------- reading trajectories
def _located(layout: list[dict[str, Any]], name: str) -> tuple[int, int] | None:
    """(byte offset, length) of float64 series `name` in a row's series data; None where absent."""
    offset = 0
    for entry in layout or []:
        if entry["name"] == name:
            if entry["length"] == 0 or entry.get("dtype", "float64") != "float64":
                return None
            return offset, entry["length"]
        offset += entry["length"] * 8
    return None


def final_value(layout: list[dict[str, Any]], data: bytes, name: str) -> float | None:
    """The last value of series `name` (float64), without unpacking the others."""
    where = _located(layout, name)
    return None if where is None else struct.unpack_from("<d", data, where[0] + (where[1] - 1) * 8)[0]


def series_values(layout: list[dict[str, Any]], data: bytes, name: str) -> list[float] | None:
    """Every value of series `name` (float64), without unpacking the others."""
    where = _located(layout, name)
    return None if where is None else list(struct.unpack_from(f"<{where[1]}d", data, where[0]))


def final_ref64_distance(layout: list[dict[str, Any]], data: bytes) -> float | None:
    return final_value(layout, data, "ref64_max_abs")


@dataclass
class _Point:
    """One case in one release."""

    status: str
    digests: list[str]
    final: float | None            # final distance to float64
    quant: float | None            # final quantization steps to the quantization-aware reference
    relative: list[float] | None = None  # per step, the largest relative error to float64
    dtype: str = "float32"
    reference: str | None = None   # the digest of the case's references, where the run recorded it


@dataclass
class _Change:
    case_id: str
    size: float                    # |log10 factor| or |steps|: what ranks and colours it
    change: float | None           # the factor or the move
    first_step: int | None
    kind: str | None
    kind_text: str | None
    first_step_ulps: float | None
    text: str = ""                 # the figure as the page writes it


def first_divergent_step(a: list[str], b: list[str]) -> int | None:
    for step, (x, y) in enumerate(zip(a, b), start=1):
        if x != y:
            return step
    return min(len(a), len(b)) + 1 if len(a) != len(b) else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _intensity(size: float, steps: tuple[float, ...]) -> int:
    return 1 + sum(1 for step in steps if size >= step)


# ----------------------------------------------------------------------------- kinds
def attribution_kind(case_id: str, stored: dict | None) -> tuple[str | None, str | None]:
    """(kind, words) of one case's stored attribution (worker/attribution/analysis.py's dict), read
    through service.core.attribution_view as the commit page reads it."""
    if not isinstance(stored, dict) or "error" in stored or not stored.get("class"):
        return None, None
    attribution = attribution_view.case_attribution(case_id, stored)
    kind = attribution.kind
    if kind in ("semantic", "precision"):
        if attribution.variant == "reference" and attribution.looks_like:  # a revert names itself
            return kind, attribution.looks_like
        if attribution.variant and attribution.looks_like:
            return kind, f"{kind}: {attribution.looks_like}"
        return kind, f"{kind}, unexplained"
    return kind, kind


def build_change_text(previous: dict | None, current: dict | None) -> str | None:
    """What differs between two runs' recorded builds, in the commit page's words ("build flags
    changed: + -march=native, - -g; compiler changed: A → B"); None when nothing recorded differs."""
    return attribution_view.build_change_text(environment_attribution.build_change_of_runs(current, previous))


def _case_kind(case_id: str, stored: dict | None, build_change: str | None) -> tuple[str | None, str | None]:
    kind, words = attribution_kind(case_id, stored)
    if build_change and kind == "rounding-level":
        # A change bounded by roundings with differing flags is the flags' doing as far as the
        # evidence goes; one beyond rounding is named for what it is, whatever flag differs.
        return kind, f"{words} · {build_change}"
    if build_change and kind is None:
        # Not attributed (no verdict judged these two runs against each other: two releases apart,
        # or back-filled): the flags are named, but nothing says they made the change.
        return None, f"not attributed · {build_change}"
    return kind, words


# ----------------------------------------------------------------------------- the matrix
@dataclass
class _RunInfo:
    id: int
    commit_id: int
    environment: str
    battery: str                   # the battery that ran
    requested: str
    status: str
    error: str | None
    detail: dict = field(default_factory=dict)


def _ran_battery(detail: dict | None, requested: str) -> str:
    return (detail or {}).get("battery") or requested


MAX_ONLY = 50
MAX_TAG = 100  # service.db.models.Commit.release_tag


def _keep_only(releases: list[_Release], only: list[str] | None, project: str) -> list[_Release]:
    """The releases tagged in `only` (in the matrix's order); an unknown tag is the caller's error."""
    if not only:
        return releases
    tags = [r.tag for r in releases]
    wanted = list(dict.fromkeys(tag.strip() for tag in only if tag.strip()))
    if len(wanted) > MAX_ONLY:
        raise BadInputError(f"releases: {len(wanted)} tags given, at most {MAX_ONLY}")
    if any(len(tag) > MAX_TAG for tag in wanted):
        raise BadInputError(f"releases: a tag longer than {MAX_TAG} characters (release tags are at most that)")
    unknown = [tag for tag in wanted if tag not in tags]
    if unknown:
        known = ", ".join(tags[-20:]) or "none"
        raise BadInputError(f"releases: no release tagged {unknown[0]!r} in project {project!r} "
                            f"(its releases{' (the last 20)' if len(tags) > 20 else ''}: {known})")
    return [r for r in releases if r.tag in wanted]


def build(*, session: Session, project_name: str, environment: str | None = None,
          battery: str | None = None, only: list[str] | None = None) -> ReleaseMatrix:
    project = get_project(session=session, name=project_name)
    release_rows = session.execute(
        select(Commit.id, Commit.release_tag, Commit.sha, Commit.parents, Commit.ancestry, Commit.created_at)
        .where(Commit.project_id == project.id, Commit.release_tag.is_not(None))
    ).all()
    releases = [_Release(cid, tag, sha, tuple(parents or ()), tuple(ancestry or ()), created)
                for cid, tag, sha, parents, ancestry, created in release_rows]
    parents_of: dict[str, tuple[str, ...]] = {}
    if releases and not all(tag_version(r.tag) for r in releases):
        parents_of = {sha: tuple(parents or ()) + tuple(ancestry or ()) for sha, parents, ancestry in session.execute(
            select(Commit.sha, Commit.parents, Commit.ancestry).where(Commit.project_id == project.id)).all()}
    releases, order = order_releases(releases, parents_of)
    all_tags = [r.tag for r in releases]
    releases = _keep_only(releases, only, project.name)

    runs = [_RunInfo(rid, cid, env, _ran_battery(detail, requested), requested, status, error, detail or {})
            for rid, cid, env, requested, status, error, detail in session.execute(
                select(Run.id, Run.commit_id, Run.environment, Run.battery, Run.status, Run.error,
                       Run.environment_detail)
                .where(Run.commit_id.in_([r.commit_id for r in releases])).order_by(Run.id)).all()
            ] if releases else []
    done = [run for run in runs if run.status == DONE]
    pairs = Counter((run.environment, run.battery) for run in done)
    requested_names: dict[tuple[str, str], set[str]] = defaultdict(set)
    for run in done:
        if run.requested != run.battery:
            requested_names[(run.environment, run.battery)].add(run.requested)
    if battery is not None and pairs and not any(b == battery for _e, b in pairs):
        # A requested name (what a submission asked for) finds the battery that ran for it.
        battery = next((b for (_e, b), names in sorted(requested_names.items()) if battery in names), battery)
    if (environment is None or battery is None) and pairs:
        candidates = [(n, pair) for pair, n in pairs.items()
                      if (environment is None or pair[0] == environment) and (battery is None or pair[1] == battery)]
        if candidates:
            _n, (default_env, default_battery) = max(candidates, key=lambda item: (item[0], item[1]))
            environment, battery = environment or default_env, battery or default_battery

    if environment is None and not pairs and runs:
        # No release has data anywhere (every one refused the toolchain, say): the environment most
        # runs asked for, so each column still says why it is empty.
        environment = Counter(run.environment for run in runs).most_common(1)[0][0]

    chosen: dict[int, _RunInfo] = {}   # release index -> its run
    for index, release in enumerate(releases):
        for run in done:
            if run.commit_id == release.commit_id and run.environment == environment and run.battery == battery:
                chosen[index] = run    # the newest such run (runs are in id order)
    previous_of: dict[int, int | None] = {}
    last = None
    for index in range(len(releases)):
        previous_of[index] = last
        if index in chosen:
            last = index

    training = _training(session, [run.id for run in chosen.values()])
    columns = []
    for index, release in enumerate(releases):
        run, previous = chosen.get(index), previous_of[index]
        build_change = None
        if run is not None and previous is not None:
            build_change = build_change_text(chosen[previous].detail, run.detail)
        refused = None if run else not_buildable_reason(release.commit_id, runs, environment)
        status = "data" if run else ("not_buildable" if refused is not None else "no_data")
        columns.append(ReleaseColumn(
            tag=release.tag, sha=release.sha, version=str(v) if (v := tag_version(release.tag)) else None,
            run_id=run.id if run else None,
            compared_with=releases[previous].tag if run is not None and previous is not None else None,
            build_change=build_change,
            no_data=(NOT_BUILDABLE_HERE + refused if refused is not None else
                     None if run else _no_data_reason(release, runs, environment, battery)),
            status=status, reason=refused,
            training=training.get(run.id) if run else None))

    points = _points(session, {run.id: index for index, run in chosen.items()},
                     {run.id: (run.detail.get("reference_digests") or {}) for run in chosen.values()})
    attributions = _attributions(session, chosen, previous_of)
    rows = _rows(releases, columns, points, attributions, chosen)
    choices = [BatteryChoice(environment=env, battery=bat, requested=sorted(requested_names.get((env, bat), ())))
               for env, bat in sorted(pairs)]
    order_text = ("Releases in version order (their tags read as PEP 440 versions)" if order == "version" else
                  "Releases in ancestry order (not every tag reads as a version), then by submission time")
    return ReleaseMatrix(project=project.name, environment=environment, battery=battery, order=order,
                         order_text=order_text, choices=choices, releases=columns, rows=rows,
                         all_releases=all_tags, only=[r.tag for r in releases] if only else None)


def _training(session: Session, run_ids: list[int]) -> dict[int, ReleaseTraining]:
    """Per run, its latest training impact's state and worst verdict (one query for the columns)."""
    return {run_id: ReleaseTraining(status=job.status, worst_verdict=job.worst if job.status == "done" else None)
            for run_id, row in training_impacts.for_runs(session=session, run_ids=run_ids).items()
            for job in [training_impacts.view(row, curves=False)]}


NOT_BUILDABLE_HERE = "not buildable here: "


def not_buildable_reason(commit_id: int, runs: list[_RunInfo], environment: str | None) -> str | None:
    """The tree's line refusing the toolchain (its first line), when the release's latest run in
    `environment` failed because its tree does not support the toolchain there; else None. A build
    refusal does not depend on the battery: any battery's run of the release counts."""
    own = [run for run in runs if run.commit_id == commit_id and run.environment == environment]
    if not own or own[-1].status != FAILED:
        return None
    return not_buildable_line(own[-1].error, environment)


def _no_data_reason(release: _Release, runs: list[_RunInfo], environment: str | None, battery: str | None) -> str:
    """Why a release has no done run of the chosen environment and battery, in words."""
    own = [run for run in runs if run.commit_id == release.commit_id]
    if not own:
        return "never run: no run was submitted for this release"
    here = [run for run in own if run.environment == environment
            and (battery in (run.battery, run.requested) or run.status != DONE)]
    if here:
        run = here[-1]
        error = first_line(run.error)
        if run.status == FAILED:
            reason = error.removeprefix("build failed").lstrip(": ") if error else ""
            return f"build failed in {environment}" + (f": {reason}" if reason else "")
        if run.status == ERROR:
            return "optdrift could not run it (not the release's fault)" + (f": {error}" if error else "")
        if run.status == CANCELLED:
            return "its run was cancelled"
        if run.status == DONE:
            return f"its run in {environment} ran the battery {run.battery}"
        if run.status in ("queued", "building", "running"):
            return f"its run is {run.status}"
        return f"{run.status.replace('_', ' ')} in {environment}" + (f": {error}" if error else "")
    ran = sorted({f"{run.battery} in {run.environment}" for run in own})
    return f"no run of the battery {battery} in {environment} (it ran {', '.join(ran)})"


def _points(session: Session, index_of_run: dict[int, int],
            references: dict[int, dict]) -> dict[str, dict[int, tuple[dict, _Point]]]:
    """case id -> release index -> (case spec, point)."""
    out: dict[str, dict[int, tuple[dict, _Point]]] = {}
    if not index_of_run:
        return out
    for run_id, case_id, case, status, layout, data, digests in session.execute(
            select(Trajectory.run_id, Trajectory.case_id, Trajectory.case, Trajectory.status,
                   Trajectory.series_layout, Trajectory.series_data, Trajectory.digests)
            .where(Trajectory.run_id.in_(list(index_of_run)))).all():
        ok = status == "ok"
        recorded = references.get(run_id, {}).get(case_id)
        point = _Point(status=status, digests=digests.split("\n") if digests else [],
                       final=final_value(layout, data, "ref64_max_abs") if ok else None,
                       quant=final_value(layout, data, "quant_ref_steps") if ok else None,
                       relative=series_values(layout, data, "ref64_max_rel") if ok else None,
                       dtype=str((case or {}).get("param_dtype") or "float32"),
                       reference=recorded if isinstance(recorded, str) else None)
        out.setdefault(case_id, {})[index_of_run[run_id]] = (case, point)
    return out


def _attributions(session: Session, chosen: dict[int, _RunInfo],
                  previous_of: dict[int, int | None]) -> dict[int, dict[str, dict]]:
    """release index -> case id -> stored attribution, only where the release's verdict was judged
    against the previous column's run (another baseline's attribution says nothing of this change)."""
    wanted = {run.id: index for index, run in chosen.items() if previous_of[index] is not None}
    out: dict[int, dict[str, dict]] = {}
    if not wanted:
        return out
    for run_id, baseline_run_id, stored in session.execute(
            select(Verdict.run_id, Verdict.baseline_run_id, Verdict.detail["attribution"])
            .where(Verdict.run_id.in_(list(wanted)))).all():
        index = wanted[run_id]
        if baseline_run_id == chosen[previous_of[index]].id and isinstance(stored, dict):
            out[index] = {case_id: value for case_id, value in stored.items() if isinstance(value, dict)}
    return out


def _group_of(spec: dict) -> GroupKey:
    return spec["optimizer"], spec.get("family", "32bit"), spec.get("param_dtype", "float32")


def group_label(group: GroupKey) -> str:
    return f"{group[0]} · {group[1]} · {group[2]}"


def _rows(releases: list[_Release], columns: list[ReleaseColumn], points: dict, attributions: dict,
          chosen: dict[int, _RunInfo]) -> list[ReleaseRow]:
    by_group: dict[GroupKey, list[str]] = defaultdict(list)
    for case_id, by_release in points.items():
        spec = next(iter(by_release.values()))[0]
        by_group[_group_of(spec)].append(case_id)
    rows = []
    for group in sorted(by_group):
        case_ids = sorted(by_group[group], key=case_name)
        quantized = group[1].startswith(QUANTIZED_FAMILY_PREFIX) and any(
            point.quant is not None for cid in case_ids for _spec, point in points[cid].values())
        scale = "quantization-steps" if quantized else "ratio"
        cells, sparkline = [], []
        for index, column in enumerate(columns):
            cell, figure = _cell(index, column, case_ids, points, attributions, chosen, scale)
            cells.append(cell)
            sparkline.append(figure)
        lines = [CaseLine(case_id=cid, name=case_name(cid),
                          finals=[_finite(points[cid][i][1].final) if i in points[cid] else None
                                  for i in range(len(releases))]) for cid in case_ids]
        rows.append(ReleaseRow(optimizer=group[0], family=group[1], dtype=group[2], label=group_label(group),
                               scale=scale, scale_text=SCALE_TEXT[scale], sparkline_of=SPARKLINE_OF[scale],
                               sparkline=sparkline, cells=cells, cases=lines))
    return rows


def _cell(index: int, column: ReleaseColumn, case_ids: list[str], points: dict, attributions: dict,
          chosen: dict[int, _RunInfo], scale: str) -> tuple[ReleaseCell, float | None]:
    empty = dict(cases=0, changed=0, compared=0, broken=0, not_applicable=0, change=None, change_text="",
                 intensity=0, kind=None, kind_text=None, first_divergent_step=None, first_step_ulps=None,
                 case_id=None, case_name=None, distance=None, distance_text="")
    if column.status == "not_buildable":
        return ReleaseCell(release=column.tag, state="not-buildable", note=column.no_data, **empty), None
    if column.run_id is None:
        return ReleaseCell(release=column.tag, state="no-data", note=column.no_data, **empty), None
    here = [(cid, points[cid][index][1]) for cid in case_ids if index in points[cid]]
    if not here:
        return ReleaseCell(release=column.tag, state="no-cases", note="no case of this row in the battery here",
                           **empty), None
    previous = next((i for i in range(index - 1, -1, -1) if i in chosen), None)
    stored = attributions.get(index, {})
    counts = Counter()
    changes: list[_Change] = []
    broken_steps: list[int] = []
    bounds: list[ulp_bounds.UlpBound] = []
    no_bound: list[str] = []
    distances, quants = [], []
    for case_id, point in here:
        if point.status == "not_applicable":
            counts["not_applicable"] += 1
            continue
        counts["cases"] += 1
        if point.status != "ok":
            counts["broken"] += 1
        if _finite(point.final) is not None:
            distances.append(point.final)
        if _finite(point.quant) is not None:
            quants.append(point.quant)
        before = points[case_id].get(previous, (None, None))[1] if previous is not None else None
        if before is None or before.status == "not_applicable":
            continue
        counts["compared"] += 1
        if before.digests == point.digests and before.status == point.status:
            continue
        counts["changed"] += 1
        step = first_divergent_step(before.digests, point.digests)
        if point.status != "ok":
            broken_steps.append(step or 1)
            continue
        changes.append(_measure(case_id, before, point, step, scale, stored.get(case_id), column.build_change))
        bound, why = ulps_apart(before, point)
        if bound is not None:
            bounds.append(bound)
        else:
            no_bound.append(why)
    distance = max(distances) if distances else None
    figure = (max(quants) if quants else None) if scale == "quantization-steps" else distance
    base = dict(release=column.tag, cases=counts["cases"], changed=counts["changed"], compared=counts["compared"],
                broken=counts["broken"], not_applicable=counts["not_applicable"], distance=_finite(distance),
                distance_text=number(distance, missing="—"), note=None)
    if previous is None:
        return ReleaseCell(state="first", change=None, change_text="first release with data", intensity=0,
                           kind=None, kind_text=None, first_divergent_step=None, first_step_ulps=None,
                           case_id=None, case_name=None, **base), figure
    if not counts["changed"]:
        return ReleaseCell(state="unchanged", change=None, change_text="= same", intensity=0, kind=None,
                           kind_text=None, first_divergent_step=None, first_step_ulps=None, case_id=None,
                           case_name=None, **base), figure
    steps = [c.first_step for c in changes if c.first_step] + broken_steps
    first = min(steps) if steps else None
    if broken_steps and not changes:
        return ReleaseCell(state="broken", change=None, change_text=f"✗ {counts['broken']} broken", intensity=5,
                           kind="broken", kind_text="broken: a crash, NaN or failed case", first_divergent_step=first,
                           first_step_ulps=None, case_id=None, case_name=None, **base), figure
    lead = max(changes, key=lambda c: c.size)
    kinds = Counter(c.kind for c in changes)
    kind_text = lead.kind_text
    if len(kinds) > 1:
        others = ", ".join(f"{k or 'not attributed'} ({n})" for k, n in kinds.most_common() if k != lead.kind)
        kind_text = f"{kind_text or 'not attributed'}; also {others}"
    steps_unit = scale == "quantization-steps"
    change_text = lead.text
    widest = max(bounds, key=lambda b: b.ulps, default=None)
    note = None
    if no_bound:
        note = no_bound[0] if widest is None else f"{len(no_bound)} of {len(changes)} changed cases: {no_bound[0]}"
    return ReleaseCell(
        ulps_at_least=widest.ulps if widest else None, ulps_step=widest.step if widest else None,
        ulps_note=note,
        state="broken" if broken_steps else "changed", change=_finite(lead.change), change_text=change_text,
        intensity=5 if broken_steps else _intensity(lead.size, QUANT_STEPS if steps_unit else RATIO_STEPS),
        kind=lead.kind, kind_text=kind_text, first_divergent_step=first, first_step_ulps=lead.first_step_ulps,
        case_id=lead.case_id, case_name=case_name(lead.case_id), **base), figure


def factor_text(factor: float | None) -> str:
    """A factor as the page writes it: ×1.700e+03; within 1 % of one, its distance from one
    (×(1 + 2.400e-05)), so a change of a few roundings does not read ×1.000e+00."""
    if factor is None:
        return "—"
    if math.isfinite(factor) and abs(factor - 1) < 0.01 and factor != 1:
        return f"×(1 {'+' if factor > 1 else '−'} {number(abs(factor - 1))})"
    return ratio(factor)


def _signed_steps(value: float | None) -> str:
    if value is None:
        return "—"
    return ("+" if value > 0 else "") + number(value) + " steps"


# A case broken in the previous release that runs again: a change, sized as a move of a decade.
REPAIRED_SIZE = 1.0


def _measure(case_id: str, before: _Point, after: _Point, step: int | None, scale: str, stored: dict | None,
             build_change: str | None) -> _Change:
    kind, words = _case_kind(case_id, stored, build_change)
    ulps = stored.get("first_step_ulps") if isinstance(stored, dict) else None
    ulps = float(ulps) if isinstance(ulps, (int, float)) else None
    if before.status != "ok":
        return _Change(case_id, REPAIRED_SIZE, None, step, "repaired", "runs again: broken in the previous release",
                       ulps, "repaired")
    if scale == "quantization-steps" and before.quant is not None and after.quant is not None:
        move = after.quant - before.quant
        return _Change(case_id, abs(move) if math.isfinite(move) else math.inf, move, step, kind, words, ulps,
                       _signed_steps(move))
    a, b = before.final, after.final
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        factor, size, text = None, math.inf, "no finite distance to compare"
    elif a == 0:
        factor, size = (1.0, 0.0) if b == 0 else (math.inf, math.inf)
        text = factor_text(factor) if b == 0 else "from 0"
    else:
        factor = b / a
        size = abs(math.log10(factor)) if factor > 0 else math.inf
        text = factor_text(factor)
    # A change of the digests with the same final distance to 4 digits is still a change: it is
    # coloured at least at the first intensity, never neutral.
    return _Change(case_id, size, factor, step, kind, words, ulps, text)


def ulps_apart(before: _Point, after: _Point) -> tuple[ulp_bounds.UlpBound | None, str]:
    """How many ulps at least one case's two runs are apart (service/core/ulp_bounds.py), or why
    that cannot be said: the bound needs one float64 reference behind both runs."""
    if before.reference and after.reference and before.reference != after.reference:
        return None, "its references changed between the two runs (no common float64 reference)"
    if before.status != "ok":
        return None, "it was broken in the earlier release"
    if before.relative is None or after.relative is None:
        return None, "a run stored no relative error to float64"
    bound = ulp_bounds.ulps_at_least(before.relative, after.relative, after.dtype)
    return bound, ("" if bound else ulp_bounds.why_no_bound(after.dtype) or "")


def sparkline_points(values: list[float | None], width: int = 120, height: int = 24) -> list[tuple[float, float]]:
    """(x, y) in an SVG box for the finite values, None gaps skipped. Log scale where all are
    positive, spanning at least one decade (linear: at least a tenth of the largest value), so a
    change of a few roundings draws flat and a ×1700 one climbs the box."""
    known = [(i, v) for i, v in enumerate(values) if v is not None and math.isfinite(v)]
    if not known:
        return []
    log = all(v > 0 for _i, v in known)
    ys = [math.log10(v) if log else v for _i, v in known]
    low, high = min(ys), max(ys)
    least = 1.0 if log else max(abs(low), abs(high)) / 10 or 1.0
    if high - low < least:
        middle = (high + low) / 2
        low, high = middle - least / 2, middle + least / 2
    step = width / max(1, len(values) - 1)
    pad = 3
    return [(round(i * step, 2), round(pad + (height - 2 * pad) * (high - y) / (high - low), 2))
            for (i, _v), y in zip(known, ys)]
