"""Outgoing webhooks: a verdict event POSTed to a project's URLs, signed, retried, logged.

Signed as the Standard Webhooks spec says (https://www.standardwebhooks.com), with its reference
library: `webhook-id` (one per delivery, the same on every retry: receivers drop repeats),
`webhook-timestamp` (the attempt's time, Unix seconds) and `webhook-signature` =
`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`. The id and the time are inside the signed
text, so a captured delivery cannot be replayed later (receivers refuse timestamps older than
their tolerance, five minutes in the library) nor with another id (docs/INTEGRATIONS.md has the
receiver's code). Every attempt is counted on the event's delivery row
(service/db/notify_models.WebhookDelivery), which
`GET /api/v1/projects/{project}/webhooks/{id}/deliveries` lists.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session
from standardwebhooks import Webhook as StandardWebhook

from service.core.wording import number
from service.db.notify_models import PAYLOAD_SLACK, Webhook, WebhookDelivery
from service.domain.dashboard_queries import RunPage
from service.domain.redaction import scrub
from service.notify.backoff import Backoff
from service.notify.report import group_changed
from service.notify.sealing import SecretsKeyError, unseal
from service.settings import Settings, get_settings

log = logging.getLogger(__name__)

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
EVENT_HEADER = "X-Optdrift-Event"
# Standard Webhooks secrets: `whsec_` + base64 of 24 to 64 random bytes.
SECRET_PREFIX = "whsec_"
MIN_SECRET_BYTES, MAX_SECRET_BYTES = 24, 64
# The outcomes a webhook may subscribe to, and the default subscription.
WEBHOOK_EVENTS = ("changed", "broken", "error", "nondeterministic")
DEFAULT_EVENTS = ["changed", "broken", "error"]
# A payload lists this many changed cases; the count says how many there were.
MAX_PAYLOAD_CASES = 50


def _whsec_bytes(secret: str) -> bytes | None:
    """The key a `whsec_` secret encodes, or None when `secret` is not one (strict base64)."""
    if not secret.startswith(SECRET_PREFIX):
        return None
    try:
        return base64.b64decode(secret[len(SECRET_PREFIX):], validate=True) or None
    except (binascii.Error, ValueError):
        return None


def secret_problem(secret: str) -> str | None:
    """Why `secret` cannot be a new webhook's secret, or None. Accepted: the spec's form, or (as
    before the spec) any 16 or more characters, whose UTF-8 bytes are then the key."""
    if secret.startswith(SECRET_PREFIX):
        key = _whsec_bytes(secret)
        if key is None or not MIN_SECRET_BYTES <= len(key) <= MAX_SECRET_BYTES:
            return (f"`secret` starts with {SECRET_PREFIX} but is not base64 of {MIN_SECRET_BYTES} to "
                    f"{MAX_SECRET_BYTES} bytes; make one with `echo whsec_$(openssl rand -base64 32)`")
        return None
    if len(secret) < 16:
        return ("`secret` must have at least 16 characters; make one in the Standard Webhooks form "
                "with `echo whsec_$(openssl rand -base64 32)`")
    return None


def standard_secret(secret: str) -> str:
    """The webhook's secret in the spec's `whsec_` form, as a receiver's library takes it. A
    secret set in another form (any 16+ characters, before webhooks followed the spec) signs with
    its UTF-8 bytes as the key: `whsec_` + base64 of those bytes."""
    if _whsec_bytes(secret) is not None:
        return secret
    return SECRET_PREFIX + base64.b64encode(secret.encode()).decode()


def signed_headers(*, secret: str, message_id: str, body: bytes, now: float | None = None) -> dict[str, str]:
    """The three Standard Webhooks headers for one attempt, signed by the reference library."""
    timestamp = datetime.fromtimestamp(int(time.time() if now is None else now), tz=timezone.utc)
    signature = StandardWebhook(standard_secret(secret)).sign(message_id, timestamp, body)
    return {ID_HEADER: message_id, TIMESTAMP_HEADER: str(int(timestamp.timestamp())),
            SIGNATURE_HEADER: signature}


@dataclass(frozen=True)
class DeliveryPolicy(Backoff):
    max_backoff_s: float = 60.0
    timeout_s: float = 10.0


def url_hint(url: str) -> str:
    """The webhook's URL as the API shows it: scheme and host, the path masked (a Slack incoming
    webhook's path is its key, so the whole URL is a secret)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" + ("/…" if parts.path.strip("/") else "")


def verdict_payload(*, event: str, project: str, page: RunPage, run_url: str) -> dict[str, Any]:
    """Our JSON document: what happened, to which commit, the changed cases (first divergent step,
    max |Δ|, direction) and where to look."""
    run, verdict, commit = page.run, page.verdict, page.commit
    cases = [{"case_id": c.case_id, "optimizer": c.optimizer, "family": c.family or "32bit",
              "verdict": c.verdict, "first_divergent_step": c.first_divergent_step,
              "max_abs_diff": c.max_abs_diff, "direction": c.direction}
             for group in group_changed(page.changed) for c in group.cases]
    return {
        "event": event, "project": project,
        "commit": {"sha": commit.sha, "ref": commit.ref} if commit else None,
        "run": {"id": run.id, "environment": run.environment, "battery": run.battery,
                "status": run.status, "url": run_url, "error": scrub(run.error)},
        "verdict": None if verdict is None else {
            "outcome": verdict.outcome, "flagged": verdict.flagged, "acknowledged": verdict.acknowledged,
            "changed_cases": verdict.changed_cases, "first_divergent_step": verdict.first_divergent_step},
        "summary": page.summary,
        "changed_cases": cases[:MAX_PAYLOAD_CASES],
        "changed_cases_total": len(cases),
        "not_applicable": len(page.not_applicable),
    }


def slack_payload(document: dict[str, Any]) -> dict[str, Any]:
    """Slack's incoming-webhook shape: `text` (the notification's fallback) and Block Kit blocks."""
    commit = document["commit"] or {}
    head = (f"optdrift: *{document['event']}* in `{document['project']}` at "
            f"`{(commit.get('sha') or '')[:12]}` ({document['run']['environment']})")
    text = f"{head}: {document['run']['url']}"
    lines = [f"• `{c['case_id']}` ({c['optimizer']} · {c['family']}): from step "
             f"{c['first_divergent_step'] or '–'}, max |Δ| "
             f"{number(c['max_abs_diff'], missing='–')}, "
             f"{c['direction'] or '–'}" for c in document["changed_cases"][:10]]
    blocks: list[dict[str, Any]] = [
        {"type": "section", "text": {"type": "mrkdwn", "text": head}},
        {"type": "section", "text": {"type": "mrkdwn", "text": (document["summary"] or "–")[:2900]}},
    ]
    if lines:
        more = document["changed_cases_total"] - len(lines)
        blocks.append({"type": "section", "text": {"type": "mrkdwn", "text": "\n".join(lines)[:2900]
                                                   + (f"\n… and {more} more" if more > 0 else "")}})
    blocks.append({"type": "context", "elements": [
        {"type": "mrkdwn", "text": f"<{document['run']['url']}|run {document['run']['id']}> · "
                                   f"{document['not_applicable']} not applicable"}]})
    return {"text": text, "blocks": blocks}


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def deliver(*, session: Session, webhook: Webhook, run_id: int, event: str, document: dict[str, Any],
            policy: DeliveryPolicy | None = None, client: httpx.Client | None = None,
            settings: Settings | None = None) -> WebhookDelivery:
    """POST the event to the webhook, retrying network errors, 5xx, 408 and 429 (after its
    Retry-After when given) with exponential backoff; other 4xx are the receiver's refusal and are
    not retried. An event already delivered to this webhook for this run is not sent again. Every
    attempt is signed anew (its own timestamp) under the delivery's one id."""
    policy = policy or DeliveryPolicy()
    delivery = session.scalar(select(WebhookDelivery).where(
        WebhookDelivery.webhook_id == webhook.id, WebhookDelivery.run_id == run_id,
        WebhookDelivery.event == event))
    if delivery is not None and delivery.ok:
        return delivery
    payload = slack_payload(document) if webhook.payload_format == PAYLOAD_SLACK else document
    if delivery is None:
        delivery = WebhookDelivery(webhook_id=webhook.id, run_id=run_id, event=event,
                                   delivery_uuid=str(uuid.uuid4()), payload=payload, attempts=0)
        session.add(delivery)
    try:
        secret = unseal(webhook.secret, settings or get_settings())
    except SecretsKeyError as exc:
        # Recorded where the delivery log shows it; nothing is sent unsigned.
        delivery.error = str(exc)
        session.flush()
        log.warning("webhook %s: %s for run %s not sent: %s", webhook.id, event, run_id, exc)
        return delivery
    body = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    headers = {"Content-Type": "application/json", "User-Agent": "optdrift-webhooks", EVENT_HEADER: event}
    # The URL is a credential too (a Slack incoming webhook's path is its key).
    secrets = (secret, webhook.url)
    started = time.monotonic()
    own_client = client is None
    client = client or httpx.Client(timeout=policy.timeout_s, follow_redirects=False)
    try:
        for attempt in range(policy.attempts):
            delivery.attempts += 1
            wait = policy.delay_s(attempt)
            try:
                signed = signed_headers(secret=secret, message_id=delivery.delivery_uuid, body=body)
                response = client.post(webhook.url, content=body, headers={**headers, **signed})
            except httpx.HTTPError as exc:
                delivery.status_code, delivery.error = None, scrub(f"{type(exc).__name__}: {exc}", secrets)
            else:
                delivery.status_code = response.status_code
                if response.is_success:
                    delivery.ok, delivery.error = True, None
                    delivery.delivered_at = datetime.now(timezone.utc)
                    break
                delivery.error = scrub(f"HTTP {response.status_code}: {response.text[:300]}", secrets)
                if response.status_code < 500 and response.status_code not in (408, 429):
                    break
                asked = _retry_after_s(response)
                if asked is not None:
                    wait = min(max(asked, 0.0), policy.max_backoff_s)
            if attempt + 1 < policy.attempts:
                time.sleep(wait)
    finally:
        if own_client:
            client.close()
        delivery.duration_s = time.monotonic() - started
        session.flush()
    if not delivery.ok:
        log.warning("webhook %s: %s for run %s not delivered after %d attempt(s): %s",
                    webhook.id, event, run_id, delivery.attempts, delivery.error)
    return delivery
