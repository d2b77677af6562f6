"""The overview shows a commit's whole name (issue 34): a 40-character sha and a longer ref-like
name appear in full (and in the link's title), and at 1280 px and on a phone they wrap inside their
cell instead of widening the page or being cut."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service.domain import projects, submissions
from tests.service_fixtures import make_archive

SHA = "0123456789abcdef0123456789abcdef01234567"
LONG_NAME = "refs/heads/feature/reorder-weight-decay-after-the-adam-update-v2"


@pytest.fixture
def overview_html(db_session, api_settings, api) -> str:  # noqa: ANN001
    project = projects.ensure(session=db_session, name="names")
    for name in (SHA, LONG_NAME):
        submissions.submit_commit(session=db_session, settings=api_settings, project=project, sha=name,
                                  parents=[], archive=make_archive({"a.cpp": name}))
    db_session.flush()
    response = api.get("/projects/names")
    assert response.status_code == 200
    return response.text


def test_the_overview_links_each_commit_by_its_whole_name(overview_html: str) -> None:
    links = dict(re.findall(r'<a class="sha commit-name" title="([^"]+)" href="[^"]+">([^<]+)</a>', overview_html))
    assert links == {SHA: SHA, LONG_NAME: LONG_NAME}


@pytest.mark.parametrize("width", [1280, 390])
def test_whole_commit_names_wrap_inside_their_cell(overview_html: str, browser, width: int) -> None:  # noqa: ANN001
    css = (Path(__file__).resolve().parents[4] / "service/dashboard/static/dashboard.css").read_text()
    html = re.sub(r'<link rel="stylesheet"[^>]*>', f"<style>{css}</style>", overview_html)
    html = re.sub(r"<script[^>]*>.*?</script>", "", html, flags=re.S)  # layout only, no polling
    context = browser.new_context(viewport={"width": width, "height": 800})
    try:
        page = context.new_page()
        page.set_content(html)
        boxes = page.locator("a.commit-name").evaluate_all(
            "links => links.map(e => ({text: e.innerText.replace(/\\s/g, ''), scroll: e.scrollWidth,"
            " client: e.clientWidth, width: e.getBoundingClientRect().width,"
            " right: e.getBoundingClientRect().right, cell: e.closest('td').getBoundingClientRect().right}))")
        assert sorted(box["text"] for box in boxes) == sorted([SHA, LONG_NAME])  # rendered whole
        by_name = {box["text"]: box for box in boxes}
        for box in boxes:
            assert box["scroll"] <= box["client"], box  # nothing clipped inside the link
            assert box["right"] <= box["cell"] + 0.5, box  # nor sticking out of its cell
        # a name longer than a sha wraps (at 42 characters, CSS .commit-name) instead of widening
        # the commits column
        assert by_name[LONG_NAME]["width"] <= by_name[SHA]["width"] * 42 / 40 + 0.5, by_name
        # on a phone the column gives way to the others (the name wraps anywhere)
        assert by_name[SHA]["width"] <= width / 2, by_name
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    finally:
        context.close()
