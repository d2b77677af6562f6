"""API tests against the real PostgreSQL (fresh database, alembic upgrade head, rolled back per test)."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import select

from service.db.models import Run
from service.domain import dispatch
from service.core.archives import pack_directory, sha256_hex
from tests.service_fixtures import API_TEST_REDIS, make_archive

SOURCE = {"ops.cpp": "// kernels\n", "cpu/a.cpp": "int a = 1;\n"}


def _project(api, name="kern"):  # noqa: ANN001, ANN202
    response = api.post("/api/v1/projects", json={"name": name})
    assert response.status_code == 201, response.text
    return response.json()


def _submit(api, sha, archive, project="kern", headers=None, **form):  # noqa: ANN001, ANN003, ANN202
    return api.post(f"/api/v1/projects/{project}/commits", data={"sha": sha, **form},
                    files={"archive": ("s.tar.gz", archive, "application/gzip")}, headers=headers or {})


def test_project_create_list_and_duplicate(api):  # noqa: ANN001
    _project(api)
    assert [p["name"] for p in api.get("/api/v1/projects").json()["data"]] == ["kern"]
    duplicate = api.post("/api/v1/projects", json={"name": "kern"})
    assert duplicate.status_code == 409 and "already exists" in duplicate.json()["detail"]
    assert api.post("/api/v1/projects", json={"name": "../x"}).status_code == 422


def test_unknown_project_and_commit_are_404(api):  # noqa: ANN001
    response = _submit(api, "abc", make_archive(SOURCE), project="nope")
    assert response.status_code == 404 and "nope" in response.json()["detail"]
    _project(api)
    assert api.get("/api/v1/projects/kern/commits/deadbeef").status_code == 404
    assert api.get("/api/v1/runs/999999").status_code == 404


def test_submission_stores_source_creates_run_and_dispatches(api, api_settings, db_session):  # noqa: ANN001
    _project(api)
    archive = make_archive(SOURCE)
    response = _submit(api, "c1", archive, parents="", message="first")
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["created"] is True
    run = body["runs"][0]
    assert run["status"] == "queued" and run["dispatched"] is True and run["commit_sha"] == "c1"
    digest = sha256_hex(archive)
    stored = api_settings.resolved_store_dir / digest[:2] / f"{digest}.tar.gz"
    assert stored.read_bytes() == archive
    # The worker fetches the same bytes over HTTP.
    assert api.get(f"/api/v1/sources/{digest}").content == archive
    # The broker holds exactly the run id, on the environment's queue.
    import redis

    queued = redis.Redis.from_url(api_settings.resolved_broker_url).lrange("cpu", 0, -1)
    assert len(queued) == 1 and b"optdrift.execute_run" in queued[0]


def test_same_submission_returns_same_run_and_idempotency_key(api):  # noqa: ANN001
    _project(api)
    archive = make_archive(SOURCE)
    first = _submit(api, "c1", archive).json()
    again = _submit(api, "c1", archive)
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["runs"][0]["id"] == first["runs"][0]["id"]
    retried_body = make_archive({**SOURCE, "x.cpp": "1"})
    keyed = _submit(api, "c2", retried_body, headers={"Idempotency-Key": "k1"})
    # Same key, same source, other form fields: the key wins (the client is retrying the same
    # request). A different source under the same sha is a 409 even with the key (test_cli_contract).
    repeat = _submit(api, "c2", retried_body, headers={"Idempotency-Key": "k1", "X-Retry": "1"})
    assert repeat.json()["runs"][0]["id"] == keyed.json()["runs"][0]["id"]
    listed = api.get("/api/v1/projects/kern/commits").json()
    assert [c["sha"] for c in listed["data"]] == ["c2", "c1"] and listed["count"] == 2


def test_commit_source_cannot_change(api):  # noqa: ANN001
    _project(api)
    _submit(api, "c1", make_archive(SOURCE))
    response = _submit(api, "c1", make_archive({"ops.cpp": "// other"}))
    assert response.status_code == 409 and "cannot change" in response.json()["detail"]


def test_bad_archives_are_refused_and_nothing_is_stored(api, api_settings):  # noqa: ANN001
    _project(api)
    cases = {
        "not a readable tar.gz": b"this is not gzip",
        "escapes the archive root": make_archive({"../evil.cpp": "x"}),
        "is a link": make_archive(SOURCE, links={"link.cpp": "/etc/passwd"}),
        "archive is empty": make_archive({}),
    }
    for expected, archive in cases.items():
        response = _submit(api, "bad", archive)
        assert response.status_code == 422, (expected, response.text)
        assert expected in response.json()["detail"], response.json()
    too_big = _submit(api, "big", b"\0" * (api_settings.max_upload_bytes + 1))
    assert too_big.status_code == 413 and "OPTDRIFT_MAX_UPLOAD_BYTES" in too_big.json()["detail"]
    missing = api.post("/api/v1/projects/kern/commits", data={"sha": "none"})
    assert missing.status_code == 422 and "archive" in missing.json()["detail"]
    store = api_settings.resolved_store_dir
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))
    assert api.get("/api/v1/projects/kern/commits").json()["count"] == 0


def test_submit_by_digest_of_uploaded_archive(api):  # noqa: ANN001
    _project(api)
    archive = make_archive(SOURCE)
    # The upload names its project: only that project may name the digest (issue 33).
    uploaded = api.post("/api/v1/sources", data={"project": "kern"},
                        files={"archive": ("s.tar.gz", archive)}).json()
    assert uploaded["digest"] == sha256_hex(archive) and uploaded["member_count"] == 2
    response = api.post("/api/v1/projects/kern/commits",
                        data={"sha": "c9", "source_digest": uploaded["digest"]})
    assert response.status_code == 201, response.text
    unknown = api.post("/api/v1/projects/kern/commits", data={"sha": "c10", "source_digest": "0" * 64})
    assert unknown.status_code == 404


def test_broker_down_keeps_run_queued_then_dispatcher_sends_it(api, api_settings, db_session):  # noqa: ANN001
    _project(api)
    api_settings.broker_url = "redis://127.0.0.1:1/0"  # nothing listens on port 1
    response = _submit(api, "c1", make_archive(SOURCE))
    assert response.status_code == 201
    run = response.json()["runs"][0]
    assert run["status"] == "queued" and run["dispatched"] is False
    assert api.get("/readyz").status_code == 503
    api_settings.broker_url = API_TEST_REDIS  # the broker is back
    sent = dispatch.dispatch_pending(session=db_session, settings=api_settings)
    assert sent == [run["id"]]
    assert api.get(f"/api/v1/runs/{run['id']}").json()["dispatched"] is True
    assert db_session.scalar(select(Run.dispatched_at).where(Run.id == run["id"])) is not None


def test_verify_with_patch_against_known_commit(api, tmp_path: Path):  # noqa: ANN001
    _project(api)
    tree = tmp_path / "tree"
    (tree / "cpu").mkdir(parents=True)
    (tree / "ops.cpp").write_text("int x = 1;\n")
    (tree / "cpu" / "a.cpp").write_text("int a = 1;\n")
    _submit(api, "base1", pack_directory(tree))
    patch = (b"--- a/ops.cpp\n+++ b/ops.cpp\n@@ -1 +1 @@\n-int x = 1;\n+int x = 2;\n")
    response = api.post("/api/v1/projects/kern/verify", data={"base": "base1"},
                        files={"patch": ("p.diff", patch)})
    assert response.status_code == 201, response.text
    run = response.json()
    assert run["kind"] == "verify" and run["base_sha"] == "base1" and run["commit_sha"] is None
    patched = api.get(f"/api/v1/sources/{run['source_digest']}").content
    (tmp_path / "expected").mkdir()
    (tmp_path / "expected" / "cpu").mkdir()
    (tmp_path / "expected" / "ops.cpp").write_text("int x = 2;\n")
    (tmp_path / "expected" / "cpu" / "a.cpp").write_text("int a = 1;\n")
    assert patched == pack_directory(tmp_path / "expected")
    bad = api.post("/api/v1/projects/kern/verify", data={"base": "base1"},
                   files={"patch": ("p.diff", b"--- a/nope.cpp\n+++ b/nope.cpp\n@@ -1 +1 @@\n-a\n+b\n")})
    assert bad.status_code == 422 and "does not apply" in bad.json()["detail"]
    unknown_base = api.post("/api/v1/projects/kern/verify", data={"base": "zzz"},
                            files={"patch": ("p.diff", patch)})
    assert unknown_base.status_code == 404


def test_health_and_metrics(api):  # noqa: ANN001
    assert api.get("/healthz").json()["status"] == "ok"
    assert api.get("/readyz").json() == {"status": "ready"}
    _project(api)
    _submit(api, "c1", make_archive(SOURCE))
    metrics = api.get("/metrics").text
    assert 'optdrift_runs{status="queued"} 1.0' in metrics
    assert "/api/v1/projects/{project}/commits" in api.get("/openapi.json").json()["paths"]


def test_an_errored_run_is_requeued_by_resubmitting_or_retry(api, api_settings, db_session):  # noqa: ANN001
    """issue 14: an optdrift failure is not the commit's; CI retrying its job (the same submission)
    or `optdrift retry` runs it again; a run that is not in `error` is not retried (409)."""
    import redis

    from service.domain import runs

    _project(api)
    archive = make_archive(SOURCE)
    run_id = _submit(api, "c1", archive).json()["runs"][0]["id"]
    broker = redis.Redis.from_url(api_settings.resolved_broker_url)
    broker.delete("cpu")
    assert api.post(f"/api/v1/runs/{run_id}/retry").status_code == 409  # queued: nothing to retry
    for _ in range(api_settings.max_attempts):
        assert runs.claim(session=db_session, run_id=run_id, worker="w")
        runs.retry_later(session=db_session, run_id=run_id, worker="w", error="source fetch refused: 401",
                         max_attempts=api_settings.max_attempts, backoff_s=1)
    assert api.get(f"/api/v1/runs/{run_id}").json()["status"] == "error"
    again = _submit(api, "c1", archive)
    assert again.status_code == 200 and again.json()["created"] is False
    assert again.json()["runs"][0]["status"] == "queued" and broker.llen("cpu") == 1
    for _ in range(api_settings.max_attempts):
        assert runs.claim(session=db_session, run_id=run_id, worker="w")
        runs.retry_later(session=db_session, run_id=run_id, worker="w", error="source fetch refused: 401",
                         max_attempts=api_settings.max_attempts, backoff_s=1)
    retried = api.post(f"/api/v1/runs/{run_id}/retry")
    assert retried.status_code == 200 and retried.json()["status"] == "queued", retried.text
    assert broker.llen("cpu") == 2


BAD_ENV_TOML = '[build]\nkind = "command"\ncommands = ["sh build.sh"]\nlibrary = "out.so"\nenv = { PATH = ".:/usr/bin" }\n'
GOOD_TOML = '[build]\nkind = "command"\ncommands = ["sh build.sh"]\nlibrary = "out.so"\nenv = { MAX_JOBS = "2" }\n'


def test_a_tree_whose_config_the_worker_would_refuse_is_refused_at_submission(api, tmp_path: Path):  # noqa: ANN001
    """Issue 33: build.env outside the build knobs is a 422 naming the key, on the commit route (an
    upload and an earlier upload's digest) and the verify route (an archive and a patch that adds it)."""
    _project(api)
    refused = _submit(api, "badenv", make_archive({"optdrift.toml": BAD_ENV_TOML, "build.sh": "true\n"}))
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert "build.env" in detail and "PATH" in detail and "optdrift.toml" in detail
    assert api.get("/api/v1/projects/kern/commits/badenv").status_code == 404  # nothing was recorded
    uploaded = api.post("/api/v1/sources", files={"archive": ("t.tar.gz", make_archive(
        {"optdrift.toml": BAD_ENV_TOML, "build.sh": "true\n"}))}, data={"project": "kern"})
    if uploaded.status_code in (200, 201):  # a bare upload stores bytes; naming it in a commit is checked
        by_digest = api.post("/api/v1/projects/kern/commits", data={"sha": "badenv2",
                                                                   "source_digest": uploaded.json()["digest"]})
        assert by_digest.status_code == 422 and "PATH" in by_digest.json()["detail"], by_digest.text
    verify = api.post("/api/v1/projects/kern/verify", data={"base": "ok"},
                      files={"archive": ("t.tar.gz", make_archive({"optdrift.toml": BAD_ENV_TOML}))})
    assert verify.status_code in (404, 422)  # no base yet: either refusal, never a run
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "optdrift.toml").write_text(GOOD_TOML)
    (tree / "build.sh").write_text("true\n")
    assert _submit(api, "ok", pack_directory(tree)).status_code == 201
    patch = ("--- a/optdrift.toml\n+++ b/optdrift.toml\n@@ -4 +4 @@\n"
             '-env = { MAX_JOBS = "2" }\n+env = { LD_PRELOAD = "evil.so" }\n').encode()
    patched = api.post("/api/v1/projects/kern/verify", data={"base": "ok"}, files={"patch": ("p.diff", patch)})
    assert patched.status_code == 422 and "LD_PRELOAD" in patched.json()["detail"], patched.text


def test_a_misspelt_battery_is_refused_at_submission_with_the_valid_names(api, tmp_path: Path):  # noqa: ANN001
    """Issue 34 item 5: `--battery quik` is bad input (422, the built-in names and a suggestion), never
    a run that fails and reads as a broken commit; a battery file the tree has is taken."""
    _project(api)
    archive = make_archive({"kernel.cpp": "int x;\n", "batteries/mine.json": "{}\n"})
    refused = _submit(api, "typo", archive, battery="quik")
    assert refused.status_code == 422, refused.text
    detail = refused.json()["detail"]
    assert "'quik'" in detail and "quick, standard, ci" in detail and "did you mean 'quick'" in detail
    assert api.get("/api/v1/projects/kern/commits/typo").status_code == 404
    assert _submit(api, "ownfile", archive, battery="batteries/mine.json").status_code == 201
    missing = _submit(api, "nofile", archive, battery="batteries/other.json")
    assert missing.status_code == 422 and "neither a built-in battery" in missing.json()["detail"]
    named_by_tree = make_archive({"optdrift.toml": '[project]\nbattery = "stanard"\n'})
    tree_typo = _submit(api, "treetypo", named_by_tree)
    assert tree_typo.status_code == 422 and "optdrift.toml" in tree_typo.json()["detail"], tree_typo.text
    verify = api.post("/api/v1/projects/kern/verify", data={"base": "ownfile", "battery": "quik"},
                      files={"archive": ("t.tar.gz", archive)})
    assert verify.status_code == 422 and "did you mean 'quick'" in verify.json()["detail"], verify.text
