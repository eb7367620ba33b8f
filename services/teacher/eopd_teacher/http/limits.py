"""Connection limits of the HTTP side (uvicorn, h11), enforced per connection by `LimitedProtocol`:

- headers: a request's headers must arrive within `header_timeout_s` of the connection opening (or
  of the previous answer on a kept-alive connection), else the connection is closed. uvicorn has no
  such deadline: its keep-alive timer is re-armed by every byte received, so a client sending one
  header line every 25 s held a connection (and a file descriptor) for ever (issue 17, section 3).
- body: once its headers are in, a request's body must arrive within `body_timeout_s`, else the
  connection is closed (issue 33: 4,095 connections sending bodies slowly held the server's whole
  connection budget for as long as they liked).
- connections: at most `ConnectionCounts.total` open at once and `ConnectionCounts.per_peer` from
  one client address (issue 33, section 3); a connection beyond either is answered 503 at once and
  closed, so it holds a file descriptor for microseconds, not until the client gives up. The total is
  also kept below the process's open-file limit (`connection_cap`), so an HTTP flood cannot take the
  descriptors gRPC and the probe listener need to accept their own connections (EMFILE).

uvicorn's `limit_concurrency` (requests in progress) stays as well; see `server.http_config`."""

from __future__ import annotations

import asyncio
import collections
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("eopd_teacher")

# How many connections asyncio accepts in one go (uvicorn's `backlog`, also the listen queue): a
# connection over the caps holds its descriptor until the batch is done (its close is scheduled),
# so one batch can briefly hold this many more than the cap. uvicorn's default is 2048.
ACCEPT_BATCH = 128
# Open files kept out of the HTTP side's reach: one accept batch (ACCEPT_BATCH), gRPC's
# connections, the probe listener, model and log files, threads' descriptors (~100 at rest). At
# least this many, or a quarter of the limit if that is more.
FD_RESERVE_MIN = 2 * ACCEPT_BATCH + 128


def connection_cap(configured: int, open_file_limit: int) -> int:
    """The HTTP side's total connection cap: `configured`, lowered to leave
    max(FD_RESERVE_MIN, limit / 4) descriptors to the rest of the process (at least 1)."""
    reserve = max(FD_RESERVE_MIN, open_file_limit // 4)
    return max(1, min(configured, open_file_limit - reserve))


class ConnectionCounts:
    """Open connections of one listener, in total and per client address (pure bookkeeping)."""

    def __init__(self, total: int, per_peer: int):
        self.total = total
        self.per_peer = per_peer
        self.open = 0
        self.by_peer: collections.Counter[str] = collections.Counter()
        self.refused = 0  # connections refused over either cap (tests, diagnostics)

    def admit(self, peer: str) -> str | None:
        """Counts the connection in and returns None, or returns why it is refused (nothing counted)."""
        if self.open >= self.total:
            self.refused += 1
            return f"{self.open} connections open, limit {self.total}"
        if self.by_peer[peer] >= self.per_peer:
            self.refused += 1
            return f"{self.by_peer[peer]} connections open from your address, limit {self.per_peer} per client"
        self.open += 1
        self.by_peer[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.open -= 1
        self.by_peer[peer] -= 1
        if self.by_peer[peer] <= 0:
            del self.by_peer[peer]


def refusal_bytes(reason: str) -> bytes:
    body = f"service unavailable: {reason}; retry later\n".encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"retry-after: 1\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


class LimitedProtocol(H11Protocol):
    """uvicorn's h11 protocol with header and body deadlines and connection caps (module docstring).
    Subclassed per listener by `limited_protocol`, which sets the class attributes."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    counts: ConnectionCounts = ConnectionCounts(4096, 4096)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        self._deadline_for: object = None  # h11.IDLE: headers due; h11.SEND_BODY: the body
        self._peer = self.client[0] if self.client else "?"
        self._counted = False
        refused = self.counts.admit(self._peer)
        if refused is not None:
            if self.counts.refused % 1000 == 1:  # one line per thousand, not one per refused connection
                log.warning("HTTP connection from %s refused: %s (%d refused so far)", self._peer, refused,
                            self.counts.refused)
            transport.write(refusal_bytes(refused))
            transport.close()
            return
        self._counted = True
        self._arm(h11.IDLE)

    def _arm(self, state: object) -> None:
        self._disarm()
        timeout = self.header_timeout_s if state is h11.IDLE else self.body_timeout_s
        self._deadline_for = state
        self._deadline = self.loop.call_later(timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._deadline_for = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.conn.their_state is self._deadline_for and not self.transport.is_closing():
            self.transport.close()  # the client has not finished asking: no answer is owed

    def _follow_their_state(self) -> None:
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._deadline_for is not h11.SEND_BODY:
                self._arm(h11.SEND_BODY)
        elif state is not h11.IDLE or self._deadline_for is not h11.IDLE:
            self._disarm()  # the request is complete (or the connection done with)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.transport.is_closing():
            self._follow_their_state()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            self._disarm()
        elif self.conn.their_state is h11.IDLE:  # kept alive: the next request's headers are due
            self._arm(h11.IDLE)
        else:
            self._follow_their_state()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._counted = False
            self.counts.release(self._peer)
        super().connection_lost(exc)


def limited_protocol(*, header_timeout_s: float, body_timeout_s: float, max_connections: int,
                     max_connections_per_peer: int) -> type[LimitedProtocol]:
    """The protocol class for one listener's `uvicorn.Config(http=...)`, with its own counts."""
    attrs = {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s,
             "counts": ConnectionCounts(max_connections, max_connections_per_peer)}
    return type("LimitedProtocol", (LimitedProtocol,), attrs)
