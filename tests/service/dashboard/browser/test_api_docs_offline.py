"""/docs (Swagger UI) and /redoc render with the page's network limited to the service itself:
every request to another host is aborted and recorded (FastAPI's default pages load their
scripts from a CDN and stay blank offline; issue 15)."""

from __future__ import annotations

import os
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.service_fixtures import (
    API_TEST_REDIS, create_database, drop_database, free_port, start_process, stop_process, wait_http,
)

LOCAL_HOSTS = {"127.0.0.1", "localhost"}


@pytest.fixture(scope="module")
def api_url(tmp_path_factory) -> str:
    """A bare `optdrift serve --no-worker` on a fresh PostgreSQL database (migrated by serve)."""
    name = f"optdrift_docs_{os.getpid()}"
    database_url = create_database(name)
    home = tmp_path_factory.mktemp("docs-home")
    port = free_port()
    env = {"OPTDRIFT_HOME": str(home), "OPTDRIFT_DATABASE_URL": database_url,
           "OPTDRIFT_BROKER_URL": API_TEST_REDIS, "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0",
           "OPTDRIFT_PUBLIC_URL": f"http://127.0.0.1:{port}"}
    server = start_process(["serve", "--port", str(port), "--no-worker"], env, home / "serve.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=90)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_process(server)
        drop_database(name)


def offline_page(browser):  # noqa: ANN001, ANN201
    """A page whose requests to any host but this machine are aborted; returns (page, blocked)."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    blocked: list[str] = []

    def guard(route) -> None:  # noqa: ANN001
        if urlparse(route.request.url).hostname in LOCAL_HOSTS:
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort("internetdisconnected")

    context.route("**/*", guard)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    return context, page, blocked, errors


def test_swagger_ui_renders_the_api_with_the_network_off(api_url: str, browser) -> None:  # noqa: ANN001
    context, page, blocked, errors = offline_page(browser)
    try:
        page.goto(f"{api_url}/docs")
        # Swagger UI drew the spec: the title and an operation of every router
        page.wait_for_selector(".swagger-ui .info .title", timeout=20_000)
        assert "optdrift" in page.inner_text(".swagger-ui .info .title")
        paths = page.locator(".opblock-summary-path").all_inner_texts()
        assert any("/api/v1/projects/{project}/commits" in path for path in paths), paths[:10]
        assert any("/api/v1/runs/{run_id}/acknowledge" in path for path in paths), paths[:10]
        assert not blocked, f"/docs asked other hosts: {blocked}"
        assert not errors, errors
        page.screenshot(path=str(Path(os.environ.get("TMPDIR", "/tmp")) / "optdrift-docs-offline.png"))
    finally:
        context.close()


def test_redoc_renders_the_api_with_the_network_off(api_url: str, browser) -> None:  # noqa: ANN001
    context, page, blocked, errors = offline_page(browser)
    try:
        page.goto(f"{api_url}/redoc")
        # ReDoc's side menu, drawn by its script from the spec: every operation listed
        page.wait_for_selector(".menu-content", timeout=20_000)
        menu = page.inner_text(".menu-content")
        assert {"projects", "commits", "runs", "health"} <= set(menu.split()), menu[:500]
        assert "Acknowledge Run" in page.content()  # an operation, drawn (collapsed) under its tag
        page.wait_for_load_state("networkidle")  # the footer's logo and any late request too
        assert not blocked, f"/redoc asked other hosts: {blocked}"
        assert not errors, errors
    finally:
        context.close()
