"""Dashboard pages (server-rendered Jinja2) and the small JSON endpoint their charts fetch.

Pages: `/` (projects), `/projects/{name}` (commits newest first), `/projects/{name}/commits/{sha}`
(a commit's run), `/runs/{id}` (any run, verify runs included: the shareable page),
`/projects/{name}/releases` (release drift). Charts are drawn by plotly.js, served from the
installed `plotly` package at /static/vendor/plotly.min.js (no CDN).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from service.api.deps import SessionDep, SettingsDep
from service.api.params import Page, RunIdPath, RunIdQuery
from service.api.schemas import BuildProgress
from service.dashboard import release_matrix, speed_pages, training_panel, wording
from service.dashboard import commit_page as commit_page_figures  # the route below is also named commit_page
from service.db.models import FINAL_STATUSES
from service.core import attribution_view
from service.core.case_names import case_name
from service.domain import environment_matrix, project_configuration, runs, training_impacts, workers
from service.domain import dashboard_queries as queries
from service.domain.errors import NotFoundError

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.filters["sci"] = wording.sci
templates.env.filters["number"] = wording.number
templates.env.filters["when"] = wording.when
templates.env.filters["shown"] = wording.shown
templates.env.filters["without_paths"] = wording.without_paths
templates.env.filters["unbroken_words"] = wording.unbroken_words
templates.env.filters["case_name"] = case_name
templates.env.globals["not_judged"] = wording.not_judged
templates.env.globals["group_label"] = release_matrix.group_label
templates.env.globals["sparkline"] = release_matrix.sparkline_points
templates.env.globals["training_badge"] = training_panel.verdict_badge

router = APIRouter(tags=["dashboard"], include_in_schema=False)


def _page(request: Request, name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, name, context, status_code=status_code)


@router.get("/", response_class=HTMLResponse)
def projects_page(request: Request, session: SessionDep) -> HTMLResponse:
    projects = queries.list_projects(session=session)
    if len(projects) == 1:
        return RedirectResponse(f"/projects/{projects[0][0].name}", status_code=307)
    return _page(request, "projects.html", projects=projects)


@router.get("/projects/{project}", response_class=HTMLResponse)
def overview_page(request: Request, project: str, session: SessionDep, settings: SettingsDep,
                  ref: Annotated[str | None, Query(max_length=255)] = None, verdict: str | None = None,
                  page: Page = 1) -> HTMLResponse:
    data = queries.overview(session=session, project_name=project, ref=ref or None,
                            verdict=verdict or None, page=page)
    configuration = project_configuration.effective(session=session, settings=settings, project=data.project)
    return _page(request, "overview.html", data=data, project=data.project, configuration=configuration,
                 verdict_filters=queries.VERDICT_FILTERS,
                 speeds=speed_pages.speed_column(session=session, run_ids=[row.run_id for row in data.rows]))


@router.get("/projects/{project}/commits/{sha}", response_class=HTMLResponse)
def commit_page(request: Request, project: str, sha: str, session: SessionDep,
                run: RunIdQuery = None, cases_page: Page = 1) -> HTMLResponse:
    run_id = queries.commit_run_id(session=session, project_name=project, sha=sha, run_id=run)
    return _run_page(request, session, run_id, cases_page)


@router.get("/runs/{run_id}", response_class=HTMLResponse)
def run_page(request: Request, run_id: RunIdPath, session: SessionDep, cases_page: Page = 1) -> HTMLResponse:
    return _run_page(request, session, run_id, cases_page)


def _cases_page_url(request: Request, number: int) -> str:
    """This page's URL showing case page `number` (other query parameters kept: a commit page's `run`)."""
    return f"{request.url.path}?{request.url.include_query_params(cases_page=number).query}"


def _run_page(request: Request, session: SessionDep, run_id: int, cases_page: int = 1) -> HTMLResponse:
    # The case tables are paged (queries.RUN_PAGE_CASES rows each): no page grows with the case count.
    data = queries.run_page(session=session, run_id=run_id, cases_page=cases_page)
    attribution_view.order_by_relative_change(data.changed, data.run.verdict.detail if data.run.verdict else None)
    fingerprint = (data.run.environment_detail or {}).get("fingerprint") or {}
    # The adapter's describe() as the kernel host reported it ({"adapter", "module", "version"...});
    # a run from before it was recorded has only the adapter's name.
    adapter = (data.run.environment_detail or {}).get("adapter")
    adapter = adapter if isinstance(adapter, dict) else ({"adapter": adapter} if adapter else {})
    first_plot = data.changed[0].case_id if data.changed and data.changed[0].verdict == "changed" else None
    attribution = _attribution(data.run)
    multiples = _small_multiples(session, data, attribution["attribution"])
    return _page(request, "run.html", page=data, run=data.run, project=data.run.project,
                 sentence=wording.verdict_sentence(data), fingerprint=fingerprint, adapter=adapter,
                 **attribution, build_line=wording.build_line(data.run.environment_detail),
                 multiples=multiples,
                 multiples_json=multiples.as_json(),
                 first_plot=first_plot, final=data.run.status in FINAL_STATUSES,
                 build_progress=BuildProgress.of(runs.build_progress_of(data.run)),
                 # why a queued run is not starting (no live worker serves its environment), as the API says
                 waiting_for=workers.waiting_for(session=session, run=data.run),
                 figures=commit_page_figures.headline_figures(data.run),
                 training=training_panel.section(
                     training_impacts.latest_for_run(session=session, run_id=data.run.id),
                     changed=data.verdict is not None and data.figures.changed > 0),
                 next_cases_url=_cases_page_url(request, cases_page + 1) if data.more_cases else None,
                 previous_cases_url=_cases_page_url(request, cases_page - 1) if cases_page > 1 else None)


def _small_multiples(session: SessionDep, data, attribution: dict):  # noqa: ANN001, ANN202
    """The panels above the fold (service/dashboard/commit_page.py), their series made JSON-safe."""
    detail = data.run.verdict.detail if data.run.verdict is not None else {}
    stored = {c["case_id"]: c.get("max_abs_diff_per_step") for c in (detail or {}).get("cases", [])}

    def diffs(case_id: str) -> list[float | None] | None:
        values = stored.get(case_id)
        return [_finite_or_none(float(v)) if v is not None else None for v in values] if values else None

    baseline_run_id = queries.baseline_run_of(session=session, run_id=data.run.id)

    def distance_change(case_id: str) -> list[float | None] | None:
        if baseline_run_id is None:
            return None
        pair = queries.reference_distances(session=session, run_id=data.run.id, baseline_run_id=baseline_run_id,
                                           case_id=case_id)
        if pair is None:
            return None
        return [_finite_or_none(abs(float(a) - float(b))) for a, b in zip(*pair)]

    return commit_page_figures.small_multiples(data.changed, attribution, diffs, distance_change)


def _attribution(run) -> dict:  # noqa: ANN001
    """Issue 17: per changed case what kind of change it is, and the run's line (after the co-run)."""
    detail = run.verdict.detail if run.verdict is not None else None
    return {"attribution": attribution_view.by_case(detail), "attribution_summary": attribution_view.headline(detail),
            "attribution_error": attribution_view.attribution_error(detail)}


@router.get("/projects/{project}/releases", response_class=HTMLResponse)
def releases_page(request: Request, project: str, session: SessionDep, environment: str | None = None,
                  battery: str | None = None, group: str | None = None,
                  releases: Annotated[list[str] | None, Query()] = None) -> HTMLResponse:
    """The release matrix of /api/v1/projects/{project}/releases/matrix, rendered: the same figures."""
    matrix = release_matrix.build(session=session, project_name=project, environment=environment or None,
                                  battery=battery or None, only=[tag for tag in releases or () if tag] or None)
    labels = [row.label for row in matrix.rows]
    chosen = group if group in labels else (labels[0] if labels else None)
    # The line plot's traces: per case its name (the hash only in the hover) and its finals.
    lines = {row.label: [{"name": line.name, "case_id": line.case_id, "values": line.finals} for line in row.cases]
             for row in matrix.rows}
    return _page(request, "releases.html", matrix=matrix, project=queries.get_project(
        session=session, name=project), chosen_group=chosen, lines=lines)


@router.get("/projects/{project}/environments", response_class=HTMLResponse)
def environments_page(request: Request, project: str, session: SessionDep, reference: str | None = None) -> HTMLResponse:
    row = queries.get_project(session=session, name=project)
    return _page(request, "environments.html", project=row,
                 matrix=environment_matrix.matrix(session=session, project=row, reference=reference or None))


@router.get("/projects/{project}/case-history", response_class=HTMLResponse)
def case_history_page(request: Request, project: str, case: str, session: SessionDep,
                      environment: str | None = None,
                      ref: Annotated[str | None, Query(max_length=255)] = None) -> HTMLResponse:
    """One case along a line of commits (service/domain/case_history.py); the chart reads the same
    JSON as /api/v1/projects/{project}/case-history."""
    from service.domain import case_history

    history = case_history.case_history(session=session, project_name=project, case_id=case,
                                        environment=environment or None, ref=ref or None)
    return _page(request, "case_history.html", history=history, chart=case_history.as_json(history),
                 project=queries.get_project(session=session, name=project))


def _finite_or_none(value: float | None) -> float | None:
    # JSON has no NaN/Infinity; a gap in the line says "no finite value here".
    return value if value is not None and math.isfinite(value) else None


@router.get("/dashboard/api/runs/{run_id}/series")
def case_series(run_id: RunIdPath, case: str, session: SessionDep) -> JSONResponse:
    """Per-step series of one case for the run and its baseline (what the run page plots)."""
    data = queries.case_series(session=session, run_id=run_id, case_id=case)
    for key in ("commit", "baseline"):
        if data[key] is not None:
            data[key] = {name: [_finite_or_none(float(v)) for v in values] for name, values in data[key].items()}
    if data["max_abs_diff_per_step"] is not None:
        data["max_abs_diff_per_step"] = [_finite_or_none(float(v)) for v in data["max_abs_diff_per_step"]]
    return JSONResponse(data)


def _plotly_path() -> Path:
    # Locate the package without importing it (plotly's Python side is not needed, only its JS).
    spec = importlib.util.find_spec("plotly")
    folders = list(spec.submodule_search_locations or []) if spec else []
    path = Path(folders[0] if folders else "plotly") / "package_data" / "plotly.min.js"
    if not path.exists():
        raise NotFoundError(f"{path} is missing: reinstall the server extra (pip install 'optdrift[server]')")
    return path


@router.get("/static/vendor/plotly.min.js")
def plotly_js() -> FileResponse:
    return FileResponse(_plotly_path(), media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=86400"})


def install(app: FastAPI) -> None:
    """Mount the dashboard pages and their static files on the API app."""
    app.include_router(router)
    app.include_router(speed_pages.router)  # the kernels' own speed: run table, per-kernel history
    app.mount("/static/dashboard", StaticFiles(directory=HERE / "static"), name="dashboard-static")
