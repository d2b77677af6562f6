"""The FastAPI app: routers under /api/v1, health and metrics at the root, domain errors -> 4xx."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import exc as sqlalchemy_exc

from service.api import docs, maintenance
from service.api.auth import install_error_handlers, read_access
from service.api.request_guard import RequestGuard
from service.api.routes import commits, health, projects, runs, sources, verify
from service.api.routes import speed
from service.api.routes import case_history, environments, releases, training
from service.api.routes import notify as notify_routes
from service.dashboard.routes import install as install_dashboard
from service.domain.errors import BadInputError, ConflictError, NotFoundError
from service.settings import get_settings

api_router = APIRouter(prefix="/api/v1")
for module in (projects, commits, verify, runs, sources, speed, case_history, environments, releases, training):
    api_router.include_router(module.router)
api_router.include_router(notify_routes.router)  # issue 16: GitHub and webhook settings
api_router.include_router(notify_routes.events_router)  # issue 44: GitHub's deliveries (forks' PRs)


@asynccontextmanager
async def lifespan(app: FastAPI):  # noqa: ANN201
    settings = get_settings()
    stop = maintenance.start(settings) if settings.maintenance_interval_s > 0 else None
    yield
    if stop is not None:
        stop.set()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("optdrift")
    except PackageNotFoundError:
        return "0+source"


def create_app() -> FastAPI:
    app = FastAPI(
        title="optdrift",
        description="Did this commit change a training trajectory? Per-step trajectory "
                    "regression for optimizer kernels.",
        version=_version(),
        lifespan=lifespan,
        dependencies=[Depends(read_access)],
        # Swagger UI and ReDoc from packaged files (service/api/docs.py), not FastAPI's CDN.
        docs_url=None,
        redoc_url=None,
    )
    docs.install(app)
    # Token and size checks before any body is read (FastAPI parses bodies before dependencies).
    app.add_middleware(RequestGuard)
    app.include_router(api_router)
    app.include_router(health.router)
    install_dashboard(app)

    def _handler(status_code: int):  # noqa: ANN202
        async def handle(_request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse({"detail": str(exc)}, status_code=status_code)
        return handle

    app.add_exception_handler(NotFoundError, _handler(404))
    app.add_exception_handler(ConflictError, _handler(409))
    app.add_exception_handler(BadInputError, _handler(422))
    install_error_handlers(app)

    async def database_unavailable(_request: Request, exc: Exception) -> JSONResponse:
        # The database is down or restarting: say so and when to retry, rather than a bare 500.
        first_line = (str(getattr(exc, "orig", None) or exc).splitlines() or [""])[0]
        return JSONResponse(
            {"detail": f"the database is unavailable ({first_line[:200]}); retry shortly"},
            status_code=503, headers={"Retry-After": str(get_settings().database_retry_after_s)})

    app.add_exception_handler(sqlalchemy_exc.OperationalError, database_unavailable)

    async def value_out_of_range(_request: Request, exc: Exception) -> JSONResponse:
        # A value the database cannot hold (an id past 2**31, an offset past 2**63): the request's
        # fault, found by fuzzing the schema (tests/service/api/test_fuzz_api.py).
        first_line = (str(getattr(exc, "orig", None) or exc).splitlines() or [""])[0]
        return JSONResponse({"detail": f"a value in the request is out of range: {first_line[:200]}"},
                            status_code=422)

    app.add_exception_handler(sqlalchemy_exc.DataError, value_out_of_range)
    app.add_exception_handler(sqlalchemy_exc.InterfaceError, database_unavailable)
    return app
