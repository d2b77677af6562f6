"""The notification API's request and response models (the ORM rows are in
service/db/notify_models.py). Credentials go in, never out: responses say `has_token`,
`has_private_key`, `has_secret`."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field, HttpUrl, SecretStr, field_validator

from service.notify.webhooks import DEFAULT_EVENTS, WEBHOOK_EVENTS, secret_problem, url_hint

WebhookEvent = Literal["changed", "broken", "error", "nondeterministic"]
assert set(WebhookEvent.__args__) == set(WEBHOOK_EVENTS)  # noqa: S101  (one list of events)


class GitHubIntegrationSet(BaseModel):
    repository: str = Field(pattern=r"^[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+$", max_length=200,
                            description="owner/name of the repository the project's commits live in")
    api_url: HttpUrl = Field(HttpUrl("https://api.github.com"),
                             description="https://api.github.com, or https://HOST/api/v3 for GitHub Enterprise Server")
    auth: Literal["token", "app"] = "token"
    token: SecretStr | None = Field(None, description="auth=token: a token with checks:write "
                                    "(GitHub App tokens only) or, for PR comments alone, pull-requests:write")
    app_id: str | None = Field(None, max_length=50, description="auth=app: the GitHub App's id")
    private_key: SecretStr | None = Field(None, description="auth=app: the App's PEM private key")
    installation_id: int | None = Field(None, ge=1, description="auth=app: looked up from the repository when omitted")
    check_name: str = Field("optdrift", min_length=1, max_length=80)
    pr_comments: bool = True
    dashboard_url: HttpUrl | None = Field(None, description="base URL of the dashboard for the check's "
                                          "details link; default OPTDRIFT_PUBLIC_URL")

    def credentials_problem(self) -> str | None:
        """Why the credentials do not fit `auth`, or None. Checked by service/notify/config.py rather
        than as a validator: FastAPI's 422 echoes a validator's whole input, credentials included."""
        if self.auth == "token" and not (self.token and self.token.get_secret_value().strip()):
            return ("auth 'token' needs `token` (a GitHub token that may write checks and "
                    "comments on the repository)")
        if self.auth == "app":
            if not self.app_id or self.private_key is None:
                return "auth 'app' needs `app_id` and `private_key` (the App's PEM key)"
            if "PRIVATE KEY" not in self.private_key.get_secret_value():
                return ("`private_key` is not a PEM private key (it should start with "
                        "-----BEGIN RSA PRIVATE KEY-----, as GitHub downloads it)")
        return None


class NotifyErrorPublic(BaseModel):
    run_id: int
    error: str
    attempts: int
    updated_at: datetime


class GitHubIntegrationPublic(BaseModel):
    project: str
    repository: str
    api_url: str
    auth: str
    has_token: bool
    app_id: str | None
    has_private_key: bool
    installation_id: int | None
    check_name: str
    pr_comments: bool
    dashboard_url: str | None
    recent_errors: list[NotifyErrorPublic] = Field(description="the last failures to notify GitHub "
                                                   "(a verdict is never changed by them)")


class WebhookCreate(BaseModel):
    url: HttpUrl
    secret: SecretStr = Field(description="the Standard Webhooks signing secret: `whsec_` + base64 of "
                              "24 to 64 random bytes (`echo whsec_$(openssl rand -base64 32)`); any other "
                              "16+ characters are accepted too, their UTF-8 bytes being the key")
    events: list[WebhookEvent] = Field(default_factory=lambda: list(DEFAULT_EVENTS), min_length=1)
    payload_format: Literal["json", "slack"] = "json"

    def secret_problem(self) -> str | None:
        """Why the secret cannot sign, or None (checked by service/notify/config.py, not as a
        validator, so a 422 never echoes it)."""
        return secret_problem(self.secret.get_secret_value())


class WebhookPublic(BaseModel):
    id: int
    url: str = Field(description="scheme and host; the path is masked (a Slack webhook's path is its key)")
    events: list[str]
    payload_format: str
    active: bool
    has_secret: bool = True
    created_at: datetime

    @field_validator("url")
    @classmethod
    def _masked(cls, value: str) -> str:
        return url_hint(value)


class WebhooksPublic(BaseModel):
    data: list[WebhookPublic]


class WebhookDeliveryPublic(BaseModel):
    id: int
    run_id: int
    event: str
    delivery_uuid: str
    ok: bool
    status_code: int | None
    attempts: int
    error: str | None
    duration_s: float | None
    created_at: datetime
    delivered_at: datetime | None


class WebhookDeliveriesPublic(BaseModel):
    webhook_id: int
    data: list[WebhookDeliveryPublic]
