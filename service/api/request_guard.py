"""Refuse a write before its body is read: no valid token -> 401, a declared `Content-Length` over
the limit -> 413, and a body streamed without one (chunked) is counted and cut at the limit -> 413.

Why a pure ASGI middleware and not a dependency: FastAPI parses the whole body (spooling uploads
to disk, JSON into memory) before any dependency runs, so a route's token check came after an
unauthenticated 1.5 GB upload had been spooled and a 300 MB JSON body had taken the API to 888 MB.
Here only the headers have been read.

Scopes (403) and the verify quota (429) stay in the routes' dependencies: they need the path's
project and the parsed request; this layer only answers "is this a valid token at all" with the
same lookup (service.domain.auth.authenticate), so 401 means exactly what it means there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import anyio
from sqlalchemy import exc as sqlalchemy_exc
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.db.session import get_session
from service.domain.auth import TokenRejected, authenticate
from service.settings import Settings, get_settings

# Methods that carry a body and change state: every one of them needs a token
# (docs/security/SERVICE.md, "Requests").
WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
# Writes whose sender cannot hold a token: GitHub's webhook deliveries, authenticated by their
# X-Hub-Signature-256 in the route before anything is parsed (service/notify/pull_requests.py).
# Their size is limited like every other body.
SIGNED_PATHS = frozenset({"/api/v1/github/events"})


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit. A starlette HTTPException, so
    FastAPI's body parsing re-raises it unchanged and the client gets this 413, not a 400."""

    def __init__(self, limit: int, what: str):
        super().__init__(413, f"the request body is larger than the {limit}-byte limit for {what}; "
                              "send a smaller body (split the upload, or raise the setting)")


def body_limit(settings: Settings, content_type: str) -> tuple[int, str]:
    """The most bytes a body may have, and what the limit is (for the error message)."""
    if content_type.startswith("multipart/form-data"):
        # One file of up to OPTDRIFT_MAX_UPLOAD_BYTES plus its form fields and multipart framing.
        return (settings.max_upload_bytes + settings.max_form_overhead_bytes,
                "uploads (OPTDRIFT_MAX_UPLOAD_BYTES + OPTDRIFT_MAX_FORM_OVERHEAD_BYTES)")
    # JSON and url-encoded bodies are small (a project, an acknowledgement); FastAPI holds them in
    # memory whole, and a parsed JSON document takes several times its size, so their cap is low.
    return settings.max_json_body_bytes, "JSON and form bodies (OPTDRIFT_MAX_JSON_BODY_BYTES)"


@contextmanager
def _dependency_value(provider: Callable) -> Iterator:  # noqa: ANN001
    """Call a FastAPI dependency (a plain function or a generator) outside FastAPI."""
    value = provider()
    if inspect.isgenerator(value):
        try:
            yield next(value)
        finally:
            value.close()
    else:
        yield value


class RequestGuard:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in WRITE_METHODS:
            await self.app(scope, receive, send)
            return
        headers = {key.decode("latin-1").lower(): value.decode("latin-1")
                   for key, value in scope["headers"]}
        # The app's dependency overrides apply here too (tests run one transaction per test).
        overrides = scope["app"].dependency_overrides if "app" in scope else {}
        settings = overrides.get(get_settings, get_settings)()
        refusal = None
        if scope.get("path") not in SIGNED_PATHS:
            refusal = await anyio.to_thread.run_sync(self._authenticate, overrides, settings, headers)
        if refusal is None:
            refusal = self._declared_size_refusal(settings, headers)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        limit, what = body_limit(settings, headers.get("content-type", ""))
        await self._call_counting(scope, receive, send, limit, what)

    @staticmethod
    def _authenticate(overrides: dict, settings: Settings, headers: dict[str, str]
                      ) -> JSONResponse | None:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else ""
        try:
            with _dependency_value(overrides.get(get_session, get_session)) as session:
                authenticate(session=session, token=token or None)
        except TokenRejected as exc:
            return JSONResponse({"detail": str(exc)}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        except (sqlalchemy_exc.OperationalError, sqlalchemy_exc.InterfaceError) as exc:
            first_line = (str(getattr(exc, "orig", None) or exc).splitlines() or [""])[0]
            return JSONResponse(
                {"detail": f"the database is unavailable ({first_line[:200]}); retry shortly"},
                status_code=503, headers={"Retry-After": str(settings.database_retry_after_s)})
        return None

    @staticmethod
    def _declared_size_refusal(settings: Settings, headers: dict[str, str]) -> JSONResponse | None:
        declared = headers.get("content-length")
        if declared is None:
            return None
        limit, what = body_limit(settings, headers.get("content-type", ""))
        if not declared.isdigit():
            return JSONResponse({"detail": f"Content-Length {declared[:40]!r} is not a byte count"},
                                status_code=400)
        if int(declared) > limit:
            return JSONResponse(
                {"detail": f"the request body ({declared} bytes, from Content-Length) is larger than "
                           f"the {limit}-byte limit for {what}; send a smaller body"},
                status_code=413)
        return None

    async def _call_counting(self, scope: Scope, receive: Receive, send: Send, limit: int,
                             what: str) -> None:
        received = 0
        response_started = False

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit, what)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge as exc:
            # Read outside FastAPI's body parsing (a route streaming its body itself): answer here.
            if response_started:
                raise
            await JSONResponse({"detail": exc.detail}, status_code=413)(scope, receive, send)
