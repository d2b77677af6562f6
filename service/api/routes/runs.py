"""One run: its state and verdict, log, cancel and retry, acknowledging its change, its cases page by
page, and its stored trajectories (JSON and CSV, page by page; one case)."""

from __future__ import annotations

import csv
import io

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from service.api.auth import PrincipalDep
from service.api.deps import SessionDep, SettingsDep
from service.api.paging import (
    CASES_PAGE_DEFAULT, CASES_PAGE_MAX, TRAJECTORIES_PAGE_DEFAULT, TRAJECTORIES_PAGE_MAX, detail_for_cases,
)
from service.api.params import Offset, RunIdPath, limit_param
from service.domain.auth import MAINTAIN, SUBMIT
from service.api.presenters import attribution_public, run_public, trajectory_public, verdict_public
from service.api.schemas import (
    AcknowledgeRequest, CasesPublic, RunPublic, TrajectoriesPublic, TrajectoryPublic, VerdictPublic,
)
from service.domain import dispatch, runs, trajectories, verdict_store
from service.domain.errors import NotFoundError
from service.notify import hooks as notify_hooks

router = APIRouter(prefix="/runs", tags=["runs"])


@router.get("/{run_id}", response_model=RunPublic)
def read_run(run_id: RunIdPath, session: SessionDep) -> RunPublic:
    return run_public(runs.get(session=session, run_id=run_id))


@router.get("/{run_id}/log", response_class=PlainTextResponse)
def build_log(run_id: RunIdPath, session: SessionDep) -> str:
    run = runs.get(session=session, run_id=run_id)
    return run.build_log or ""


@router.post("/{run_id}/cancel", response_model=RunPublic)
def cancel_run(run_id: RunIdPath, session: SessionDep, principal: PrincipalDep) -> RunPublic:
    # CI may cancel its own project's runs (a superseded push); everything else is admin's.
    principal.require(SUBMIT, project=runs.get(session=session, run_id=run_id).project.name)
    return run_public(runs.request_cancel(session=session, run_id=run_id))


@router.post("/{run_id}/retry", response_model=RunPublic)
def retry_run(run_id: RunIdPath, session: SessionDep, settings: SettingsDep,
              principal: PrincipalDep) -> RunPublic:
    """Run again a run that ended in `error` (an optdrift failure, not the commit's); 409 otherwise."""
    principal.require(SUBMIT, project=runs.get(session=session, run_id=run_id).project.name)
    run = runs.retry(session=session, run_id=run_id)
    dispatch.dispatch_runs(session=session, settings=settings, run_ids=[run.id])
    session.refresh(run)
    return run_public(run)


@router.post("/{run_id}/acknowledge", response_model=VerdictPublic)
def acknowledge_run(run_id: RunIdPath, body: AcknowledgeRequest, session: SessionDep,
                    principal: PrincipalDep, settings: SettingsDep) -> VerdictPublic:
    run = runs.get(session=session, run_id=run_id)
    # The path names no project: a maintain token limited to one acknowledges that project's runs only.
    principal.require(MAINTAIN, project=run.project.name)
    verdict = verdict_store.acknowledge(session=session, run=run, note=body.note, by=body.by)
    session.commit()
    notify_hooks.run_changed(run.id, settings=settings)  # the check run turns to success (issue 16)
    return verdict_public(verdict)


@router.get("/{run_id}/cases", response_model=CasesPublic)
def list_cases(run_id: RunIdPath, session: SessionDep,
               limit: limit_param(CASES_PAGE_DEFAULT, CASES_PAGE_MAX) = CASES_PAGE_DEFAULT,
               offset: Offset = 0) -> CasesPublic:
    """The verdict's case comparisons, one page in stored order, each with its attribution (the run's
    answer shows a bounded few: service/api/paging.py). No verdict yet: no cases."""
    run = runs.get(session=session, run_id=run_id)
    detail = run.verdict.detail if run.verdict is not None else {}
    stored = detail.get("cases", [])
    page = stored[offset:offset + limit]
    page_detail = detail_for_cases(detail, page)
    attributed = {a.case_id: a for a in attribution_public(page_detail)}
    data = [{**case, "attribution": attributed[case["case_id"]].model_dump() if case.get("case_id") in attributed
             else None} for case in page]
    return CasesPublic(run_id=run_id, count=len(stored), limit=limit, offset=offset, data=data,
                       attribution_detail=page_detail.get("attribution"))


TrajectoryLimit = limit_param(TRAJECTORIES_PAGE_DEFAULT, TRAJECTORIES_PAGE_MAX)


@router.get("/{run_id}/trajectories", response_model=TrajectoriesPublic)
def list_trajectories(run_id: RunIdPath, session: SessionDep, limit: TrajectoryLimit = TRAJECTORIES_PAGE_DEFAULT,
                      offset: Offset = 0) -> TrajectoriesPublic:
    """One page of the run's trajectories (cases in case order), with how many there are."""
    runs.get(session=session, run_id=run_id)
    total, rows = trajectories.page_rows(session=session, run_id=run_id, limit=limit, offset=offset)
    return TrajectoriesPublic(run_id=run_id, count=total, limit=limit, offset=offset,
                              data=[trajectory_public(row) for row in rows])


@router.get("/{run_id}/trajectories.csv", response_class=Response,
            responses={200: {"content": {"text/csv": {}}}})
def export_trajectories_csv(run_id: RunIdPath, session: SessionDep,
                            limit: TrajectoryLimit = TRAJECTORIES_PAGE_DEFAULT, offset: Offset = 0) -> Response:
    """One row per case x step for one page of cases (`limit`, `offset`; X-Total-Count: cases in all);
    floats written with repr (shortest exact round trip)."""
    runs.get(session=session, run_id=run_id)
    total, rows = trajectories.page_rows(session=session, run_id=run_id, limit=limit, offset=offset)
    names = list(trajectories.SERIES)
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["case_id", "status", "step", *names, "digest"])
    for row in rows:
        series = trajectories.unpack_series(row.series_layout, row.series_data)
        digests = row.digests.split("\n") if row.digests else []
        for index in range(row.steps):
            values = [repr(series[name][index]) if name in series else "" for name in names]
            writer.writerow([row.case_id, row.status, index + 1, *values, digests[index]])
    suffix = "" if offset == 0 and len(rows) == total else f"-cases{offset + 1}-{offset + len(rows)}"
    return Response(out.getvalue(), media_type="text/csv",
                    headers={"Content-Disposition": f'attachment; filename="run-{run_id}{suffix}.csv"',
                             "X-Total-Count": str(total)})


@router.get("/{run_id}/trajectories/{case_id}", response_model=TrajectoryPublic)
def read_trajectory(run_id: RunIdPath, case_id: str, session: SessionDep) -> TrajectoryPublic:
    runs.get(session=session, run_id=run_id)
    row = trajectories.one_row(session=session, run_id=run_id, case_id=case_id)
    if row is None:
        raise NotFoundError(f"run {run_id} has no case {case_id!r}")
    return trajectory_public(row)
