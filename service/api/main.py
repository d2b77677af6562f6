"""The FastAPI app: routers under /api/v1, health and metrics at the root, domain errors -> 4xx."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse

from service.api import maintenance
from service.api.routes import commits, health, projects, runs, sources, verify
from service.dashboard.routes import install as install_dashboard
from service.domain.errors import BadInputError, ConflictError, NotFoundError
from service.settings import get_settings

api_router = APIRouter(prefix="/api/v1")
for module in (projects, commits, verify, runs, sources):
    api_router.include_router(module.router)


@asynccontextmanager
async def lifespan(app: FastAPI):  # noqa: ANN201
    settings = get_settings()
    stop = maintenance.start(settings) if settings.maintenance_interval_s > 0 else None
    yield
    if stop is not None:
        stop.set()


def create_app() -> FastAPI:
    app = FastAPI(
        title="optdrift",
        description="Did this commit change a training trajectory? Per-step trajectory "
                    "regression for optimizer kernels.",
        version="0.1.0",
        lifespan=lifespan,
    )
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
    return app
