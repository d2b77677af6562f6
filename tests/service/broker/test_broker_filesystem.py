"""The embedded default's broker: processes binding to one exchange at once (service/broker/filesystem.py).

In CI two workers started together; one exited before it was ready, with a JSONDecodeError in
kombu's filesystem transport: it had read the `celery.pidbox` exchange table while the other was
creating it. Here several processes bind a queue each to one fresh exchange at the same moment (a
barrier), over several fresh folders: every bind must succeed and the table must hold every queue.
With TRANSPORT = "filesystem" (kombu's own) this fails: tried once on the 2-core development
machine, a binding was lost in the second round."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

from kombu import Connection, Exchange, Queue

from service.broker import filesystem as fs_broker
from service.broker.queueing import celery_config
from service.settings import Settings

TRANSPORT = "service.broker.filesystem:Transport"


def _bind(folder: str, name: str, barrier, errors) -> None:  # noqa: ANN001
    try:
        options = {"data_folder_in": f"{folder}/q", "data_folder_out": f"{folder}/q", "control_folder": f"{folder}/c"}
        with Connection("filesystem://", transport=TRANSPORT, transport_options=options) as connection:
            channel = connection.channel()
            barrier.wait(timeout=30)
            Queue(name, Exchange("shared", type="fanout"), routing_key="")(channel).declare()
        errors.put("")
    except Exception as error:  # noqa: BLE001 - reported to the test
        errors.put(repr(error))


def test_processes_binding_to_one_new_exchange_at_once_all_succeed(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    processes = 6
    for round_number in range(12):
        folder = tmp_path / f"round{round_number}"
        (folder / "q").mkdir(parents=True)
        barrier, errors = context.Barrier(processes), context.Queue()
        workers = [context.Process(target=_bind, args=(str(folder), f"q{i}", barrier, errors))
                   for i in range(processes)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        failures = [message for message in (errors.get(timeout=10) for _ in workers) if message]
        assert failures == [], (round_number, failures)
        table = json.loads((folder / "c" / "shared.exchange").read_text())
        assert sorted(entry[2] for entry in table) == [f"q{i}" for i in range(processes)], (round_number, table)
        assert not [p.name for p in (folder / "c").iterdir() if p.name.startswith(".")]  # no staged file left


def test_the_embedded_default_uses_it(tmp_path: Path) -> None:
    config = celery_config(Settings(home=tmp_path))
    assert config["broker_url"].startswith("filesystem://") and config["broker_transport"] == TRANSPORT
    assert fs_broker.Transport.Channel is fs_broker.Channel
