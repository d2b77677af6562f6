"""Schemathesis against the app's own OpenAPI schema, on the real PostgreSQL and on the embedded
default's SQLite, as admin (reaches the deepest code) and as submit and verify tokens (what CI
and contributors hold): whatever the fuzzer sends, the API answers without a 5xx. Bounded: a
fixed number of examples per operation, derandomized.

Then Hypothesis strategies that build real tar.gz archives and git patches (so they get past the
gzip check and reach the member and patch rules) against the upload, commit and verify routes.
"""

from __future__ import annotations

import base64
import io
import tarfile
import zlib

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from service.api.main import create_app  # noqa: E402
from tests.service_fixtures import make_archive  # noqa: E402

EXAMPLES_PER_OPERATION = 12
APP = create_app()
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)
BACKENDS = ("postgresql", "sqlite")
CALLERS = ("admin", "submit", "verify")


@pytest.fixture
def sqlite_session(tmp_path):
    """A migrated SQLite file (the embedded default), one rolled-back transaction like db_session."""
    from sqlalchemy.orm import Session

    from service.db.migrate import upgrade_to_head
    from service.db.session import make_engine

    url = f"sqlite:///{tmp_path / 'fuzz.db'}"
    upgrade_to_head(url)
    engine = make_engine(url)
    connection = engine.connect()
    transaction = connection.begin()
    session = Session(bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False)
    yield session
    session.close()
    transaction.rollback()
    connection.close()
    engine.dispose()


def _world(session, settings) -> dict[str, str]:  # noqa: ANN001
    """Project `kern` with one commit (so verify has a base) and one token per caller."""
    from service.domain import auth, projects, submissions

    project = projects.create(session=session, name="kern")
    submissions.submit_commit(session=session, settings=settings, project=project, sha="base1",
                              parents=[], archive=make_archive({"ops.cpp": "int x = 1;\n"}))
    tokens = {}
    for caller in CALLERS:
        _, tokens[caller] = auth.create_token(session=session, name=f"fuzz-{caller}", scope=caller,
                                              project=None if caller == "admin" else "kern",
                                              daily_quota=None if caller != "verify" else 10**6)
    session.flush()
    return tokens


@pytest.fixture(params=BACKENDS)
def fuzz_app(request, api_settings, tmp_path):
    from service.db.session import get_session
    from service.settings import get_settings

    if request.param == "postgresql":
        session = request.getfixturevalue("db_session")
        settings_ = api_settings
    else:
        session = request.getfixturevalue("sqlite_session")
        settings_ = api_settings.model_copy(update={"database_url": f"sqlite:///{tmp_path / 'fuzz.db'}"})
    # Like the verify token's quota: the fuzz reaches the verify route's depths, not its cap.
    settings_ = settings_.model_copy(update={"verify_max_active_per_token": 10**6})
    tokens = _world(session, settings_)

    def session_for_one_request():  # noqa: ANN202
        # Production opens a session per request; here they share the test's transaction, so a
        # request that failed in the database must not poison the next example.
        try:
            yield session
        except Exception:
            session.rollback()
            raise

    APP.dependency_overrides[get_session] = session_for_one_request
    APP.dependency_overrides[get_settings] = lambda: settings_
    yield tokens
    APP.dependency_overrides.clear()


@pytest.mark.parametrize("caller", CALLERS)
@SCHEMA.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_app, caller) -> None:
    response = case.call(headers={"Authorization": f"Bearer {fuzz_app[caller]}"})
    assert response.status_code < 500, (case.method, case.formatted_path, response.status_code,
                                        response.text[:500])


# ----------------------------------------------------------------------------- archives, patches
_NAME_PART = st.one_of(
    st.sampled_from(["a", "b", "ops.cpp", "..", ".", "", "x" * 300, "caf\udce9", "a\\b", "C:"]),
    st.text(min_size=1, max_size=12))
_MEMBER = st.tuples(
    st.lists(_NAME_PART, min_size=1, max_size=6).map("/".join),
    st.sampled_from([tarfile.REGTYPE, tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE,
                     tarfile.FIFOTYPE, tarfile.CHRTYPE]),
    st.binary(max_size=64), st.sampled_from([0o644, 0o755, 0o4755]))


def _archive(members, fmt: int) -> bytes:  # noqa: ANN001
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=fmt, encoding="utf-8",
                      errors="surrogateescape") as tar:
        for name, kind, data, mode in members:
            info = tarfile.TarInfo(name)
            info.type, info.mode = kind, mode
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = "../../etc/passwd"
            if kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buffer.getvalue()


ARCHIVES = st.builds(_archive, st.lists(_MEMBER, min_size=1, max_size=6),
                     st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))


def _git85(data: bytes) -> bytes:
    lines = []
    for offset in range(0, len(data), 52):
        piece = data[offset:offset + 52]
        size_char = chr(ord("A") + len(piece) - 1) if len(piece) <= 26 else chr(ord("a") + len(piece) - 27)
        lines.append(size_char.encode() + base64.b85encode(piece + b"\0" * (-len(piece) % 4)))
    return b"\n".join(lines)


@st.composite
def patches(draw) -> bytes:  # noqa: ANN001
    path = draw(st.sampled_from(["ops.cpp", "new.bin", "../escape", "/abs", "a/b/c.cpp", "ops.cpp/x"]))
    if draw(st.booleans()):
        content = draw(st.binary(max_size=256))
        declared = draw(st.one_of(st.just(len(content)), st.integers(0, 2**40)))
        kind = draw(st.sampled_from(["literal", "delta"]))
        body = _git85(zlib.compress(content)) if content or draw(st.booleans()) else b""
        return (f"diff --git a/{path} b/{path}\nnew file mode 100644\nindex 0000000..1111111\n"
                f"GIT binary patch\n{kind} {declared}\n").encode() + body + b"\n\nliteral 0\nHcmV?d00001\n\n"
    old = draw(st.sampled_from(["int x = 1;", "nothing", ""]))
    new = draw(st.text(max_size=40)).replace("\n", " ")
    return f"--- a/{path}\n+++ b/{path}\n@@ -1 +1 @@\n-{old}\n+{new}\n".encode()


@pytest.fixture
def upload_client(fuzz_app):
    from fastapi.testclient import TestClient

    return TestClient(APP, raise_server_exceptions=False), fuzz_app


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(archive=ARCHIVES, patch=patches(), caller=st.sampled_from(CALLERS))
def test_generated_archives_and_patches_never_5xx(upload_client, archive, patch, caller) -> None:
    client, tokens = upload_client
    headers = {"Authorization": f"Bearer {tokens[caller]}"}
    files = {"archive": ("s.tar.gz", archive, "application/gzip")}
    answers = [
        client.post("/api/v1/sources", headers=headers, files=files),
        client.post("/api/v1/projects/kern/commits", headers=headers, data={"sha": "fz"}, files=files),
        client.post("/api/v1/projects/kern/verify", headers=headers, data={"base": "base1"}, files=files),
        client.post("/api/v1/projects/kern/verify", headers=headers, data={"base": "base1"},
                    files={"patch": ("p.diff", patch)}),
    ]
    for response in answers:
        assert response.status_code < 500, (response.request.url, response.status_code, response.text[:500])
