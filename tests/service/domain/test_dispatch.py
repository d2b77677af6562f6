"""Dispatching is written once (service/domain/dispatch.py dispatch_run): the runs the API queued and
the runs a worker queued again (service.run_store.send_again: a retry, a verify run that yielded)
reach the broker through one function, which sends the run on its kind's queue and marks when the
broker hands it out; a run the broker does not take stays queued with no dispatch time, for the
maintenance loop. On the real PostgreSQL and Redis."""

from __future__ import annotations

import ast
import base64
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import redis

from service import run_store
from service.db.models import Run
from service.domain import dispatch
from tests.service.test_run_store import _commit_run

ROOT = Path(__file__).resolve().parents[3]
BROKER_DOWN = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def _callers_of(name: str) -> list[tuple[str, str]]:
    """(file, enclosing function) of every call of `name` in service/ and worker/."""
    found = []
    for path in sorted([*ROOT.joinpath("service").rglob("*.py"), *ROOT.joinpath("worker").rglob("*.py")]):
        tree = ast.parse(path.read_text(), filename=str(path))
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == name
                                                   or getattr(node.func, "attr", None) == name):
                    found.append((str(path.relative_to(ROOT)), function.name))
    return sorted(set(found))


def test_one_function_hands_a_run_to_the_broker() -> None:
    assert _callers_of("send_run") == [("service/domain/dispatch.py", "dispatch_run")]


def _queued_run_ids(settings, queue: str) -> list[int]:  # noqa: ANN001
    raw = redis.Redis.from_url(settings.broker_url).lrange(queue, 0, -1)
    return [json.loads(base64.b64decode(json.loads(message)["body"]))[0][0] for message in raw]


def test_a_run_sent_again_is_marked_when_the_broker_hands_it_out_or_stays_for_the_maintenance_loop(
        db_session, api_settings) -> None:  # noqa: ANN001
    run = _commit_run(db_session, api_settings, "a", [])
    down = api_settings.model_copy(update={"broker_url": BROKER_DOWN})

    # The broker does not take it: from the API or from a worker, it stays queued, unmarked.
    assert dispatch.dispatch_runs(session=db_session, settings=down, run_ids=[run.id]) == []
    run_store.send_again(run.id, settings=down, delay=30.0, session=db_session)
    db_session.refresh(run)
    assert (run.status, run.dispatched_at) == ("queued", None)
    assert _queued_run_ids(api_settings, "cpu") == []

    # A worker's retry: on the run's queue, marked as handed out after its backoff.
    before = datetime.now(timezone.utc)
    run_store.send_again(run.id, settings=api_settings, delay=30.0, session=db_session)
    db_session.refresh(run)
    assert _queued_run_ids(api_settings, "cpu") == [run.id]
    assert before + timedelta(seconds=30) <= run.dispatched_at <= datetime.now(timezone.utc) + timedelta(seconds=30)

    # The API's: at once.
    db_session.execute(Run.__table__.update().where(Run.id == run.id).values(dispatched_at=None))
    before = datetime.now(timezone.utc)
    assert dispatch.dispatch_runs(session=db_session, settings=api_settings, run_ids=[run.id]) == [run.id]
    db_session.refresh(run)
    assert before <= run.dispatched_at <= datetime.now(timezone.utc)
