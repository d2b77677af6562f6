"""Slow clients against a real `optdrift serve` (uvicorn, service/api/slow_clients.py): a connection
that sends half a request's headers, or its body too slowly, is closed at its deadline; an idle
keep-alive connection after `keep_alive_timeout_s`; a body sent at a fair pace is not cut off.
Short deadlines here (the defaults are 10 s, 30 s + 1 s per 500 bytes, 5 s) keep the tests quick.
"""

from __future__ import annotations

import select
import socket
import time

import httpx
import pytest

from tests.service_fixtures import free_port, start_process, stop_process, wait_http

HEADER_S = 1.5
BODY_S = 1.5
KEEP_ALIVE_S = 1
MIN_RATE = 500
# How late past its deadline a close may come on a loaded 2-core machine.
SLACK_S = 3.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    port = free_port()
    env = {"OPTDRIFT_HOME": str(tmp / "home"), "OPTDRIFT_DATABASE_URL": "", "OPTDRIFT_BROKER_URL": "",
           "OPTDRIFT_MAINTENANCE_INTERVAL_S": "0",
           "OPTDRIFT_REQUEST_HEADER_TIMEOUT_S": str(HEADER_S), "OPTDRIFT_REQUEST_BODY_TIMEOUT_S": str(BODY_S),
           "OPTDRIFT_REQUEST_BODY_MIN_RATE": str(MIN_RATE), "OPTDRIFT_KEEP_ALIVE_TIMEOUT_S": str(KEEP_ALIVE_S)}
    process = start_process(["serve", "--port", str(port), "--no-worker"], env, tmp / "api.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout_s=120)
        admin = (tmp / "home" / "admin-token").read_text().strip()
        yield {"port": port, "admin": admin, "log": tmp / "api.log"}
    finally:
        stop_process(process)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30)


def _closed_after(sock: socket.socket, started: float, limit_s: float, trickle: bytes = b"",
                  every_s: float = 0.25) -> float | None:
    """Seconds from `started` until the server closed `sock` (None: still open after `limit_s`),
    sending `trickle` one byte every `every_s` meanwhile. An answer the server sends first is read
    and skipped: what counts is the close."""
    next_send = time.monotonic()
    while time.monotonic() - started < limit_s:
        if trickle and time.monotonic() >= next_send:
            try:
                sock.sendall(trickle[:1])
            except (BrokenPipeError, ConnectionResetError):
                return time.monotonic() - started
            trickle, next_send = trickle[1:] or trickle, next_send + every_s
        if select.select([sock], [], [], 0.05)[0]:
            try:
                if not sock.recv(65536):
                    return time.monotonic() - started
            except ConnectionResetError:
                return time.monotonic() - started
    return None


def test_half_a_header_is_closed_at_the_header_deadline(server):  # noqa: ANN001
    with _connect(server["port"]) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        closed = _closed_after(sock, started, HEADER_S + SLACK_S)
    assert closed is not None, f"still open {HEADER_S + SLACK_S} s after half a header"
    assert closed >= HEADER_S - 0.2


def test_a_header_trickled_byte_by_byte_is_closed_at_the_header_deadline(server):  # noqa: ANN001
    with _connect(server["port"]) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        # Every byte arrives well within any idle timeout; the headers never end.
        closed = _closed_after(sock, started, HEADER_S + SLACK_S, trickle=b"X-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")
    assert closed is not None and closed >= HEADER_S - 0.2


def test_two_hundred_slow_header_connections_are_all_closed_and_the_api_still_answers(server):  # noqa: ANN001
    socks = [_connect(server["port"]) for _ in range(200)]
    try:
        started = time.monotonic()
        for sock in socks:
            sock.sendall(b"POST /api/v1/projects HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-")
        still_open = set(range(len(socks)))
        while still_open and time.monotonic() - started < HEADER_S + 2 * SLACK_S:
            readable, _, _ = select.select([socks[i] for i in still_open], [], [], 0.2)
            for sock in readable:
                try:
                    data = sock.recv(65536)
                except ConnectionResetError:
                    data = b""
                if not data:
                    still_open.discard(socks.index(sock))
        assert not still_open, f"{len(still_open)} of 200 slow-header connections still open"
    finally:
        for sock in socks:
            sock.close()
    assert httpx.get(f"http://127.0.0.1:{server['port']}/healthz", timeout=10).status_code == 200


def _post_head(server, length: int) -> bytes:  # noqa: ANN001
    return (f"POST /api/v1/projects HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server['admin']}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


def test_a_stalled_body_is_closed_at_the_body_deadline(server):  # noqa: ANN001
    with _connect(server["port"]) as sock:
        sock.sendall(_post_head(server, 1000) + b'{"name": ')
        started = time.monotonic()
        closed = _closed_after(sock, started, BODY_S + SLACK_S)
    assert closed is not None, f"still open {BODY_S + SLACK_S} s after the body stalled"
    assert closed >= BODY_S - 0.2
    assert "request body not received" in server["log"].read_text()


def test_a_trickled_body_is_closed_at_the_body_deadline(server):  # noqa: ANN001
    with _connect(server["port"]) as sock:
        sock.sendall(_post_head(server, 1000))
        started = time.monotonic()
        # 4 bytes a second, far below the minimum rate: each byte adds 1/500 s to the deadline.
        closed = _closed_after(sock, started, BODY_S + SLACK_S, trickle=b" " * 1000)
    assert closed is not None and closed >= BODY_S - 0.2


def test_a_body_at_a_fair_pace_is_not_cut_off(server):  # noqa: ANN001
    body = b'{"name": "fair-pace"}'.ljust(3000, b" ")
    with _connect(server["port"]) as sock:
        sock.sendall(_post_head(server, len(body)))
        # 1000 bytes a second (twice the minimum rate) for 3 s: longer than BODY_S alone.
        for offset in range(0, len(body), 100):
            sock.sendall(body[offset:offset + 100])
            time.sleep(0.1)
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 201"), answer[:200]


def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(server):  # noqa: ANN001
    with _connect(server["port"]) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        started = time.monotonic()
        closed = _closed_after(sock, started, KEEP_ALIVE_S + SLACK_S)
    assert closed is not None and closed >= KEEP_ALIVE_S - 0.2
