"""The API's interactive documentation, served from packaged files: Swagger UI at /docs and ReDoc
at /redoc, their scripts and styles from the installed `fastapi-offline` package under
/static/api-docs. FastAPI's own pages load them from a CDN, which leaves /docs blank on a machine
without internet access (an air-gapped GPU cluster, a CI runner, a laptop on a plane)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
from fastapi.staticfiles import StaticFiles
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

ASSETS_PREFIX = "/static/api-docs"
# The one remote URL the ReDoc bundle holds: the "API docs by Redocly" footer logo. Served with it
# replaced by an empty inline image, so an offline page asks no other host at all.
REDOC_REMOTE_LOGO = b"https://cdn.redoc.ly/redoc/logo-mini.svg"
REDOC_LOCAL_LOGO = b"data:image/svg+xml,%3Csvg xmlns='http://www.w3.org/2000/svg'/%3E"


def assets_folder() -> Path:
    """swagger-ui-bundle.js, swagger-ui.css, redoc.standalone.js, favicon.png."""
    import fastapi_offline

    return Path(fastapi_offline.__file__).resolve().parent / "static"


def install(app: FastAPI) -> None:
    """Add /docs, /docs/oauth2-redirect and /redoc. Create the app with docs_url=None and
    redoc_url=None. Plain routes, like FastAPI's own: outside the OpenAPI schema and the app's
    dependencies, so the docs show whatever OPTDRIFT_PROTECT_READS says of the API itself."""
    redoc_script: list[bytes] = []  # read on first use, then kept

    async def redoc_js(_request: Request) -> Response:
        if not redoc_script:
            redoc_script.append((assets_folder() / "redoc.standalone.js").read_bytes()
                                .replace(REDOC_REMOTE_LOGO, REDOC_LOCAL_LOGO))
        return Response(redoc_script[0], media_type="text/javascript",
                        headers={"Cache-Control": "public, max-age=3600"})

    # before the mount, so this route answers for the ReDoc script
    app.add_route(f"{ASSETS_PREFIX}/redoc-offline.js", redoc_js, include_in_schema=False)
    app.mount(ASSETS_PREFIX, StaticFiles(directory=assets_folder()), name="api-docs-static")
    favicon = f"{ASSETS_PREFIX}/favicon.png"

    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=root + app.openapi_url, title=f"{app.title} - API docs",
            oauth2_redirect_url=root + "/docs/oauth2-redirect",
            swagger_js_url=f"{root}{ASSETS_PREFIX}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{ASSETS_PREFIX}/swagger-ui.css", swagger_favicon_url=root + favicon,
            # no spec-validator badge: it would ask validator.swagger.io
            swagger_ui_parameters={"validatorUrl": None})

    async def oauth2_redirect(_request: Request) -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=root + app.openapi_url, title=f"{app.title} - API reference",
                              redoc_js_url=f"{root}{ASSETS_PREFIX}/redoc-offline.js",
                              redoc_favicon_url=root + favicon, with_google_fonts=False)

    app.add_route("/docs", swagger_ui, include_in_schema=False)
    app.add_route("/docs/oauth2-redirect", oauth2_redirect, include_in_schema=False)
    app.add_route("/redoc", redoc, include_in_schema=False)
