"""Thirty hostile uploads (tests/fixtures/malicious/corpus.py) against the real API and the
worker's extraction: each refused with a 4xx naming the rule it broke, nothing stored, nothing
written outside the extraction folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.core.archives import ArchiveError, ArchiveLimits, extract_archive
from tests.fixtures.malicious.corpus import GOOD, MAX_EXTRACTED, MAX_MEMBERS, corpus

CORPUS = corpus()
LIMITS = ArchiveLimits(max_members=MAX_MEMBERS, max_extracted_bytes=MAX_EXTRACTED)


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")} if root.exists() else set()


def test_corpus_is_big_enough() -> None:
    assert len(CORPUS) >= 20 and len({name for name, _, _ in CORPUS}) == len(CORPUS)


@pytest.fixture
def strict_api(api, api_settings):
    from service.settings import get_settings

    strict = api_settings.model_copy(update={"max_archive_members": MAX_MEMBERS,
                                             "max_extracted_bytes": MAX_EXTRACTED})
    api.app.dependency_overrides[get_settings] = lambda: strict
    assert api.post("/api/v1/projects", json={"name": "kern"}).status_code == 201
    return api, strict


@pytest.mark.parametrize("name,archive,phrase", CORPUS, ids=[c[0] for c in CORPUS])
def test_upload_refused_and_nothing_stored(strict_api, name, archive, phrase, tmp_path) -> None:
    api, settings = strict_api
    outside = Path("/tmp/optdrift-evil.cpp")
    before = _tree(tmp_path)
    for route, extra in (("/api/v1/sources", {}), ("/api/v1/projects/kern/commits", {"sha": "bad"})):
        response = api.post(route, data=extra, files={"archive": ("s.tar.gz", archive, "application/gzip")})
        assert 400 <= response.status_code < 500, (name, route, response.status_code, response.text)
        assert phrase in response.json()["detail"], (name, response.json())
    store = settings.resolved_store_dir
    assert not any(p.is_file() for p in store.rglob("*")) if store.exists() else True
    assert api.get("/api/v1/projects/kern/commits").json()["count"] == 0
    assert not outside.exists()
    # the only folder the service may write under is its home (the store, the broker's files)
    assert {p.split("/")[0] for p in _tree(tmp_path) - before} <= {"home"}


@pytest.mark.parametrize("name,archive,phrase", CORPUS, ids=[c[0] for c in CORPUS])
def test_worker_extraction_refuses_and_writes_nothing(name, archive, phrase, tmp_path) -> None:
    """The worker's side (a source fetched from the store is checked again before extraction)."""
    sandbox = tmp_path / "sandbox"
    dest = sandbox / "src"
    sandbox.mkdir()
    with pytest.raises(ArchiveError) as refused:
        extract_archive(archive, dest, LIMITS)
    assert phrase in str(refused.value)
    assert not dest.exists(), f"{name}: extraction began before the archive was checked"
    assert _tree(tmp_path) == {"sandbox"}
    assert not Path("/tmp/optdrift-evil.cpp").exists()


def test_a_good_archive_still_extracts(tmp_path) -> None:
    from service.core.archives import pack_directory

    tree = tmp_path / "tree"
    (tree / "cpu").mkdir(parents=True)
    (tree / "ops.cpp").write_bytes(GOOD)
    (tree / "cpu" / "adam.cpp").write_bytes(GOOD * 3)
    out = extract_archive(pack_directory(tree), tmp_path / "out", LIMITS)
    assert (out / "cpu" / "adam.cpp").read_bytes() == GOOD * 3 and (out / "ops.cpp").read_bytes() == GOOD
