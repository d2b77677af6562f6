"""A run's training impact (issue 46): whether its optimizer change moves a model's loss, measured
on the reference models against its baseline run (worker/jobs/training.py).

GET  /runs/{run_id}/training            the run's latest job (404 when it has none)
POST /runs/{run_id}/training            ask for one: against the run's baseline or any other
                                        finished run of its project and environment (202)
GET  /training/{job_id}                 one job by id
"""

from __future__ import annotations

from fastapi import APIRouter, Query, status
from pydantic import BaseModel, Field

from service.api.auth import PrincipalDep
from service.api.deps import SessionDep, SettingsDep
from service.api.params import MAX_ROW_ID, RunIdPath, TrainingIdPath
from service.broker.queueing import send_training_impact
from service.core.training import ModelSetName, TrainingImpact
from service.domain import runs, training_impacts
from service.domain.auth import SUBMIT, VERIFY
from service.domain.errors import NotFoundError

router = APIRouter(tags=["training"])


class TrainingRequest(BaseModel):
    baseline_run_id: int | None = Field(None, ge=1, le=MAX_ROW_ID, description="the run to compare with; default: the run's "
                                                                "verdict's baseline")
    model_set: ModelSetName = Field("quick", description="quick (a CPU worker's) or standard (more seeds and steps)")


CurvesQuery = Query(True, description="false: leave every run's per-step loss out (the verdicts and figures only)")


@router.get("/runs/{run_id}/training", response_model=TrainingImpact)
def read_run_training(run_id: RunIdPath, session: SessionDep, curves: bool = CurvesQuery) -> TrainingImpact:
    runs.get(session=session, run_id=run_id)
    row = training_impacts.latest_for_run(session=session, run_id=run_id)
    if row is None:
        raise NotFoundError(f"run {run_id} has no training impact: it is measured after a changed run's co-run, "
                            f"or on request (POST /api/v1/runs/{run_id}/training)")
    return training_impacts.view(row, curves=curves)


@router.post("/runs/{run_id}/training", response_model=TrainingImpact, status_code=status.HTTP_202_ACCEPTED)
def request_run_training(run_id: RunIdPath, body: TrainingRequest, session: SessionDep, settings: SettingsDep,
                         principal: PrincipalDep) -> TrainingImpact:
    """Queue a training impact of the run against `baseline_run_id` (or its baseline); an existing job
    of the same pair and model set is returned as it is (a failed one is queued again)."""
    principal.require(SUBMIT, VERIFY, project=runs.get(session=session, run_id=run_id).project.name)
    if principal.scope == VERIFY:
        # A contributor's token asks about its own verify runs against their baselines: a job is
        # minutes of a worker, and a verify token's runs are what its daily quota bounds.
        training_impacts.check_verify_request(session=session, token_id=principal.token_id, run_id=run_id,
                                              baseline_run_id=body.baseline_run_id)
    row, queued_now = training_impacts.open_job(session=session, run_id=run_id,
                                                baseline_run_id=body.baseline_run_id, model_set=body.model_set,
                                                requested_by=principal.name or "api")
    if queued_now:  # a job already queued has its message: asking again sends no second one
        try:
            send_training_impact(settings=settings, job_id=row.id, environment=row.environment)
        except Exception as error:  # noqa: BLE001 - the row says why; asking again re-queues it
            training_impacts.finish(session=session, job_id=row.id, error=f"the broker did not take it: {error}")
    return training_impacts.view(row, curves=False)


@router.get("/training/{job_id}", response_model=TrainingImpact)
def read_training(job_id: TrainingIdPath, session: SessionDep, curves: bool = CurvesQuery) -> TrainingImpact:
    return training_impacts.view(training_impacts.get(session=session, job_id=job_id), curves=curves)
