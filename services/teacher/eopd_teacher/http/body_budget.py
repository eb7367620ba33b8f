"""The request-body bytes the HTTP side holds at once, bounded in total (an ASGI middleware).

A route reads its whole body before it answers (`/v1/completions` up to its per-request limit), so
each open request may hold a body in memory; 256 requests that sent 8 MiB bodies and held them cost
+1,957 MiB of RSS (issue 33). `BodyBudget` counts the body bytes of requests in progress against
`limit`: a request whose declared `Content-Length` does not fit beside those held is answered 503
(`Retry-After: 1`) before its body is read; one without a length (chunked) is counted as its chunks
arrive and, when the next one does not fit, answered the same 503, the route seeing the client gone.
A request alone is always admitted (its own limit is the route's). Held bytes are given back when
the request is answered; after a large body the `on_large_body_done` callback runs (the server's
`MemoryReturner`: the freed buffers handed back to the system).

Also: a client that disconnects while its request is read or served is logged as one line, not as
the route's traceback (`ClientDisconnect`: 4.65 KB of log per aborted POST)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("eopd_teacher")

LARGE_BODY_BYTES = 1 << 20  # a body at least this large calls on_large_body_done once answered


class BodyBudget:
    """Request-body bytes held by requests in progress, at most `limit` (module docstring)."""

    def __init__(self, app: ASGIApp, limit: int, on_large_body_done: Callable[[int], None] | None = None):
        self.app = app
        self.limit = limit
        self.held = 0
        self.peak = 0
        self.refused = 0
        self.on_large_body_done = on_large_body_done

    def _fits(self, nbytes: int, own: int = 0) -> bool:
        """Whether `nbytes` more fit beside what is held (`own` of it by the asking request: alone, it fits)."""
        return self.held == own or self.held + nbytes <= self.limit

    def _take(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _refusal(self, nbytes: int) -> bytes:
        self.refused += 1
        return (f"request bodies: {self.held} bytes held by requests in progress, this one adds {nbytes}, "
                f"limit {self.limit} (http_max_inflight_body_bytes); retry later\n").encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope) or 0
        if declared > self.limit:
            declared = 0  # over any budget: the route refuses it (413) unread, or its bytes count as they come
        elif declared > 0 and not self._fits(declared):
            await _answer_503(send, self._refusal(declared))
            return
        request = _Request(self, declared, receive, send)
        try:
            await self.app(scope, request.receive, request.send)
        except Exception:
            if not (request.refused or request.disconnected):
                raise
            if request.disconnected and not request.refused:
                log.info("HTTP client %s went away during %s %s", _client(scope), scope.get("method"), scope.get("path"))
        finally:
            request.done()


class _Request:
    """One request's share of the budget: declared bytes taken at once, chunked bytes as they arrive."""

    def __init__(self, budget: BodyBudget, declared: int, receive: Receive, send: Send):
        self.budget, self._receive, self._send = budget, receive, send
        self.taken = declared
        budget._take(declared)
        self.received = 0
        self.started = False  # a response has started
        self.refused = False  # this middleware answered 503 mid-body; the route sees a disconnect
        self.disconnected = False

    async def receive(self) -> Message:
        if self.refused:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.disconnected = True
        elif message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            extra = self.received - self.taken
            if extra > 0:
                if not self.budget._fits(extra, own=self.taken) and not self.started:
                    self.refused = True
                    await _answer_503(self._send, self.budget._refusal(self.received))
                    return {"type": "http.disconnect"}
                self.budget._take(extra)
                self.taken += extra
        return message

    async def send(self, message: Message) -> None:
        if self.refused:
            return  # answered already
        self.started = True
        await self._send(message)

    def done(self) -> None:
        self.budget.held -= self.taken
        if self.taken >= LARGE_BODY_BYTES and self.budget.on_large_body_done is not None:
            self.budget.on_large_body_done(self.taken)
        self.taken = 0


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses a malformed length before the app sees it
    return None


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "?"


async def _answer_503(send: Send, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"retry-after", b"1"),
                            (b"content-length", str(len(body)).encode()), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})
