"""Issue 33 item 5: a source digest is scoped to the projects that uploaded it.

Digests are public (every run and commit shows its `source_digest`); the source is not. A submit
token of project B used to commit with project A's digest, and a verify patch on that commit then
printed A's private source. Through the real API (real PostgreSQL, the app's routes, real tokens):
B naming A's digest gets the same 404 as a digest never uploaded; B uploading the same bytes itself
may then use it; A is unaffected.
"""

from __future__ import annotations

import psycopg
import pytest
from alembic import command

from service.core.archives import sha256_hex
from tests.service_fixtures import PG_ADMIN_URL, create_database, drop_database, make_archive

PRIVATE = {"ops.cpp": "// alpha's private kernels\nint secret = 42;\n"}


@pytest.fixture
def two_projects(api, db_session):  # noqa: ANN001, ANN201
    """Projects alpha and beta and a submit token limited to each: {name: headers}."""
    from service.domain import auth

    headers = {}
    for name in ("alpha", "beta"):
        assert api.post("/api/v1/projects", json={"name": name}).status_code == 201
        _, token = auth.create_token(session=db_session, name=f"ci-{name}", scope="submit",
                                     project=name)
        headers[name] = {"Authorization": f"Bearer {token}"}
    db_session.flush()
    return headers


def _commit_by_digest(api, project: str, sha: str, digest: str, headers: dict):  # noqa: ANN001, ANN202
    return api.post(f"/api/v1/projects/{project}/commits", headers=headers,
                    data={"sha": sha, "source_digest": digest})


def _unknown_detail(detail: str, digest: str) -> str:
    return detail.replace(digest, "<digest>")


def test_another_projects_digest_is_404_like_a_missing_one(api, two_projects) -> None:  # noqa: ANN001
    archive = make_archive(PRIVATE)
    digest = sha256_hex(archive)
    alpha = api.post("/api/v1/projects/alpha/commits", headers=two_projects["alpha"],
                     data={"sha": "a1"}, files={"archive": ("s.tar.gz", archive)})
    assert alpha.status_code == 201, alpha.text
    assert alpha.json()["commit"]["source_digest"] == digest  # public: anyone reads it

    stolen = _commit_by_digest(api, "beta", "b1", digest, two_projects["beta"])
    missing = _commit_by_digest(api, "beta", "b1", "e" * 64, two_projects["beta"])
    assert stolen.status_code == 404 and missing.status_code == 404, (stolen.text, missing.text)
    # The same answer, word for word: beta cannot tell that alpha has this digest.
    assert _unknown_detail(stolen.json()["detail"], digest) == _unknown_detail(missing.json()["detail"], "e" * 64)
    assert api.get("/api/v1/projects/beta/commits").json()["count"] == 0

    # beta uploads the identical bytes itself: now beta may name the digest, and it is stored once.
    uploaded = api.post("/api/v1/sources", headers=two_projects["beta"],
                        files={"archive": ("s.tar.gz", archive)})
    assert uploaded.status_code == 200 and uploaded.json()["digest"] == digest, uploaded.text
    legitimate = _commit_by_digest(api, "beta", "b1", digest, two_projects["beta"])
    assert legitimate.status_code == 201, legitimate.text
    # And alpha is not affected by beta's upload.
    assert _commit_by_digest(api, "alpha", "a2", digest, two_projects["alpha"]).status_code == 201


def test_an_upload_is_for_one_project_and_only_that_project_names_it(api, two_projects) -> None:  # noqa: ANN001
    archive = make_archive({**PRIVATE, "more.cpp": "int more;\n"})
    digest = sha256_hex(archive)
    # A token of alpha uploads for alpha (its own project by default) and not for beta.
    for_beta = api.post("/api/v1/sources", headers=two_projects["alpha"], data={"project": "beta"},
                        files={"archive": ("s.tar.gz", archive)})
    assert for_beta.status_code == 403, for_beta.text
    uploaded = api.post("/api/v1/sources", headers=two_projects["alpha"],
                        files={"archive": ("s.tar.gz", archive)})
    assert uploaded.status_code == 200, uploaded.text
    assert _commit_by_digest(api, "beta", "b1", digest, two_projects["beta"]).status_code == 404
    assert _commit_by_digest(api, "alpha", "a1", digest, two_projects["alpha"]).status_code == 201
    # An admin (a token of no one project) names the project; without it the upload is refused.
    unnamed = api.post("/api/v1/sources", files={"archive": ("s.tar.gz", archive)})
    assert unnamed.status_code == 422 and "`project`" in unnamed.json()["detail"], unnamed.text
    named = api.post("/api/v1/sources", data={"project": "beta"}, files={"archive": ("s.tar.gz", archive)})
    assert named.status_code == 200, named.text
    assert _commit_by_digest(api, "beta", "b1", digest, two_projects["beta"]).status_code == 201


def test_a_verify_patch_cannot_reach_another_projects_source(api, two_projects) -> None:  # noqa: ANN001
    """The attack end to end: beta's token tries to build a commit on alpha's digest and verify a
    patch against it (the patch would print the source). The commit is refused, so there is no base."""
    archive = make_archive(PRIVATE)
    digest = sha256_hex(archive)
    api.post("/api/v1/projects/alpha/commits", headers=two_projects["alpha"], data={"sha": "a1"},
             files={"archive": ("s.tar.gz", archive)})
    assert _commit_by_digest(api, "beta", "b1", digest, two_projects["beta"]).status_code == 404
    patch = b"--- a/ops.cpp\n+++ b/ops.cpp\n@@ -1 +1 @@\n-// alpha's private kernels\n+// printed\n"
    verify = api.post("/api/v1/projects/beta/verify", headers=two_projects["beta"], data={"base": "b1"},
                      files={"patch": ("p.diff", patch)})
    assert verify.status_code == 404 and "b1" in verify.json()["detail"], verify.text
    # Nor by naming alpha's commit as the base from beta's project: bases are the project's own.
    cross = api.post("/api/v1/projects/beta/verify", headers=two_projects["beta"], data={"base": "a1"},
                     files={"patch": ("p.diff", patch)})
    assert cross.status_code == 404, cross.text


def test_the_migration_grants_existing_archives_to_the_projects_that_used_them() -> None:
    """Upgrading keeps every submitted commit's source usable by its project (and only it)."""
    from service.db.migrate import alembic_config

    name = "optdrift_test_digest_migration"
    url = create_database(name)
    plain = PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    try:
        config = alembic_config(url)
        command.upgrade(config, "0006_merge_round3")
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute("INSERT INTO projects (id, name, build_kind, adapter, default_battery, environments, "
                         "created_at) VALUES (1, 'alpha', 'command', 'bundled', 'quick', '[\"cpu\"]', now()), "
                         "(2, 'beta', 'command', 'bundled', 'quick', '[\"cpu\"]', now())")
            for digest in ("a" * 64, "b" * 64, "c" * 64):
                conn.execute("INSERT INTO source_archives (digest, size_bytes, member_count, created_at) "
                             "VALUES (%s, 1, 1, now())", (digest,))
            conn.execute("INSERT INTO commits (id, project_id, sha, parents, source_digest, created_at) "
                         "VALUES (1, 1, 'a1', '[]', %s, now())", ("a" * 64,))
            conn.execute("INSERT INTO runs (project_id, kind, base_commit_id, source_digest, battery, "
                         "environment, status, attempt, cancel_requested, created_at, cases_done) "
                         "VALUES (2, 'verify', NULL, %s, 'quick', 'cpu', 'queued', 0, false, now(), 0)",
                         ("b" * 64,))
        command.upgrade(config, "0007_source_archive_projects")
        with psycopg.connect(plain) as conn:
            rows = conn.execute("SELECT digest, project_id FROM source_archive_projects ORDER BY digest").fetchall()
        # "c"*64 was uploaded and never used: no project may name it until one uploads it again.
        assert rows == [("a" * 64, 1), ("b" * 64, 2)]
    finally:
        drop_database(name)
