"""Oversized requests, patch bombs and the verify quota race against a real `optdrift serve`
process (uvicorn) on a fresh PostgreSQL database: the API's memory is measured (peak RSS,
/proc/<pid>/status VmHWM), not assumed.
"""

from __future__ import annotations

import base64
import io
import select
import socket
import threading
import time
import zlib
from pathlib import Path

import httpx
import pytest

from service.core.archives import pack_directory
from tests.service_fixtures import (
    API_TEST_REDIS, create_database, drop_database, flush_redis, free_port, start_process,
    stop_process, wait_http,
)

MAX_UPLOAD = 8 * 1024 * 1024
MEMORY_CEILING = 300 * 1024 * 1024


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from service.db.migrate import upgrade_to_head
    from service.domain import auth

    tmp = tmp_path_factory.mktemp("server")
    name = f"optdrift_limits_{free_port()}"
    url = create_database(name)
    upgrade_to_head(url)
    flush_redis(API_TEST_REDIS)
    port = free_port()
    env = {"OPTDRIFT_HOME": str(tmp / "home"), "OPTDRIFT_DATABASE_URL": url,
           "OPTDRIFT_BROKER_URL": API_TEST_REDIS, "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0",
           "OPTDRIFT_MAX_UPLOAD_BYTES": str(MAX_UPLOAD)}
    process = start_process(["serve", "--port", str(port), "--no-worker"], env, tmp / "api.log")
    engine = create_engine(url)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz")
        admin = (tmp / "home" / "admin-token").read_text().strip()
        client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {admin}"}, timeout=60)
        assert client.post("/api/v1/projects", json={"name": "kern"}).status_code == 201
        tree = tmp / "tree"
        tree.mkdir()
        (tree / "ops.cpp").write_text("int x = 1;\n")
        (tree / "blob.bin").write_bytes(b"\0" * 4096)
        response = client.post("/api/v1/projects/kern/commits", data={"sha": "base1"},
                               files={"archive": ("s.tar.gz", pack_directory(tree))})
        assert response.status_code == 201, response.text

        def verify_token(quota: int) -> str:
            with Session(engine) as session:
                _, token = auth.create_token(session=session, name=f"contrib-{free_port()}",
                                             scope="verify", project="kern", daily_quota=quota)
                session.commit()
            return token

        yield {"port": port, "pid": process.pid, "client": client, "admin": admin,
               "verify_token": verify_token, "log": tmp / "api.log"}
    finally:
        stop_process(process)
        engine.dispose()
        drop_database(name)


def _raw(port: int, head: str, body_chunks=(), chunked: bool = False) -> tuple[int, str, int]:
    """Send a request head, then body chunks until the server answers; (status, body, bytes of
    body sent). Lets a test declare 1.5 GB without sending it."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in body_chunks:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server has answered: stop sending
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while True:
                data = sock.recv(65536)
                if not data:
                    break
                answer += data
                if b"\r\n\r\n" in answer and answer.split(b"\r\n\r\n", 1)[1].rstrip().endswith(b"}"):
                    break
        except (ConnectionResetError, TimeoutError):
            pass
    status = int(answer.split(b" ", 2)[1])
    return status, answer.split(b"\r\n\r\n", 1)[1].decode(errors="replace"), sent


def _zeros(total: int, chunk: int = 1 << 20):
    for _ in range(total // chunk):
        yield b"\0" * chunk


def _multipart_file(total: int):
    """A well-formed multipart part (field `archive`) whose file is `total` zero bytes."""
    yield (b'--xyz\r\nContent-Disposition: form-data; name="archive"; filename="s.tar.gz"\r\n'
           b"Content-Type: application/gzip\r\n\r\n")
    yield from _zeros(total)


def test_oversized_requests_are_refused_before_the_body_and_memory_stays_low(server) -> None:
    port, admin = server["port"], server["admin"]
    route = "/api/v1/projects/kern/commits"
    multipart = "multipart/form-data; boundary=xyz"
    # No token, a declared 1.5 GB upload: 401 on the head alone.
    started = time.monotonic()
    status, body, sent = _raw(port, f"POST {route} HTTP/1.1\r\nHost: x\r\nContent-Type: {multipart}\r\n"
                                    f"Content-Length: {1536 * 1024 * 1024}\r\n\r\n")
    assert status == 401 and "API token" in body and sent == 0
    # No token, a 300 MB JSON body being sent: 401 before it is read.
    status, body, sent = _raw(port, "POST /api/v1/projects HTTP/1.1\r\nHost: x\r\nContent-Type: "
                                    f"application/json\r\nContent-Length: {300 * 1024 * 1024}\r\n\r\n",
                              _zeros(300 * 1024 * 1024))
    assert status == 401, body
    assert sent < 64 * 1024 * 1024, f"{sent} bytes went in before the 401"
    auth = f"Authorization: Bearer {admin}\r\n"
    # A valid token, a declared 200 MB upload: 413 on the head alone, naming the setting.
    status, body, sent = _raw(port, f"POST {route} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: {multipart}"
                                    f"\r\nContent-Length: {200 * 1024 * 1024}\r\n\r\n")
    assert status == 413 and "OPTDRIFT_MAX_UPLOAD_BYTES" in body and sent == 0
    # A valid token, 300 MB streamed without Content-Length (chunked): cut at the limit.
    status, body, sent = _raw(port, f"POST {route} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: {multipart}"
                                    "\r\nTransfer-Encoding: chunked\r\n\r\n",
                              _multipart_file(300 * 1024 * 1024), chunked=True)
    assert status == 413 and "limit" in body, body
    assert sent < MAX_UPLOAD + 32 * 1024 * 1024, f"{sent} bytes were taken before the 413"
    # ...and a chunked JSON body past the JSON limit.
    status, body, _ = _raw(port, f"POST /api/v1/projects HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: "
                                 "application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
                           _zeros(100 * 1024 * 1024), chunked=True)
    assert status == 413 and "OPTDRIFT_MAX_JSON_BODY_BYTES" in body, body
    elapsed = time.monotonic() - started
    peak = _peak_rss(server["pid"])
    print(f"oversized requests: {elapsed:.1f} s, API peak RSS {peak / 2**20:.0f} MiB")
    assert peak < MEMORY_CEILING, f"API peak RSS {peak / 2**20:.0f} MiB"
    assert server["client"].get("/healthz").status_code == 200


def _binary_patch(declared: int, compressed: bytes, blob_sha: str) -> bytes:
    """A `GIT binary patch` creating bomb.bin: a literal declaring `declared` bytes, `compressed`
    as its zlib data in git's base85 lines, and the full index line git needs to apply it."""
    return (b"diff --git a/bomb.bin b/bomb.bin\nnew file mode 100644\nindex "
            + b"0" * 40 + b".." + blob_sha.encode() + b"\n"
            b"GIT binary patch\nliteral " + str(declared).encode() + b"\n" + _lines(compressed)
            + b"\nliteral 0\nHcmV?d00001\n\n")


def _zeros_blob_sha(size: int) -> str:
    """git's blob id of `size` zero bytes (git apply checks the result against it)."""
    import hashlib

    digest = hashlib.sha1(f"blob {size}\0".encode())
    block = b"\0" * (1 << 20)
    for _ in range(size // len(block)):
        digest.update(block)
    digest.update(b"\0" * (size % len(block)))
    return digest.hexdigest()


def _zeros_compressed(total: int) -> bytes:
    compressor = zlib.compressobj(9)
    out = io.BytesIO()
    block = b"\0" * (1 << 20)
    for _ in range(total // len(block)):
        out.write(compressor.compress(block))
    out.write(compressor.flush())
    return out.getvalue()


def test_patch_bombs_are_refused_quickly_and_count_against_the_quota(server) -> None:
    client = server["client"]
    token = server["verify_token"](3)
    headers = {"Authorization": f"Bearer {token}"}
    one_gib = 1 << 30
    # A patch whose literal declares (and inflates to) 1 GiB: refused from the declared size.
    compressed = _zeros_compressed(one_gib)
    honest = _binary_patch(one_gib, compressed, _zeros_blob_sha(one_gib))
    # A patch that lies: declares 4 KiB, inflates to 1 GiB (git stops at the declared size).
    lying = _binary_patch(4096, compressed, _zeros_blob_sha(4096))
    started = time.monotonic()
    for patch, phrase in ((honest, "OPTDRIFT_MAX_PATCH_FILE_BYTES"), (lying, "patch")):
        response = client.post("/api/v1/projects/kern/verify", headers=headers, data={"base": "base1"},
                               files={"patch": ("p.diff", patch)})
        assert response.status_code == 422, response.text
        assert phrase in response.json()["detail"]
    elapsed = time.monotonic() - started
    peak = _peak_rss(server["pid"])
    print(f"patch bombs ({len(honest)} bytes each): {elapsed:.1f} s, API peak RSS {peak / 2**20:.0f} MiB")
    assert elapsed < 10 and peak < MEMORY_CEILING
    # A good patch still applies; it is this token's third attempt, so the fourth is refused.
    good = b"--- a/ops.cpp\n+++ b/ops.cpp\n@@ -1 +1 @@\n-int x = 1;\n+int x = 2;\n"
    response = client.post("/api/v1/projects/kern/verify", headers=headers, data={"base": "base1"},
                           files={"patch": ("p.diff", good)})
    assert response.status_code == 201, response.text
    refused = client.post("/api/v1/projects/kern/verify", headers=headers, data={"base": "base1"},
                          files={"patch": ("p.diff", good)})
    assert refused.status_code == 429 and "refused requests count too" in refused.json()["detail"]


def _lines(compressed: bytes) -> bytes:
    lines = []
    for offset in range(0, len(compressed), 52):
        piece = compressed[offset:offset + 52]
        size_char = chr(ord("A") + len(piece) - 1) if len(piece) <= 26 else chr(ord("a") + len(piece) - 27)
        lines.append(size_char.encode() + base64.b85encode(piece + b"\0" * (-len(piece) % 4)))
    return b"\n".join(lines) + b"\n"


def test_verify_quota_of_one_admits_one_of_ten_concurrent_requests(server) -> None:
    client = server["client"]
    token = server["verify_token"](1)
    answers: list[int] = []
    barrier = threading.Barrier(10)

    def attempt(serial: int) -> None:
        tree_archive = _tiny_archive(serial)
        barrier.wait()
        response = httpx.post(f"{client.base_url}/api/v1/projects/kern/verify",
                              headers={"Authorization": f"Bearer {token}"}, data={"base": "base1"},
                              files={"archive": ("s.tar.gz", tree_archive)}, timeout=60)
        answers.append(response.status_code)

    threads = [threading.Thread(target=attempt, args=(serial,)) for serial in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(answers) == [201] + [429] * 9, answers


def _tiny_archive(serial: int) -> bytes:
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        data = f"// {serial}\n".encode()
        info = tarfile.TarInfo("ops.cpp")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
