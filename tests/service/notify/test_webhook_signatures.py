"""Outgoing webhooks follow the Standard Webhooks spec: what the notifier sends, captured by a real
local receiver, is verified with the `standardwebhooks` reference library (the consumers' code, not
ours). Every attempt of one delivery carries the same `webhook-id`; a captured delivery does not
verify once replayed past the library's tolerance, nor with another id or timestamp, nor with a
tampered body. Secrets: the spec's `whsec_` form, or a secret from before (its UTF-8 bytes are the
key, i.e. `whsec_` + base64 of them).
"""

from __future__ import annotations

import base64
import threading
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import standardwebhooks.webhooks as standard_module
from standardwebhooks import Webhook as StandardWebhook
from standardwebhooks.webhooks import WebhookVerificationError

from service.db.notify_models import WebhookDelivery
from service.notify.hooks import notify_run
from service.notify.webhooks import DeliveryPolicy
from tests.notify_rows import finish_run, make_commit, make_project, make_run

SECRET = "whsec_" + base64.b64encode(bytes(range(32))).decode()
FAST = DeliveryPolicy(attempts=4, backoff_s=0.05)
# The library's tolerance for a delivery's age (standardwebhooks.webhooks: five minutes).
TOLERANCE = timedelta(minutes=5)


class Capture:
    """A receiver that stores every request as it came (headers, raw body) and answers the next
    status of `script` (then 200)."""

    def __init__(self, script: list[int]) -> None:
        self.script, self.requests = list(script), []
        capture = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:  # noqa: ANN002
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                capture.requests.append((dict(self.headers), body))
                self.send_response(capture.script.pop(0) if capture.script else 200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def capture():
    made: list[Capture] = []

    def make(script: list[int] | None = None) -> Capture:
        made.append(Capture(script or []))
        return made[-1]

    yield make
    for one in made:
        one.close()


def _deliver(api, db_session, api_settings, target: Capture, secret: str) -> WebhookDelivery:  # noqa: ANN001
    """A webhook made through the API (its secret stored encrypted), a changed run, its delivery."""
    project = make_project(db_session)
    created = api.post(f"/api/v1/projects/{project.name}/webhooks", json={"url": target.url, "secret": secret})
    assert created.status_code == 201, created.text
    run = make_run(db_session, make_commit(db_session, project, "5a" * 20))
    finish_run(db_session, run, outcome="changed")
    notify_run(session=db_session, run_id=run.id, settings=api_settings, delivery=FAST)
    return db_session.query(WebhookDelivery).filter_by(webhook_id=created.json()["id"]).one()


class _Later(datetime):
    """The library's clock, moved past its tolerance: a receiver checking a replay later."""

    @classmethod
    def now(cls, tz=None):  # noqa: ANN001, ANN206
        return datetime.now(tz) + TOLERANCE + timedelta(seconds=2)


def test_every_attempt_verifies_with_the_reference_library_under_one_id(api, db_session, api_settings,
                                                                         capture):  # noqa: ANN001
    target = capture([500, 503])
    delivery = _deliver(api, db_session, api_settings, target, SECRET)
    assert (delivery.ok, delivery.attempts) == (True, 3)
    assert len(target.requests) == 3
    verifier = StandardWebhook(SECRET)
    for headers, body in target.requests:
        document = verifier.verify(body, headers)  # raises WebhookVerificationError if not
        assert document["event"] == "changed"
        assert headers["webhook-signature"].startswith("v1,")
        assert abs(int(headers["webhook-timestamp"]) - datetime.now(timezone.utc).timestamp()) < 60
        # The replayable body-only signature is gone.
        assert "X-Optdrift-Signature-256" not in headers
    # One delivery, one id on every retry (receivers dedupe on it), the one the delivery log shows.
    assert {headers["webhook-id"] for headers, _ in target.requests} == {delivery.delivery_uuid}


def test_a_captured_delivery_replayed_after_the_tolerance_does_not_verify(api, db_session, api_settings,
                                                                          capture, monkeypatch):  # noqa: ANN001
    target = capture()
    _deliver(api, db_session, api_settings, target, SECRET)
    [(headers, body)] = target.requests
    verifier = StandardWebhook(SECRET)
    verifier.verify(body, headers)  # fresh: accepted
    monkeypatch.setattr(standard_module, "datetime", _Later)
    with pytest.raises(WebhookVerificationError, match="too old"):
        verifier.verify(body, headers)


def test_a_replay_with_a_fresh_id_or_timestamp_or_a_tampered_body_does_not_verify(
        api, db_session, api_settings, capture):  # noqa: ANN001
    target = capture()
    _deliver(api, db_session, api_settings, target, SECRET)
    [(headers, body)] = target.requests
    verifier = StandardWebhook(SECRET)
    verifier.verify(body, headers)
    now = str(int(datetime.now(timezone.utc).timestamp()))
    replays = {
        "a fresh id": ({**headers, "webhook-id": "b0b0b0b0-0000-4000-8000-000000000000"}, body),
        "a fresh timestamp": ({**headers, "webhook-timestamp": now if now != headers["webhook-timestamp"]
                               else str(int(now) + 1)}, body),
        "a tampered body": (headers, body.replace(b'"changed"', b'"broken"', 1)),
        "no signature": ({k: v for k, v in headers.items() if k.lower() != "webhook-signature"}, body),
    }
    assert replays["a tampered body"][1] != body
    for what, (replay_headers, replay_body) in replays.items():
        with pytest.raises(WebhookVerificationError):
            verifier.verify(replay_body, replay_headers)
            pytest.fail(f"a replay with {what} verified")


def test_a_secret_from_before_the_spec_signs_with_its_bytes(api, db_session, api_settings, capture):  # noqa: ANN001
    legacy = "0123456789abcdef0123456789abcdef"  # `openssl rand -hex 16`, as the docs used to say
    target = capture()
    _deliver(api, db_session, api_settings, target, legacy)
    [(headers, body)] = target.requests
    # What docs/INTEGRATIONS.md tells such a receiver: the secret's bytes, or its whsec_ form.
    StandardWebhook(legacy.encode()).verify(body, headers)
    StandardWebhook("whsec_" + base64.b64encode(legacy.encode()).decode()).verify(body, headers)
    with pytest.raises(WebhookVerificationError):
        StandardWebhook(SECRET).verify(body, headers)


def test_new_secrets_are_checked(api, db_session):  # noqa: ANN001
    project = make_project(db_session)
    url = f"/api/v1/projects/{project.name}/webhooks"
    for secret, message in [
            ("whsec_not*base64*at*all*0123456789", "is not base64 of 24 to 64 bytes"),
            ("whsec_" + base64.b64encode(b"x" * 8).decode(), "is not base64 of 24 to 64 bytes"),
            ("short", "at least 16 characters")]:
        refused = api.post(url, json={"url": "https://hooks.example.org/x", "secret": secret})
        assert refused.status_code == 422 and message in refused.text, refused.text
        assert "openssl rand -base64 32" in refused.text and secret not in refused.text


def test_without_the_key_nothing_is_sent_and_the_delivery_says_why(api, db_session, api_settings, capture,
                                                                    tmp_path):  # noqa: ANN001
    target = capture()
    project = make_project(db_session)
    created = api.post(f"/api/v1/projects/{project.name}/webhooks", json={"url": target.url, "secret": SECRET})
    assert created.status_code == 201, created.text
    run = make_run(db_session, make_commit(db_session, project, "6b" * 20))
    finish_run(db_session, run, outcome="changed")
    # A worker whose OPTDRIFT_HOME holds no key and that was given none.
    keyless = api_settings.model_copy(update={"home": tmp_path / "worker-home"})
    notify_run(session=db_session, run_id=run.id, settings=keyless, delivery=FAST)
    delivery = db_session.query(WebhookDelivery).filter_by(webhook_id=created.json()["id"]).one()
    assert target.requests == [] and not delivery.ok
    assert "no secrets key at" in delivery.error and "OPTDRIFT_SECRETS_KEY" in delivery.error
