"""What a request may name, checked at the API (real app, real PostgreSQL): environments,
batteries, integer parameters, archive member names the worker could not extract, patches."""

from __future__ import annotations

import base64
import io
import tarfile
import zlib
from pathlib import Path

import pytest

from service.core.archives import ArchiveError, ArchiveLimits, extract_archive
from service.domain.errors import BadInputError
from service.domain.patches import PatchLimits, check_patch
from tests.service_fixtures import make_archive

# The battery files the allowed-battery test names are in the tree: a named file must exist there.
SOURCE = {"ops.cpp": "// kernels\n", "batteries/mine.json": "{}\n", "b.json": "{}\n"}


@pytest.fixture
def kern(api):
    assert api.post("/api/v1/projects", json={"name": "kern", "environments": ["cpu", "gpu.sm90"]}
                    ).status_code == 201
    return api


def _submit(api, sha: str, **form):  # noqa: ANN003, ANN202
    return api.post("/api/v1/projects/kern/commits", data={"sha": sha, **form},
                    files={"archive": ("s.tar.gz", make_archive(SOURCE), "application/gzip")})


def test_environments_must_be_registered_and_are_capped(kern, api_settings) -> None:
    made_up = _submit(kern, "c1", environments=" ".join(f"env{i}" for i in range(2000)))
    assert made_up.status_code == 422 and "at most 16" in made_up.json()["detail"]
    unknown = _submit(kern, "c1", environments="cpu gpu.fake")
    assert unknown.status_code == 422, unknown.text
    detail = unknown.json()["detail"]
    assert "'gpu.fake' is not registered" in detail and "cpu, gpu.sm90" in detail
    assert kern.get("/api/v1/projects/kern/commits").json()["count"] == 0
    ok = _submit(kern, "c1", environments="gpu.sm90,gpu.sm90")
    assert ok.status_code == 201 and [r["environment"] for r in ok.json()["runs"]] == ["gpu.sm90"]
    too_many = kern.post("/api/v1/projects", json={"name": "p2", "environments": [f"e{i}" for i in range(33)]})
    assert too_many.status_code == 422


@pytest.mark.parametrize("battery", [
    "/work/home/admin-token", "../../etc/passwd", "batteries/../../x.json", "a\\b.json", "x\0y",
    "~/.config/optdrift/token", "/proc/self/environ", "b" * 201, ".hidden/x.json", "a b.json",
])
def test_battery_is_a_builtin_name_or_a_relative_path(kern, battery: str) -> None:
    _submit(kern, "base1")
    response = _submit(kern, "c2", battery=battery)
    assert response.status_code == 422, response.text
    assert "built-in battery (quick, standard, ci)" in response.json()["detail"]
    verify = kern.post("/api/v1/projects/kern/verify", data={"base": "base1", "battery": battery},
                       files={"archive": ("s.tar.gz", make_archive({"a.cpp": "1"}))})
    assert verify.status_code == 422 and "relative to the submitted tree" in verify.json()["detail"]
    project = kern.post("/api/v1/projects", json={"name": "p3", "default_battery": battery})
    assert project.status_code == 422


def test_allowed_batteries_pass(kern) -> None:
    for serial, battery in enumerate(("quick", "standard", "batteries/mine.json", "b.json")):
        response = _submit(kern, f"ok{serial}", battery=battery)
        assert response.status_code == 201 and response.json()["runs"][0]["battery"] == battery


def test_builtin_battery_names_match_the_worker() -> None:
    worker_battery = pytest.importorskip("worker.battery")
    from service.domain.submission_rules import BUILTIN_BATTERIES

    assert set(BUILTIN_BATTERIES) == set(worker_battery.BUILTIN_BATTERIES)


@pytest.mark.parametrize("path", [
    "/api/v1/runs/9223372036854775808", "/api/v1/runs/2147483648", "/api/v1/runs/-1",
    "/api/v1/projects/kern/commits?offset=9223372036854775808",
    "/api/v1/projects/kern/commits?limit=-1", "/api/v1/projects/kern/commits?limit=501",
    "/api/v1/projects/kern/verdicts?limit=0", "/projects/kern?page=9223372036854775808",
    "/projects/kern?page=0", "/runs/9223372036854775808",
    "/dashboard/api/runs/9223372036854775808/series?case=x",
    "/projects/kern/commits/abc?run=9223372036854775808",
])
def test_integers_out_of_range_are_422(kern, path: str) -> None:
    response = kern.get(path)
    assert response.status_code == 422, (path, response.status_code, response.text[:300])


def test_limit_in_range_is_honoured(kern) -> None:
    for serial in range(3):
        _submit(kern, f"c{serial}")
    assert len(kern.get("/api/v1/projects/kern/commits?limit=2").json()["data"]) == 2
    assert kern.get("/api/v1/runs/2147483647").status_code == 404


def _tar(entries: list[tuple[str | bytes, bool]]) -> bytes:
    """(name, is_dir) entries; a bytes name is written raw (GNU format, no UTF-8 check)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", format=tarfile.GNU_FORMAT,
                      encoding="utf-8", errors="surrogateescape") as tar:
        for name, is_dir in entries:
            text = name.decode("utf-8", "surrogateescape") if isinstance(name, bytes) else name
            info = tarfile.TarInfo(text)
            if is_dir:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = 2
                tar.addfile(info, io.BytesIO(b"//"))
    return buffer.getvalue()


WORKER_BREAKERS = [
    ("file-then-under", _tar([("a", False), ("a/b", False)]), "which the archive has as a file"),
    ("under-then-file", _tar([("a/b", False), ("a", False)]), "appears twice"),
    ("dir-then-file", _tar([("d", True), ("d", False)]), "appears twice"),
    ("long-path", _tar([("a/" * 3000 + "x", False)]), "-byte path"),
    ("long-component", _tar([("x" * 300 + ".cpp", False)]), "path component of 304 bytes"),
    ("deep", _tar([("d/" * 70 + "x", False)]), "folders deep"),
    ("non-utf8", _tar([(b"caf\xe9.cpp", False)]), "not valid UTF-8"),
]


@pytest.mark.parametrize("name,archive,phrase", WORKER_BREAKERS, ids=[w[0] for w in WORKER_BREAKERS])
def test_archives_the_worker_cannot_extract_are_refused_at_upload(kern, name, archive, phrase,
                                                                  tmp_path: Path) -> None:
    response = kern.post("/api/v1/sources", files={"archive": ("s.tar.gz", archive)})
    assert response.status_code == 422 and phrase in response.json()["detail"], (name, response.text)
    with pytest.raises(ArchiveError, match=phrase.replace("(", r"\(")):
        extract_archive(archive, tmp_path / "x", ArchiveLimits())
    assert not (tmp_path / "x").exists()


def test_a_folder_with_files_still_extracts(tmp_path: Path) -> None:
    archive = _tar([("d", True), ("d/a.cpp", False), ("d/e", True), ("d/e/b.cpp", False)])
    out = extract_archive(archive, tmp_path / "x", ArchiveLimits())
    assert (out / "d" / "e" / "b.cpp").read_bytes() == b"//"


def _git85(data: bytes) -> bytes:
    lines = []
    for offset in range(0, len(data), 52):
        piece = data[offset:offset + 52]
        size_char = chr(ord("A") + len(piece) - 1) if len(piece) <= 26 else chr(ord("a") + len(piece) - 27)
        lines.append(size_char.encode() + base64.b85encode(piece + b"\0" * (-len(piece) % 4)))
    return b"\n".join(lines)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def test_a_binary_delta_declaring_a_huge_result_is_refused_unapplied() -> None:
    # A delta's ops copy up to 64 KiB from the base per 8 bytes: 1 GiB from a few KB of patch.
    delta = _varint(4096) + _varint(1 << 30) + b"\x90\x00\x10" * 16384
    patch = (b"diff --git a/blob.bin b/blob.bin\nindex 1111111..2222222 100644\nGIT binary patch\n"
             b"delta " + str(len(delta)).encode() + b"\n" + _git85(zlib.compress(delta)) + b"\n\n")
    with pytest.raises(BadInputError, match="expands to 1073741824 bytes"):
        check_patch(patch, PatchLimits(max_file_bytes=1 << 20, max_total_bytes=1 << 21))


def test_patch_total_is_bounded_across_files() -> None:
    hunk = (b"GIT binary patch\nliteral 900000\n" + _git85(zlib.compress(b"\0" * 900000)) + b"\n\n")
    patch = b"".join(b"diff --git a/f%d b/f%d\nnew file mode 100644\n" % (i, i) + hunk for i in range(3))
    with pytest.raises(BadInputError, match="OPTDRIFT_MAX_PATCH_EXPANDED_BYTES"):
        check_patch(patch, PatchLimits(max_file_bytes=1 << 20, max_total_bytes=2 << 20))
    check_patch(patch, PatchLimits(max_file_bytes=1 << 20, max_total_bytes=3 << 20))


def test_unauthenticated_json_write_is_401_and_oversized_json_is_413(api, admin_token) -> None:
    anonymous = api.post("/api/v1/projects", json={"name": "x" * 10}, headers={"Authorization": ""})
    assert anonymous.status_code == 401 and anonymous.headers["www-authenticate"] == "Bearer"
    huge = api.post("/api/v1/projects", content=b"{" + b" " * (2 << 20) + b"}",
                    headers={"Content-Type": "application/json"})
    assert huge.status_code == 413 and "OPTDRIFT_MAX_JSON_BODY_BYTES" in huge.json()["detail"]
