"""Schemathesis against the app's own OpenAPI schema, on the real PostgreSQL: whatever the fuzzer
sends (as admin, so it reaches the deepest code), the API answers without a 5xx. Bounded: a fixed
number of examples per operation, derandomized, so the whole file takes well under two minutes.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402

from service.api.main import create_app  # noqa: E402

EXAMPLES_PER_OPERATION = 20
APP = create_app()
SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", APP)


@pytest.fixture
def fuzz_app(db_session, api_settings, admin_token):
    from service.db.session import get_session
    from service.settings import get_settings

    def session_for_one_request():  # noqa: ANN202
        # Production opens a session per request; here they share the test's transaction, so a
        # request that failed in the database must not poison the next example.
        try:
            yield db_session
        except Exception:
            db_session.rollback()
            raise

    APP.dependency_overrides[get_session] = session_for_one_request
    APP.dependency_overrides[get_settings] = lambda: api_settings
    yield {"Authorization": f"Bearer {admin_token}"}
    APP.dependency_overrides.clear()


@SCHEMA.parametrize()
@settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_app) -> None:
    response = case.call(headers=fuzz_app)
    assert response.status_code < 500, (case.method, case.formatted_path, response.status_code,
                                        response.text[:500])
