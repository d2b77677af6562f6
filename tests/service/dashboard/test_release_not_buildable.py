"""A release whose tree refuses the worker's toolchain on the release drift page and in the matrix API
(issue 47): its column reads "not buildable here: <the tree's line>" with `status: not_buildable` and
the line as `reason`, each of its cells says "not buildable here" — never "no data" with no word of
why, never "broken". Real rows in PostgreSQL: the seeded five releases of release_seed.py plus a
release whose run failed as worker/jobs/run.py fails a refused build (service.core.not_buildable's
sentence as the run's error)."""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone

from markupsafe import escape

from service.core import not_buildable
from tests.service.dashboard import release_seed as s

URL = f"/api/v1/projects/{s.PROJECT}/releases/matrix"
PAGE = f"/projects/{s.PROJECT}/releases"
REFUSED_TAG = "v1.12.0"
# What a tree wrote may be anything: markup, quotes and an ampersand must reach the page as text.
HOSTILE_LINE = 'CUDA Version > 12 is not supported <script>alert("x")</script> & \'quoted\' <b>bold</b>'
# The build's later lines (CMake's call stack) are not the reason.
ERROR = not_buildable.sentence(s.ENVIRONMENT, HOSTILE_LINE) + "\nCall Stack (most recent call first):\n  x.cmake:3"


def _add_release(session, *, project_name: str, tag: str, sha: str, error: str, environment: str = s.ENVIRONMENT,
                 hours: int = 10) -> int:  # noqa: ANN001
    """A release commit whose one run failed with `error` (as worker/jobs/run.py stores a failed build)."""
    from sqlalchemy import select

    from service.db.models import FAILED, Commit, Project, Run, SourceArchive

    project = session.scalar(select(Project).where(Project.name == project_name))
    if project is None:
        project = Project(name=project_name, environments=[environment])
        session.add(project)
        session.flush()
    at = datetime(2026, 3, 2, 9, 0, tzinfo=timezone.utc) + timedelta(hours=hours)
    digest = hashlib.sha256(f"{project_name}/{sha}".encode()).hexdigest()
    session.add(SourceArchive(digest=digest, size_bytes=1, member_count=1, created_at=at))
    session.flush()
    commit = Commit(project_id=project.id, sha=sha, parents=[], ref="main", release_tag=tag,
                    message=f"release {tag}", source_digest=digest, created_at=at)
    session.add(commit)
    session.flush()
    run = Run(project_id=project.id, commit_id=commit.id, source_digest=digest, battery=s.REQUESTED_BATTERY,
              battery_hash="h", environment=environment, environment_detail={"battery": s.RAN_BATTERY,
                                                                              "build_ok": False},
              status=FAILED, attempt=1, worker="w@localhost", created_at=at, dispatched_at=at, started_at=at,
              heartbeat_at=at, finished_at=at + timedelta(minutes=1), cases_total=None, cases_done=0,
              build_cached=False, error=error, build_log="CMake Error at CMakeLists.txt:12 (message):\n")
    session.add(run)
    session.flush()
    session.expire_all()
    return run.id


def test_a_refused_release_is_its_own_column_status_with_the_trees_line(api, db_session) -> None:  # noqa: ANN001
    s.seed(db_session)
    _add_release(db_session, project_name=s.PROJECT, tag=REFUSED_TAG, sha="c1120", error=ERROR)
    response = api.get(URL)
    assert response.status_code == 200, response.text
    matrix = response.json()
    columns = {column["tag"]: column for column in matrix["releases"]}
    refused = columns[REFUSED_TAG]
    assert refused["status"] == "not_buildable" and refused["run_id"] is None
    assert refused["reason"] == HOSTILE_LINE  # the tree's line, its first line only
    assert refused["no_data"] == f"not buildable here: {HOSTILE_LINE}"
    # The release that failed for another reason is still a failed build, and the others have data.
    assert columns["v1.11.0"]["status"] == "no_data"
    assert columns["v1.11.0"]["no_data"] == f"build failed in {s.ENVIRONMENT}: {s.BUILD_ERROR}"
    assert {columns[tag]["status"] for tag in s.VERSION_ORDER[:4]} == {"data"}
    assert all(columns[tag]["reason"] is None for tag in s.VERSION_ORDER)
    for row in matrix["rows"]:
        cell = next(cell for cell in row["cells"] if cell["release"] == REFUSED_TAG)
        assert cell["state"] == "not-buildable" and cell["intensity"] == 0, cell
        assert cell["note"] == f"not buildable here: {HOSTILE_LINE}"
        assert cell["kind"] is None and cell["broken"] == 0

    page = api.get(PAGE)
    assert page.status_code == 200
    text = page.text
    # The column's head says why, escaped; the tree's markup never reaches the page as markup.
    assert f"not buildable here: {escape(HOSTILE_LINE)}" in text  # Jinja's escaping
    assert "<script>alert" not in text and "<b>bold</b>" not in text
    assert "Call Stack" not in text
    head = text[text.index(f'data-release="{REFUSED_TAG}"'):]
    head = head[:head.index("</th>")]
    assert "no data" not in head and "✗" not in head and "badge-broken" not in head
    cells = [part[:part.index("</td>")] for part in text.split("<td ")[1:] if f'data-release="{REFUSED_TAG}"' in part[:200]]
    assert len(cells) == len(matrix["rows"]) > 0
    for cell in cells:
        assert 'data-state="not-buildable"' in cell and ">not buildable here</span>" in cell
        assert "no data" not in cell and "✗" not in cell and "broken" not in cell


def test_a_project_whose_only_release_is_refused_still_says_why(api, db_session) -> None:  # noqa: ANN001
    # No release has a done run anywhere: no environment has data, yet the column is explained.
    _add_release(db_session, project_name="old-bnb", tag="0.47.0", sha="b047",
                 error=not_buildable.sentence("gpu.sm90", "CUDA Version > 12 is not supported"),
                 environment="gpu.sm90")
    matrix = api.get("/api/v1/projects/old-bnb/releases/matrix").json()
    assert matrix["environment"] == "gpu.sm90"
    [column] = matrix["releases"]
    assert (column["status"], column["reason"]) == ("not_buildable", "CUDA Version > 12 is not supported")
    page = api.get("/projects/old-bnb/releases").text
    assert "not buildable here: CUDA Version &gt; 12 is not supported" in page


def test_a_build_failure_that_is_no_refusal_stays_a_failed_build(api, db_session) -> None:  # noqa: ANN001
    # The sentence's words elsewhere in an error are not a refusal: only the run's error that is the sentence.
    _add_release(db_session, project_name="other", tag="1.0.0", sha="o100",
                 error="build failed: not buildable in cpu: says the log of another tool")
    [column] = api.get("/api/v1/projects/other/releases/matrix").json()["releases"]
    assert column["status"] == "no_data" and column["reason"] is None
    assert column["no_data"].startswith("build failed in cpu")


def test_the_refused_runs_own_page_says_not_buildable_here(api, db_session) -> None:  # noqa: ANN001
    run_id = _add_release(db_session, project_name="refusing", tag="0.47.0", sha="r047", error=ERROR)
    page = api.get(f"/runs/{run_id}").text
    sentence = page[page.index('id="verdict-sentence"'):].split("</p>", 1)[0]
    assert f"Not buildable here: {escape(HOSTILE_LINE)}. This tree refuses the toolchain of {s.ENVIRONMENT}" \
        in sentence
    assert "The run failed" not in sentence and "<script>alert" not in page
    # Its badge says so too, never "broken" (the tree is not broken: it does not support this toolchain).
    badge = page[page.index('class="badge'):].split("</span>", 1)[0]
    assert badge.endswith(">not buildable here") and "badge-broken" not in badge, badge
