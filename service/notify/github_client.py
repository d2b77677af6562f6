"""A githubkit client for one project's integration: token or GitHub App installation auth, a
custom API URL (GitHub Enterprise Server, or the tests' stand-in), and the retry policy.

Retries: githubkit turns GitHub's documented rate-limit answers into exceptions carrying the wait
GitHub asks for — a 403/429 with `Retry-After` (secondary limit: that many seconds), or with
`x-ratelimit-remaining: 0` (primary limit: until `x-ratelimit-reset`, epoch seconds; a secondary
limit named in the message without Retry-After: one minute). NotifyRetry waits exactly that long,
and backs off exponentially on 5xx and on network errors. A wait longer than `max_wait_s` is not
slept through (a notification must not hold its thread for the hour a primary limit may take):
the attempt fails and the error is recorded; the next event for the run sends the current state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

from githubkit import AppAuthStrategy, AppInstallationAuthStrategy, GitHub, TokenAuthStrategy
from githubkit.exception import GitHubException, RateLimitExceeded, RequestError, RequestFailed
from githubkit.retry import RetryOption

from service.db.notify_models import AUTH_APP, GitHubIntegration
from service.notify.backoff import Backoff
from service.notify.sealing import unseal
from service.settings import Settings, get_settings

log = logging.getLogger(__name__)

DEFAULT_API_URL = "https://api.github.com"


@dataclass(frozen=True)
class NotifyRetry(Backoff):
    """githubkit's auto_retry decision: `attempts` tries in all per request."""

    max_wait_s: float = 120.0

    def __call__(self, exc: GitHubException, retry_count: int) -> RetryOption:
        if retry_count + 1 >= self.attempts:
            return RetryOption(False)
        if isinstance(exc, RateLimitExceeded):
            wait = exc.retry_after.total_seconds()
            if wait > self.max_wait_s:
                log.warning("GitHub rate limit: asked to wait %.0f s (more than %.0f s); giving up "
                            "on this request", wait, self.max_wait_s)
                return RetryOption(False)
            # A reset time in the past (clock skew) still waits a moment rather than hammering.
            return RetryOption(True, timedelta(seconds=max(wait, 0.05)))
        server_error = isinstance(exc, RequestFailed) and exc.response.status_code >= 500
        network_error = isinstance(exc, RequestError) and not isinstance(exc, RequestFailed)
        if server_error or network_error:
            return RetryOption(True, timedelta(seconds=self.delay_s(retry_count)))
        return RetryOption(False)


def _auth(integration: GitHubIntegration, api_url: str, retry: NotifyRetry, settings: Settings):  # noqa: ANN202
    if integration.auth_kind != AUTH_APP:
        return TokenAuthStrategy(unseal(integration.token, settings) or "")
    private_key = unseal(integration.private_key, settings) or ""
    installation_id = integration.installation_id
    if installation_id is None:
        # The App is installed on the repository: ask GitHub which installation (app JWT auth).
        owner, repo = integration.repository.split("/", 1)
        with GitHub(AppAuthStrategy(integration.app_id, private_key),
                    base_url=api_url, auto_retry=retry) as app_client:
            installation_id = app_client.rest.apps.get_repo_installation(owner, repo).json()["id"]
    return AppInstallationAuthStrategy(integration.app_id, private_key, installation_id)


def make_client(integration: GitHubIntegration, *, retry: NotifyRetry | None = None,
                timeout_s: float = 20.0, settings: Settings | None = None,
                follow_redirects: bool = True) -> GitHub:
    """A client for the integration's repository (its credential decrypted with the settings'
    secrets key); use it as a context manager (one connection pool for the notification's few
    requests). `follow_redirects=False` for a download whose 302 points at another host, which
    must not get our credential (service/notify/pull_requests.py)."""
    retry = retry or NotifyRetry()
    api_url = (integration.api_url or DEFAULT_API_URL).rstrip("/") + "/"
    return GitHub(_auth(integration, api_url, retry, settings or get_settings()), base_url=api_url, auto_retry=retry,
                  timeout=timeout_s, user_agent="optdrift-notifier", http_cache=False,
                  follow_redirects=follow_redirects)
