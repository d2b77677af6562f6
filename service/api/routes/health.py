"""Liveness (/healthz), readiness (/readyz: the database and the broker answer) and Prometheus metrics
(/metrics), outside /api/v1 and without a token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text

from service.api.deps import SessionDep, SettingsDep
from service.api.metrics import build_registry
from service.broker.queueing import producer_app

router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz(request: Request, session: SessionDep) -> dict:
    """The process is up (it answers whether or not the database does). `version`: the optdrift
    release serving (the app's, which the OpenAPI document's info.version also gives; docs/RELEASES.md).
    `sandbox`: what each live worker reported of its sandbox and of whom its own work runs as, and
    the warnings an operator should act on (a worker running as root for want of a worker user, a
    worker without its box)."""
    return {"status": "ok", "version": request.app.version, "sandbox": sandbox_status(session)}


def sandbox_status(session) -> dict:  # noqa: ANN001
    """From the workers' presence rows (worker/gpu_workers.py `sandbox_report`): liveness must not
    depend on the database, so an unreadable one is said, not raised."""
    from service.domain import workers

    try:
        live = workers.live_workers(session=session)
    except Exception as exc:  # noqa: BLE001
        return {"workers": [], "warnings": [], "unknown": f"worker presence unreadable: {str(exc).splitlines()[0]}"}
    reports, warnings = [], []
    for row in live:
        report = (row.detail or {}).get("sandbox")
        if not isinstance(report, dict):
            continue  # a worker of an older version: it does not say
        reports.append({"worker": row.name, "environment": row.environment, **report})
        if report.get("warning"):
            warnings.append(f"{row.name}: {report['warning']}")
        if report.get("available") is False:
            warnings.append(f"{row.name}: sandbox unavailable: {report.get('what')}")
    return {"workers": reports, "warnings": warnings}


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
    """Prometheus metrics read from the database at scrape time (so every API replica agrees):
    runs and verdicts, queue depth and live workers per environment, phase-time histograms,
    cases per second, build-cache hits (service/api/metrics.py)."""
    return Response(generate_latest(build_registry(session)), media_type=CONTENT_TYPE_LATEST)
