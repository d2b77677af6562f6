"""Fetch a run's source archive from the service over HTTP (workers may run on other hosts) and
extract it safely; the archive's sha256 must match the digest it was asked for."""

from __future__ import annotations

from pathlib import Path

import httpx

from service.core.archives import ArchiveLimits, extract_archive, sha256_hex


class SourceFetchError(RuntimeError):
    pass


def fetch_source(*, base_url: str, digest: str, dest: Path, limits: ArchiveLimits,
                 max_bytes: int, timeout_s: float = 120.0, token: str | None = None) -> Path:
    url = f"{base_url.rstrip('/')}/api/v1/sources/{digest}"
    chunks: list[bytes] = []
    size = 0
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        with httpx.stream("GET", url, timeout=timeout_s, headers=headers) as response:
            if response.status_code != 200:
                raise SourceFetchError(f"GET {url} answered {response.status_code}: "
                                       f"{response.read()[:500]!r}")
            for chunk in response.iter_bytes():
                size += len(chunk)
                if size > max_bytes:
                    raise SourceFetchError(f"source {digest} is larger than {max_bytes} bytes")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise SourceFetchError(
            f"cannot fetch source {digest} from {url} ({exc}); is OPTDRIFT_PUBLIC_URL the API's "
            "address as seen from this worker?") from exc
    data = b"".join(chunks)
    if sha256_hex(data) != digest:
        raise SourceFetchError(f"source from {url} does not hash to {digest}; refusing to build it")
    return extract_archive(data, dest, limits)
