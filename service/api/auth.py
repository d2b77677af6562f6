"""Authentication dependencies: `Authorization: Bearer <token>` -> a Principal, scope checks per
route, and the optional protection of read endpoints (OPTDRIFT_PROTECT_READS).

401: no token / unknown / expired / revoked (with `WWW-Authenticate: Bearer`).
403: a valid token without the route's scope or for another project.
429: a verify token past its daily quota (with `Retry-After`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from service.api.deps import SessionDep, SettingsDep
from service.domain.auth import (
    ADMIN, MAINTAIN, SUBMIT, VERIFY, WORKER, Principal, QuotaExceeded, ScopeDenied, TokenRejected, authenticate,
)

bearer = HTTPBearer(auto_error=False, description="an optdrift API token (`optdrift token create`)")
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]

# Reachable without a token even when reads are protected: liveness/readiness probes and the
# dashboard's static files (no data in them).
ALWAYS_PUBLIC_PREFIXES = ("/healthz", "/readyz", "/static/")


def get_principal(session: SessionDep, credentials: CredentialsDep) -> Principal:
    return authenticate(session=session, token=credentials.credentials if credentials else None)


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def require_scope(*scopes: str):  # noqa: ANN201
    """A dependency: the caller's token has one of `scopes` (admin always passes); a token limited
    to a project passes only on that project's routes (the `{project}` path parameter)."""

    def dependency(request: Request, principal: PrincipalDep) -> Principal:
        principal.require(*scopes, project=request.path_params.get("project"))
        return principal

    dependency.__name__ = f"require_{'_or_'.join(scopes)}"
    return dependency


AdminDep = Annotated[Principal, Depends(require_scope(ADMIN))]
SubmitDep = Annotated[Principal, Depends(require_scope(SUBMIT))]
VerifyDep = Annotated[Principal, Depends(require_scope(VERIFY, SUBMIT))]
WorkerDep = Annotated[Principal, Depends(require_scope(WORKER))]
# Acknowledging a change: a maintainer's act, which needs none of admin's other rights.
MaintainDep = Annotated[Principal, Depends(require_scope(MAINTAIN))]


def read_access(request: Request, session: SessionDep, settings: SettingsDep,
                credentials: CredentialsDep) -> None:
    """App-wide: with OPTDRIFT_PROTECT_READS, every GET needs a valid token of any scope."""
    if not settings.protect_reads or request.method not in ("GET", "HEAD"):
        return
    if request.url.path.startswith(ALWAYS_PUBLIC_PREFIXES):
        return
    authenticate(session=session, token=credentials.credentials if credentials else None)


def install_error_handlers(app: FastAPI) -> None:
    async def rejected(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=401,
                            headers={"WWW-Authenticate": "Bearer"})

    async def denied(_request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=403)

    async def quota(_request: Request, exc: QuotaExceeded) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=429,
                            headers={"Retry-After": str(exc.retry_after_s)})

    app.add_exception_handler(TokenRejected, rejected)
    app.add_exception_handler(ScopeDenied, denied)
    app.add_exception_handler(QuotaExceeded, quota)
