from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Gauge, generate_latest
from sqlalchemy import func, select, text

from service.api.deps import SessionDep, SettingsDep
from service.db.models import Run, Verdict
from service.domain.queueing import producer_app

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> dict[str, str]:
    """The process is up (no dependencies checked)."""
    return {"status": "ok"}


def _broker_ok(settings) -> str | None:  # noqa: ANN001
    try:
        with producer_app(settings).connection_for_write() as connection:
            connection.ensure_connection(max_retries=1, timeout=2)
    except Exception as exc:  # noqa: BLE001
        return f"broker {settings.resolved_broker_url.split('@')[-1]} unreachable: {exc}"
    return None


@router.get("/readyz")
def readyz(session: SessionDep, settings: SettingsDep) -> JSONResponse:
    """Ready to take submissions: the database and the broker answer."""
    problems = {}
    try:
        session.execute(text("SELECT 1"))
    except Exception as exc:  # noqa: BLE001
        problems["database"] = str(exc).splitlines()[0]
    broker_problem = _broker_ok(settings)
    if broker_problem:
        problems["broker"] = broker_problem
    if problems:
        return JSONResponse({"status": "unavailable", "problems": problems}, status_code=503)
    return JSONResponse({"status": "ready"})


@router.get("/metrics", response_class=Response)
def metrics(session: SessionDep) -> Response:
    """Prometheus metrics read from the database at scrape time (so every API replica agrees)."""
    registry = CollectorRegistry()
    runs_gauge = Gauge("optdrift_runs", "Runs by status", ["status"], registry=registry)
    for status, count in session.execute(select(Run.status, func.count()).group_by(Run.status)):
        runs_gauge.labels(status=status).set(count)
    verdicts_gauge = Gauge("optdrift_verdicts", "Verdicts by outcome", ["outcome", "flagged"],
                           registry=registry)
    for outcome, flagged, count in session.execute(
        select(Verdict.outcome, Verdict.flagged, func.count()).group_by(Verdict.outcome, Verdict.flagged)
    ):
        verdicts_gauge.labels(outcome=outcome, flagged=str(bool(flagged)).lower()).set(count)
    undispatched = session.scalar(
        select(func.count()).select_from(Run).where(Run.status == "queued", Run.dispatched_at.is_(None)))
    Gauge("optdrift_runs_undispatched", "Queued runs the broker has not taken yet",
          registry=registry).set(undispatched or 0)
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
