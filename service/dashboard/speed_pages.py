"""Dashboard pages of the kernels' own speed: a run's speed table, and one kernel's history (a
plotly chart of its median over the project's runs, spread as error bars). Registered by
service/dashboard/routes.py; the numbers come from service.domain.kernel_speed, as the API's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from service.api.deps import SessionDep
from service.api.params import RunIdPath
from service.dashboard import wording
from service.domain import kernel_speed, projects, runs

templates = Jinja2Templates(directory=Path(__file__).resolve().parent / "templates")
templates.env.filters["sci"] = wording.sci
templates.env.filters["number"] = wording.number
templates.env.filters["when"] = wording.when

router = APIRouter(tags=["dashboard"], include_in_schema=False)

# The speed verdict as a badge of the dashboard's own palette (dashboard.css).
BADGES = {"slower": ("changed-farther", "slower"), "faster": ("changed-closer", "faster"),
          "same": ("unchanged", "same speed"), "no-baseline": ("neutral", "no speed baseline"),
          "not-timed": ("not-applicable", "not timed"), "error": ("error", "error")}


def badge(verdict: str) -> dict[str, str]:
    css, text = BADGES.get(verdict, ("neutral", verdict))
    return {"css": css, "text": text, "title": f"kernel speed: {verdict}"}


def speed_column(*, session: SessionDep, run_ids: list[int | None]) -> dict[int, dict[str, str]]:
    """Run id -> the speed verdict's badge, for the commit list's speed column (timed runs only)."""
    return {run_id: badge(verdict) for run_id, verdict in
            kernel_speed.verdicts_for_runs(session=session, run_ids=[r for r in run_ids if r]).items()}


def _page(request: Request, name: str, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, {"badge": badge, **context})


@router.get("/runs/{run_id}/speed", response_class=HTMLResponse)
def run_speed_page(request: Request, run_id: RunIdPath, session: SessionDep) -> HTMLResponse:
    run = runs.get(session=session, run_id=run_id)
    speed = kernel_speed.run_speed(session=session, run=run)
    return _page(request, "speed.html", run=run, project=run.project, speed=speed)


@router.get("/projects/{project}/speed", response_class=HTMLResponse)
def speed_history_page(request: Request, project: str, session: SessionDep, kernel: str | None = None,
                       param_dtype: str = "float32", size: int | None = None,
                       environment: str | None = None) -> HTMLResponse:
    found = projects.get_by_name(session=session, name=project)
    timed = kernel_speed.kernels_of_project(session=session, project_id=found.id)
    chosen = next(((k, d, s) for k, d, s in timed if k == kernel and d == param_dtype and (size is None or s == size)),
                  timed[0] if timed and kernel is None else None)
    points = (kernel_speed.history(session=session, project_id=found.id, kernel=chosen[0], param_dtype=chosen[1],
                                   size=chosen[2], environment=environment or None) if chosen else [])
    return _page(request, "speed_history.html", project=found, timed=timed, chosen=chosen, points=points,
                 asked=kernel)
