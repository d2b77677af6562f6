"""Outgoing webhooks against a real local receiver that verifies the Standard Webhooks signature
itself (with the `standardwebhooks` reference library, not the notifier's code), and the
notification API: settings in, secrets never out, the delivery log."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from standardwebhooks import Webhook as StandardWebhook
from standardwebhooks.webhooks import WebhookVerificationError

from service.db.notify_models import Webhook
from service.notify.hooks import notify_run
from service.notify.webhooks import DeliveryPolicy
from tests.notify_rows import finish_run, make_commit, make_project, make_run

# A secret set before webhooks followed the spec (any 16+ characters): its UTF-8 bytes are the key.
SECRET = "whsec-0123456789abcdef0123"
FAST = DeliveryPolicy(attempts=4, backoff_s=0.05)


class Receiver:
    """Answers each POST with the next status of `script` (then 200), after checking the
    signature header against the raw body it received."""

    def __init__(self, script: list[int] | None = None) -> None:
        self.script = list(script or [])
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *_args) -> None:  # noqa: ANN002
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    StandardWebhook(SECRET.encode()).verify(body, dict(self.headers))
                    signed = True
                except WebhookVerificationError:
                    signed = False
                status = receiver.script.pop(0) if receiver.script else 200
                receiver.received.append({"signed": signed, "json": json.loads(body), "status": status,
                                          "event": self.headers.get("X-Optdrift-Event"),
                                          "delivery": self.headers.get("webhook-id"),
                                          "timestamp": int(self.headers.get("webhook-timestamp", "0"))})
                self.send_response(status if signed else 401)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made: list[Receiver] = []

    def make(script: list[int] | None = None) -> Receiver:
        made.append(Receiver(script))
        return made[-1]

    yield make
    for one in made:
        one.close()


def _webhook(db_session, project, url: str, payload_format: str = "json") -> Webhook:  # noqa: ANN001
    hook = Webhook(project_id=project.id, url=url, secret=SECRET, events=["changed", "broken", "error"],
                   payload_format=payload_format, active=True)
    db_session.add(hook)
    db_session.flush()
    return hook


def _changed_run(db_session, project, outcome: str = "changed"):  # noqa: ANN001, ANN202
    run = make_run(db_session, make_commit(db_session, project, f"{outcome[:2]}" * 20))
    finish_run(db_session, run, outcome=outcome)
    return run


def test_a_receiver_failing_twice_gets_one_delivery_recorded_as_successful(
        db_session, api_settings, api, receiver):  # noqa: ANN001
    project = make_project(db_session)
    target = receiver([500, 503])
    hook = _webhook(db_session, project, target.url)
    run = _changed_run(db_session, project)
    notify_run(session=db_session, run_id=run.id, settings=api_settings, delivery=FAST)
    assert [r["status"] for r in target.received] == [500, 503, 200]
    assert all(r["signed"] for r in target.received)
    # One delivery, the same id on every attempt (receivers dedupe on it).
    assert len({r["delivery"] for r in target.received}) == 1
    document = target.received[-1]["json"]
    assert document["event"] == "changed" and document["run"]["id"] == run.id
    assert {c["case_id"]: (c["family"], c["first_divergent_step"]) for c in document["changed_cases"]} == {
        "adam-wd-a1": ("32bit", 1), "adam-wd-b2": ("32bit", 3), "adam8-c3": ("8bit_blockwise", 2)}
    assert document["not_applicable"] == 1

    # Looked at again (a dependant's notification, the co-run): not sent twice.
    notify_run(session=db_session, run_id=run.id, settings=api_settings, delivery=FAST)
    assert len(target.received) == 3

    log = api.get(f"/api/v1/projects/{project.name}/webhooks/{hook.id}/deliveries")
    assert log.status_code == 200, log.text
    [entry] = log.json()["data"]
    assert (entry["ok"], entry["status_code"], entry["attempts"], entry["error"]) == (True, 200, 3, None)
    assert entry["run_id"] == run.id and entry["event"] == "changed"


def test_a_refusal_is_not_retried_and_its_error_is_logged(db_session, api_settings, receiver):  # noqa: ANN001
    from service.db.notify_models import WebhookDelivery

    project = make_project(db_session)
    target = receiver([410])
    hook = _webhook(db_session, project, target.url)
    run = _changed_run(db_session, project, outcome="broken")
    notify_run(session=db_session, run_id=run.id, settings=api_settings, delivery=FAST)
    [delivery] = db_session.query(WebhookDelivery).filter_by(webhook_id=hook.id).all()
    assert (delivery.ok, delivery.status_code, delivery.attempts) == (False, 410, 1)
    assert delivery.event == "broken" and "HTTP 410" in delivery.error


def test_unsubscribed_outcomes_send_nothing(db_session, api_settings, receiver):  # noqa: ANN001
    project = make_project(db_session)
    target = receiver()
    _webhook(db_session, project, target.url)
    run = _changed_run(db_session, project, outcome="unchanged")
    notify_run(session=db_session, run_id=run.id, settings=api_settings, delivery=FAST)
    assert target.received == []


def test_slack_payload_is_text_plus_blocks(db_session, api_settings, receiver):  # noqa: ANN001
    project = make_project(db_session)
    target = receiver()
    _webhook(db_session, project, target.url, payload_format="slack")
    run = make_run(db_session, make_commit(db_session, project, "ee" * 20))
    finish_run(db_session, run, outcome="error", status="error")
    notify_run(session=db_session, run_id=run.id, settings=api_settings, delivery=FAST)
    [message] = target.received
    body = message["json"]
    assert message["signed"] and message["event"] == "error"
    assert set(body) == {"text", "blocks"} and f"/runs/{run.id}" in body["text"]
    assert "*error*" in body["text"]
    assert [block["type"] for block in body["blocks"]][-1] == "context"
    for block in body["blocks"]:
        texts = [block["text"]] if "text" in block else block["elements"]
        assert all(t["type"] == "mrkdwn" and t["text"] for t in texts)


def test_notification_settings_api_never_returns_a_secret(api, db_session):  # noqa: ANN001
    project = make_project(db_session)
    token = "ghp_apisecretvalue0123456789abcd"
    base = f"/api/v1/projects/{project.name}"
    answer = api.put(f"{base}/github", json={"repository": "octo/kernels", "auth": "token", "token": token})
    assert answer.status_code == 200, answer.text
    assert answer.json()["has_token"] is True and token not in answer.text
    assert token not in api.get(f"{base}/github").text
    refused = api.put(f"{base}/github", json={"repository": "octo/kernels", "auth": "app", "app_id": "1"})
    assert refused.status_code == 422 and "app_id` and `private_key`" in refused.text
    bad_repo = api.put(f"{base}/github", json={"repository": "not a repo", "token": token})
    assert bad_repo.status_code == 422 and token not in bad_repo.text

    created = api.post(f"{base}/webhooks", json={"url": "https://hooks.example.org/x/T0/B0", "secret": SECRET,
                                                  "payload_format": "slack"})
    assert created.status_code == 201, created.text
    assert SECRET not in created.text and created.json()["events"] == ["changed", "broken", "error"]
    # The URL's path is masked too: a Slack incoming webhook's path is its key.
    assert created.json()["url"] == "https://hooks.example.org/…"
    assert SECRET not in api.get(f"{base}/webhooks").text and "/x" not in api.get(f"{base}/webhooks").text
    short = api.post(f"{base}/webhooks", json={"url": "https://hooks.example.org/x", "secret": "short"})
    assert short.status_code == 422 and "at least 16 characters" in short.text
    missing = api.get(f"{base}/webhooks/{created.json()['id'] + 1000}/deliveries")
    assert missing.status_code == 404
    assert api.delete(f"{base}/webhooks/{created.json()['id']}").status_code == 204
    assert api.delete(f"{base}/github").status_code == 204
    assert api.get(f"{base}/github").status_code == 404
