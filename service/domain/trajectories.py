"""Trajectories in the database: per-step series packed as raw little-endian bytes (float64 for
measurements, int64 for counts) so storage is compact and bit-exact, and converted back into the
shared result models (service.core.results) for comparison and the API."""

from __future__ import annotations

import sys
from array import array
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service.db.models import Run, Trajectory
from service.domain import redaction
from service.core.results import CaseResult, CaseSpec, EnvironmentFingerprint, RepeatCheck, RunResult
from service.core.results import Trajectory as TrajectoryModel

# name -> array typecode: "d" float64, "q" int64. Order is storage order.
SERIES: dict[str, str] = {
    "ref64_max_abs": "d",
    "ref64_max_rel": "d",
    "same_precision_max_abs": "d",
    "nonfinite_count": "q",
    # quantized families (issue 37): absent from rows stored before them, and wherever not measured
    "quant_ref_steps": "d",
    "quant_ref_max_abs": "d",
}


def _to_le_bytes(values: list, typecode: str) -> bytes:
    packed = array(typecode, values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def _from_le_bytes(data: bytes, typecode: str) -> list:
    packed = array(typecode)
    packed.frombytes(data)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def pack_series(trajectory: TrajectoryModel) -> tuple[list[dict[str, Any]], bytes]:
    layout: list[dict[str, Any]] = []
    chunks: list[bytes] = []
    for name, typecode in SERIES.items():
        values = getattr(trajectory, name)
        if values is None:
            continue
        layout.append({"name": name, "dtype": "float64" if typecode == "d" else "int64",
                       "length": len(values)})
        chunks.append(_to_le_bytes(list(values), typecode))
    return layout, b"".join(chunks)


def unpack_series(layout: list[dict[str, Any]], data: bytes) -> dict[str, list]:
    out: dict[str, list] = {}
    offset = 0
    for entry in layout:
        typecode = "d" if entry["dtype"] == "float64" else "q"
        size = entry["length"] * 8
        out[entry["name"]] = _from_le_bytes(data[offset:offset + size], typecode)
        offset += size
    return out


MAX_CASE_ERROR_CHARS = 16 * 1024


def store_case_result(*, session: Session, run_id: int, case_index: int, result: CaseResult) -> Trajectory:
    """Insert or replace the (run, case) row: a re-run of a case never duplicates it."""
    row = session.scalar(
        select(Trajectory).where(Trajectory.run_id == run_id, Trajectory.case_id == result.case.case_id)
    )
    if row is None:
        row = Trajectory(run_id=run_id, case_id=result.case.case_id)
        session.add(row)
    _fill(row, case_index, result)
    session.flush()
    return row


def store_case_results(*, session: Session, run_id: int, results: list[tuple[int, CaseResult]]) -> None:
    """store_case_result for a batch of (case index, result), in one query for the rows that exist
    and one flush; a case twice in the batch keeps its last result. Not committed here."""
    latest = {result.case.case_id: (index, result) for index, result in results}
    existing = {row.case_id: row for row in session.scalars(
        select(Trajectory).where(Trajectory.run_id == run_id, Trajectory.case_id.in_(list(latest))))}
    for case_id, (index, result) in latest.items():
        row = existing.get(case_id)
        if row is None:
            row = Trajectory(run_id=run_id, case_id=case_id)
            session.add(row)
        _fill(row, index, result)
    session.flush()


def _fill(row: Trajectory, case_index: int, result: CaseResult) -> None:
    layout, data = ([], b"")
    digests: list[str] = []
    steps = 0
    if result.trajectory is not None:
        layout, data = pack_series(result.trajectory)
        digests = result.trajectory.digests
        steps = len(digests)
    row.case_index = case_index
    row.case = result.case.model_dump(mode="json")
    row.status = result.status
    # A kernel's own words: they may quote what it read, and be of any length.
    row.error = redaction.clip(redaction.scrub(result.message), MAX_CASE_ERROR_CHARS)
    row.steps = steps
    row.series_layout = layout
    row.series_data = data
    row.digests = "\n".join(digests)
    row.extra = {"duration_s": result.duration_s}
    if result.repeat_check is not None:
        row.extra["repeat_check"] = result.repeat_check.model_dump(mode="json")


def row_to_case_result(row: Trajectory) -> CaseResult:
    trajectory = None
    if row.series_layout:
        series = unpack_series(row.series_layout, row.series_data)
        trajectory = TrajectoryModel(
            digests=row.digests.split("\n") if row.digests else [], **series
        )
    return CaseResult(
        case=CaseSpec.model_validate(row.case), status=row.status, message=row.error,
        trajectory=trajectory, duration_s=(row.extra or {}).get("duration_s", 0.0),
        repeat_check=(row.extra or {}).get("repeat_check"),
    )


def list_rows(*, session: Session, run_id: int) -> list[Trajectory]:
    return list(session.scalars(
        select(Trajectory).where(Trajectory.run_id == run_id).order_by(Trajectory.case_index)
    ))


def add_repeat_checks(*, session: Session, run_id: int, checks: dict[str, RepeatCheck]) -> None:
    """Each named case's repeat check replaced by `checks[case_id]` (the co-run's re-run, one more
    repeat on the stored trajectory: worker/jobs/corun.py), the rest of its row as stored; flushed,
    not committed (the caller judges the run again in the same transaction)."""
    for row in list_rows(session=session, run_id=run_id):
        if row.case_id in checks:
            row.extra = {**(row.extra or {}), "repeat_check": checks[row.case_id].model_dump(mode="json")}
    session.flush()


def page_rows(*, session: Session, run_id: int, limit: int, offset: int) -> tuple[int, list[Trajectory]]:
    """(rows in all, one page of them in case order): an answer bounded whatever the case count."""
    total = session.scalar(select(func.count()).select_from(Trajectory).where(Trajectory.run_id == run_id)) or 0
    rows = list(session.scalars(select(Trajectory).where(Trajectory.run_id == run_id)
                                .order_by(Trajectory.case_index).limit(limit).offset(offset)))
    return total, rows


def one_row(*, session: Session, run_id: int, case_id: str) -> Trajectory | None:
    return session.scalar(select(Trajectory).where(Trajectory.run_id == run_id, Trajectory.case_id == case_id)
                          .order_by(Trajectory.case_index).limit(1))


def run_result(*, session: Session, run: Run) -> RunResult:
    """The stored run as the engine's RunResult (for comparison)."""
    detail = run.environment_detail or {}
    environment = detail.get("fingerprint")
    return RunResult(
        battery_name=run.battery,
        battery_version=detail.get("battery_version", 0),
        battery_digest=run.battery_hash or "",
        environment=EnvironmentFingerprint.model_validate(environment) if environment else None,
        build_digest=run.build_digest,
        build_ok=detail.get("build_ok", True),
        build_error=detail.get("build_error"),
        cases=[row_to_case_result(row) for row in list_rows(session=session, run_id=run.id)],
        reference_digests=detail.get("reference_digests") or {},
    )
