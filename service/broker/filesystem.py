"""kombu's filesystem transport with exchange tables created atomically and queues taken in the
worker's order (the embedded default).

kombu (5.x) creates an exchange's table file on first bind by opening it for writing, then locking
and writing it. A second process binding to the same exchange in between finds the file, locks it,
reads it empty and fails with a JSONDecodeError. Two workers started together on one embedded
default hit it in CI: both bind their pidbox queue to `celery.pidbox` at start, and one exited
before it was ready (tests/service/broker/test_broker_filesystem.py fails with kombu's own transport put in
its TRANSPORT).

Here a missing table is first created whole, as "[]", by linking a complete temporary file into
place (a link never replaces an existing file). kombu's bind then always takes its locked
read-modify-write path. Every process of the embedded default (the API publishing, each worker)
uses this transport (service.broker.queueing.celery_config), so none ever creates a table the
other way.

Queue order: kombu's virtual transports poll a consumer's queues with a FairCycle, which starts
each poll at the queue after the one it last took from (round robin), so a worker would alternate
commit and verify runs. Here every poll starts at the first queue, as the Redis transport's
"priority" strategy does (service.broker.queueing.consumed_queues gives the order): a verify run
is taken only while no commit run waits.
"""

from __future__ import annotations

import os
import uuid
from queue import Empty  # what a virtual channel's _get raises for an empty queue

from kombu.transport import filesystem
from kombu.utils.scheduling import FairCycle


class InOrderCycle(FairCycle):
    """A FairCycle that tries its resources from the first on every `get`: the first resource
    with a message wins."""

    def get(self, callback, **kwargs):  # noqa: ANN001, ANN003, ANN201
        self.pos = 0
        return super().get(callback, **kwargs)


class Channel(filesystem.Channel):
    def _reset_cycle(self) -> None:
        self._cycle = InOrderCycle(self._get_and_deliver, self._active_queues, Empty)

    def _queue_bind(self, exchange, routing_key, pattern, queue):  # noqa: ANN001, ANN202
        self._ensure_table(exchange)
        return super()._queue_bind(exchange, routing_key, pattern, queue)

    def _ensure_table(self, exchange: str) -> None:
        table = self._exchange_file(exchange)
        if table.exists():
            return
        self.control_folder.mkdir(parents=True, exist_ok=True)
        staged = table.with_name(f".{table.name}.{os.getpid()}.{uuid.uuid4().hex}")
        staged.write_bytes(b"[]")
        try:
            os.link(staged, table)
        except FileExistsError:  # another process created it first: theirs stands
            pass
        finally:
            staged.unlink()


class Transport(filesystem.Transport):
    Channel = Channel
