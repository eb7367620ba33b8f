"""Connection limits of the HTTP side (uvicorn, h11): a request's headers must arrive within
`header_timeout_s` of the connection opening (or of the previous answer on a kept-alive
connection), else the connection is closed. uvicorn has no such deadline: its keep-alive timer is
re-armed by every byte received, so a client sending one header line every 25 s held a connection
(and a file descriptor) for ever (issue 17, section 3: 1050 such connections starved /readyz and
gRPC). The connection count is bounded by uvicorn's `limit_concurrency` (503 beyond), set from
the settings in `server.http_config`."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers (`header_timeout_s`)."""

    header_timeout_s: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self._disarm_header_deadline()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _headers_too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # no answer: the client has not finished asking

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a request's headers are complete
            self._disarm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            self._disarm_header_deadline()
        elif self.conn.their_state is h11.IDLE:  # kept alive: the next request's headers are due
            self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        super().connection_lost(exc)


def header_deadline_protocol(header_timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for `uvicorn.Config(http=...)` with this header deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
