"""Deadlines for slow clients: uvicorn closes an idle keep-alive connection (`timeout_keep_alive`)
but waits for ever on one that sends half a request, so 200 slow-header or slow-body connections
held the API's sockets and memory indefinitely. This protocol (uvicorn's h11 one, given to
uvicorn.Config as `http=`) adds the two read deadlines Apache's mod_reqtimeout enforces:

- headers: a request's line and headers must arrive within `header_s` of the connection opening
  (or of the first byte of the next request on a kept-alive connection);
- body: the body must arrive within `body_s` of the headers, plus one second per `min_rate` bytes
  received, so a large upload at a fair pace finishes and a trickle does not. Time during which
  the server itself stopped reading (flow control: the app has not consumed what it has) does not
  count against the client.

A connection past its deadline is closed (the app, if it was reading the body, sees a disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import h11
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from service.settings import Settings

log = logging.getLogger(__name__)


class _TimedFlowControl(FlowControl):
    """uvicorn's flow control, counting the seconds reading was paused by the server."""

    def __init__(self, transport: asyncio.Transport) -> None:
        super().__init__(transport)
        self._paused_total = 0.0
        self._paused_at: float | None = None

    def pause_reading(self) -> None:
        if not self.read_paused:
            self._paused_at = time.monotonic()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self._paused_at is not None:
            self._paused_total += time.monotonic() - self._paused_at
            self._paused_at = None
        super().resume_reading()

    def paused_s(self) -> float:
        """Seconds reading has been paused so far, the current pause included."""
        ongoing = time.monotonic() - self._paused_at if self._paused_at is not None else 0.0
        return self._paused_total + ongoing


class DeadlineH11Protocol(H11Protocol):
    header_s: float = 10.0
    body_s: float = 30.0
    min_rate: int = 500

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None  # "headers", "body" or None (nothing awaited from the client)
        self._phase_start = 0.0
        self._body_bytes = 0
        self._paused_at_start = 0.0
        self._deadline_timer: asyncio.TimerHandle | None = None

    # ---- the phases
    def _enter(self, phase: str | None) -> None:
        self._phase, self._phase_start, self._body_bytes = phase, time.monotonic(), 0
        self._paused_at_start = self.flow.paused_s()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if phase is not None:
            self._deadline_timer = self.loop.call_later(self._allowed_s(), self._check_deadline)

    def _allowed_s(self) -> float:
        if self._phase == "headers":
            return self.header_s
        paused = self.flow.paused_s() - self._paused_at_start
        return self.body_s + self._body_bytes / self.min_rate + paused

    def _follow_state(self) -> None:
        state = self.conn.their_state
        if self._phase == "headers" and state is not h11.IDLE:
            self._enter("body" if state is h11.SEND_BODY else None)
        elif self._phase == "body" and state is not h11.SEND_BODY:
            self._enter(None)

    def _check_deadline(self) -> None:
        self._deadline_timer = None
        if self._phase is None or self.transport.is_closing():
            return
        now = time.monotonic()
        left = self._phase_start + self._allowed_s() - now
        if self.flow.read_paused or getattr(self.cycle, "waiting_for_100_continue", False):
            # The server stopped reading, or has not yet asked for the body (Expect: 100-continue):
            # the client is not the slow one.
            left = max(left, 1.0)
        if left > 0:
            self._deadline_timer = self.loop.call_later(left, self._check_deadline)
            return
        client = "%s:%d" % self.client if self.client else "a client"
        log.warning("closed the connection from %s: request %s not received within %.0f s", client,
                    "headers" if self._phase == "headers" else "body", now - self._phase_start)
        self._phase = None
        self.transport.close()

    # ---- uvicorn's protocol hooks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = _TimedFlowControl(transport)
        self._enter("headers")

    def data_received(self, data: bytes) -> None:
        if self._phase is None and self.conn.their_state is h11.IDLE:
            self._enter("headers")  # the first bytes of the next request on a kept-alive connection
        elif self._phase == "body":
            self._body_bytes += len(data)
        super().data_received(data)
        self._follow_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request already read may have moved the client's state on.
        if self._phase is not None:
            self._follow_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        super().connection_lost(exc)


def protocol_for(settings: Settings) -> type[DeadlineH11Protocol]:
    """The protocol class with the settings' deadlines (uvicorn instantiates it per connection)."""
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), {
        "header_s": settings.request_header_timeout_s, "body_s": settings.request_body_timeout_s,
        "min_rate": settings.request_body_min_rate})


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """What `optdrift serve` gives uvicorn.Config so idle and slow connections are closed."""
    return {"http": protocol_for(settings), "timeout_keep_alive": settings.keep_alive_timeout_s}
