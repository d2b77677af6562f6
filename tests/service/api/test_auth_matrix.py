"""Every route of the app x every kind of caller, against the real PostgreSQL.

Callers: an admin token, submit, verify and maintain tokens for the project under test, a submit
and a maintain token for another project, a worker token, and four that must get 401 on a protected route: no token, an
unknown token, an expired admin token, a revoked admin token. Each answer is checked against the
policy below: allowed -> neither 401/403 nor 5xx (a 404/409/422 for a request that makes no sense
is fine: the request got past authorisation); a valid token without the scope -> 403; an invalid
or missing token -> 401 with `WWW-Authenticate: Bearer`. Run once with public reads (the default)
and once with OPTDRIFT_PROTECT_READS.

A route added to the app without a line in POLICY fails this test: new endpoints must say who may
call them.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.routing import APIRoute

from tests.service_fixtures import make_archive

ANY_VALID = {"admin", "submit", "submit-other", "verify", "worker", "maintain", "maintain-other"}
PUBLIC = "public"  # a read: anyone, or with protect_reads any valid token
ALWAYS_PUBLIC = "always-public"  # probes: anyone, always
# GitHub's webhook deliveries: no token opens them, only X-Hub-Signature-256 (none of the callers
# here signs): 401 for every caller (tests/service/notify/test_fork_pull_requests.py signs).
GITHUB_SIGNED = "github-signed"

# (method, path template) -> the callers allowed (beyond admin, who may do everything).
POLICY: dict[tuple[str, str], set[str] | str] = {
    ("GET", "/api/v1/projects"): PUBLIC,
    ("POST", "/api/v1/projects"): {"admin"},
    ("GET", "/api/v1/projects/{project}"): PUBLIC,
    ("PATCH", "/api/v1/projects/{project}"): {"admin"},
    ("GET", "/api/v1/projects/{project}/environment-comparison"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/environment-matrix"): PUBLIC,
    ("GET", "/projects/{project}/environments"): PUBLIC,
    ("POST", "/api/v1/projects/{project}/commits"): {"admin", "submit"},
    ("GET", "/api/v1/projects/{project}/commits"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/commits/{sha}"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/commits/{sha}/verdicts"): PUBLIC,
    # acknowledging a change: a maintainer of the project (issue 44), no admin rights needed
    ("POST", "/api/v1/projects/{project}/commits/{sha}/acknowledge"): {"admin", "maintain"},
    ("GET", "/api/v1/projects/{project}/verdicts"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/releases"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/releases/matrix"): PUBLIC,
    ("POST", "/api/v1/projects/{project}/verify"): {"admin", "submit", "verify"},
    ("GET", "/api/v1/runs/{run_id}"): PUBLIC,
    ("GET", "/api/v1/runs/{run_id}/log"): PUBLIC,
    ("POST", "/api/v1/runs/{run_id}/cancel"): {"admin", "submit"},
    ("POST", "/api/v1/runs/{run_id}/retry"): {"admin", "submit"},
    ("POST", "/api/v1/runs/{run_id}/acknowledge"): {"admin", "maintain"},
    ("GET", "/api/v1/runs/{run_id}/cases"): PUBLIC,
    ("GET", "/api/v1/runs/{run_id}/trajectories"): PUBLIC,
    ("GET", "/api/v1/runs/{run_id}/trajectories.csv"): PUBLIC,
    ("GET", "/api/v1/runs/{run_id}/trajectories/{case_id}"): PUBLIC,
    # training impact (issue 46): read like a run's results; asked for by who may submit (a verify
    # token only for its own verify runs, which this run is not: tests/service/api/test_training_api.py)
    ("GET", "/api/v1/runs/{run_id}/training"): PUBLIC,
    ("POST", "/api/v1/runs/{run_id}/training"): {"admin", "submit"},
    ("GET", "/api/v1/training/{job_id}"): PUBLIC,
    # uploading to the store: any submit token (the digest is then used in a project's commit)
    ("POST", "/api/v1/sources"): {"admin", "submit", "submit-other"},
    # source code is more private than results: workers only, even with public reads
    ("GET", "/api/v1/sources/{digest}"): {"admin", "worker"},
    ("GET", "/healthz"): ALWAYS_PUBLIC,
    ("GET", "/readyz"): ALWAYS_PUBLIC,
    ("GET", "/metrics"): PUBLIC,
    # dashboard pages (not in the OpenAPI schema, walked all the same)
    ("GET", "/"): PUBLIC,
    ("GET", "/projects/{project}"): PUBLIC,
    ("GET", "/projects/{project}/commits/{sha}"): PUBLIC,
    ("GET", "/runs/{run_id}"): PUBLIC,
    ("GET", "/projects/{project}/releases"): PUBLIC,
    ("GET", "/dashboard/api/runs/{run_id}/series"): PUBLIC,
    ("GET", "/static/vendor/plotly.min.js"): ALWAYS_PUBLIC,
    # results read like the rest of a run's results: the kernels' speed (issue 18), a case's
    # history across commits (issue 16)
    ("GET", "/api/v1/runs/{run_id}/speed"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/speed/history"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/speed/kernels"): PUBLIC,
    ("GET", "/api/v1/projects/{project}/case-history"): PUBLIC,
    ("GET", "/projects/{project}/case-history"): PUBLIC,
    ("GET", "/runs/{run_id}/speed"): PUBLIC,
    ("GET", "/projects/{project}/speed"): PUBLIC,
    # notifications (issue 16): the settings hold credentials, so admin only, reads included
    ("PUT", "/api/v1/projects/{project}/github"): {"admin"},
    ("GET", "/api/v1/projects/{project}/github"): {"admin"},
    ("DELETE", "/api/v1/projects/{project}/github"): {"admin"},
    ("POST", "/api/v1/projects/{project}/webhooks"): {"admin"},
    ("GET", "/api/v1/projects/{project}/webhooks"): {"admin"},
    ("DELETE", "/api/v1/projects/{project}/webhooks/{webhook_id}"): {"admin"},
    ("GET", "/api/v1/projects/{project}/webhooks/{webhook_id}/deliveries"): {"admin"},
    # issue 44: pull requests from forks, verified on GitHub's signed pull_request event
    ("POST", "/api/v1/github/events"): GITHUB_SIGNED,
}
INVALID_CALLERS = ("none", "wrong", "expired", "revoked")


@pytest.fixture
def world(db_session, api_settings):
    """Projects alpha (under test) and beta, a commit of alpha with a run, and one token of each
    kind; yields (make_client, context)."""
    from fastapi.testclient import TestClient

    from service.api.main import create_app
    from service.db.base import utcnow
    from service.db.session import get_session
    from service.domain import auth, projects, submissions
    from service.settings import get_settings

    for name in ("alpha", "beta"):
        projects.create(session=db_session, name=name)
    alpha = projects.get_by_name(session=db_session, name="alpha")
    archive = make_archive({"ops.cpp": "// alpha\n"})
    submission = submissions.submit_commit(session=db_session, settings=api_settings, project=alpha,
                                           sha="a" * 40, parents=[], archive=archive)
    db_session.flush()
    tokens = {}
    for caller, scope, project in (("admin", "admin", None), ("submit", "submit", "alpha"),
                                   ("submit-other", "submit", "beta"), ("verify", "verify", "alpha"),
                                   ("worker", "worker", None), ("maintain", "maintain", "alpha"),
                                   ("maintain-other", "maintain", "beta"), ("expired", "admin", None),
                                   ("revoked", "admin", None)):
        row, tokens[caller] = auth.create_token(session=db_session, name=caller, scope=scope,
                                                project=project)
        if caller == "expired":
            row.expires_at = utcnow() - timedelta(seconds=1)
        if caller == "revoked":
            auth.revoke(session=db_session, token_id=row.id)
    tokens["wrong"] = "odt_" + "x" * 43
    tokens["none"] = None
    db_session.flush()

    app = create_app()
    app.dependency_overrides[get_session] = lambda: db_session
    context = {"project": "alpha", "sha": "a" * 40, "run_id": str(submission.runs[0].id),
               "digest": submission.commit.source_digest, "case_id": "no-such-case",
               "archive": archive, "tokens": tokens}

    def make_client(settings):
        app.dependency_overrides[get_settings] = lambda: settings
        return TestClient(app, raise_server_exceptions=False)

    return make_client, context


def _request(client, method: str, template: str, context: dict, token: str | None, serial: int):
    path = template
    for key in ("project", "sha", "run_id", "digest", "case_id"):
        path = path.replace("{" + key + "}", context[key])
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    archive = ("s.tar.gz", make_archive({"ops.cpp": f"// change {serial}\n"}), "application/gzip")
    path = path.replace("{webhook_id}", "1").replace("{job_id}", "1")
    if method == "GET":
        return client.get(path, headers=headers)
    if template == "/api/v1/projects":
        return client.post(path, headers=headers, json={"name": f"new-{serial}"})
    if template.endswith("/training"):
        return client.post(path, headers=headers, json={})
    if template.endswith("/acknowledge"):
        return client.post(path, headers=headers, json={"note": "intended", "by": "test"})
    if template.endswith("/commits"):
        return client.post(path, headers=headers, data={"sha": f"{serial:040x}"}, files={"archive": archive})
    if template.endswith("/verify"):
        return client.post(path, headers=headers, data={"base": context["sha"]}, files={"archive": archive})
    if template == "/api/v1/sources":
        return client.post(path, headers=headers, files={"archive": archive})
    if method == "PATCH":  # a project's registered fields
        return client.patch(path, headers=headers, json={"default_battery": "quick"})
    if method in ("PUT", "DELETE"):  # notification settings (issue 16); webhook 1 may not exist: 404
        body = {"repository": "octo/kernels", "token": "ghp_matrix0123456789"} if method == "PUT" else None
        return client.request(method, path, headers=headers, json=body)
    return client.post(path, headers=headers)


def _routes(app) -> list[tuple[str, str]]:
    """Every (method, full path) of the app's API routes, walking included routers (FastAPI keeps
    an included router as a node with its own prefix)."""
    found: list[tuple[str, str]] = []

    def walk(routes, prefix: str) -> None:  # noqa: ANN001
        for route in routes:
            if isinstance(route, APIRoute):
                found.extend((m, prefix + route.path) for m in sorted(route.methods - {"HEAD"}))
            elif hasattr(route, "original_router"):
                walk(route.original_router.routes, prefix + route.include_context.prefix)

    walk(app.routes, "")
    return found


@pytest.mark.parametrize("protect_reads", [False, True], ids=["public-reads", "protected-reads"])
def test_every_route_times_every_caller(world, api_settings, protect_reads: bool) -> None:
    make_client, context = world
    settings = api_settings.model_copy(update={"protect_reads": protect_reads})
    client = make_client(settings)
    app_routes = _routes(client.app)
    schema_routes = {(m.upper(), p) for p, item in client.app.openapi()["paths"].items() for m in item}
    assert schema_routes <= set(app_routes)
    missing = [route for route in app_routes if route not in POLICY]
    assert not missing, f"routes without an authorisation policy in this test: {missing}"

    failures = []
    checked = 0
    for serial, (method, template) in enumerate(app_routes):
        policy = POLICY[(method, template)]
        for caller in (*sorted(ANY_VALID), *INVALID_CALLERS):
            response = _request(client, method, template, context, context["tokens"][caller],
                                serial * 100 + checked)
            checked += 1
            if policy == GITHUB_SIGNED:  # even an admin token is no signature
                allowed, expected_denial = False, 401
            elif policy == ALWAYS_PUBLIC or (policy == PUBLIC and not protect_reads):
                allowed, expected_denial = True, None
            elif policy == PUBLIC:
                allowed = caller in ANY_VALID
                expected_denial = 401
            else:
                allowed = caller in policy
                expected_denial = 403 if caller in ANY_VALID else 401
            status = response.status_code
            if allowed:
                ok = status not in (401, 403) and status < 500
            else:
                ok = status == expected_denial and (
                    status != 401 or policy == GITHUB_SIGNED or response.headers.get("www-authenticate") == "Bearer")
            if not ok:
                failures.append(f"{method} {template} as {caller}: {status} "
                                f"(expected {'allowed' if allowed else expected_denial}) "
                                f"{response.text[:160]}")
    assert not failures, "\n".join(failures)
    assert checked == len(app_routes) * (len(ANY_VALID) + len(INVALID_CALLERS))


def test_verify_quota_per_utc_day(world, api_settings, db_session) -> None:
    """A verify token with a quota of 2: two runs, the third is 429 with Retry-After; a repeated
    idempotent request does not spend quota; admin is not metered."""
    from service.domain import auth

    make_client, context = world
    # The daily quota under test, not the cap on runs waiting at once (test_verify_fairness.py).
    client = make_client(api_settings.model_copy(update={"verify_max_active_per_token": 3}))
    _, token = auth.create_token(session=db_session, name="contrib", scope="verify", project="alpha",
                                 daily_quota=2)
    headers = {"Authorization": f"Bearer {token}"}

    def verify(serial: int, key: str | None = None, token_headers=headers):
        return client.post("/api/v1/projects/alpha/verify",
                           headers={**token_headers, **({"Idempotency-Key": key} if key else {})},
                           data={"base": context["sha"]},
                           files={"archive": ("s.tar.gz", make_archive({"a.cpp": f"// {serial}\n"}))})

    assert verify(1, key="k1").status_code == 201
    assert verify(1, key="k1").status_code == 200  # the same request again: no new run
    assert verify(2).status_code == 201
    refused = verify(3)
    assert refused.status_code == 429, refused.text
    assert 0 < int(refused.headers["retry-after"]) <= 86400
    assert "resets at" in refused.json()["detail"]
    admin = {"Authorization": f"Bearer {context['tokens']['admin']}"}
    assert verify(4, token_headers=admin).status_code == 201
    # beta is not this token's project
    other = client.post("/api/v1/projects/beta/verify", headers=headers, data={"base": "x"})
    assert other.status_code == 403


def test_tokens_are_stored_hashed_and_shown_once(db_session) -> None:
    from sqlalchemy import select

    from service.db.token_models import ApiToken
    from service.domain import auth

    row, token = auth.create_token(session=db_session, name="ci", scope="submit", project="alpha")
    stored = db_session.scalar(select(ApiToken).where(ApiToken.id == row.id))
    assert token.startswith("odt_") and len(token) >= 40
    assert token not in (stored.token_hash, stored.prefix) and stored.token_hash == auth.hash_token(token)
    assert len(stored.prefix) < len(token) // 3
    with pytest.raises(ValueError, match="not one of"):
        auth.create_token(session=db_session, name="x", scope="root")
    with pytest.raises(ValueError, match="not limited to a project"):
        auth.create_token(session=db_session, name="x", scope="worker", project="alpha")
