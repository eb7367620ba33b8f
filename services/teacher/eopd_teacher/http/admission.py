"""Admission of `POST /v1/completions` (issue 33, section 1): the same limits as a gRPC unary call,
taken through the shared objects' public API, and what a request may cost before it is refused.

- Content type: a body not declared as JSON (`application/json`, `application/*+json`), or declared
  as nothing, is refused with 415 before it is read: a browser sends a cross-origin POST without a
  preflight only as text/plain, a form, or with no Content-Type, so none of those reaches the engine
  (issue 49).
- Bodies: while its body arrives a request holds one of the HTTP side's own `http_max_concurrent_bodies`
  slots (`ServerState.http_bodies`, within the caller's share of it; none free: 429 before the body
  is read) and its bytes count against `http_max_inflight_body_bytes` (`body_budget.BodyBudget`);
  the body itself is bounded (`body_limit`; 413). Slow bodies therefore hold nothing gRPC needs
  (issue 49, finding 2: 64 bodies that never finished held every gRPC call slot).
- Calls and bytes: once its body has arrived, the request holds one of the server's
  `max_concurrent_calls` slots (`ServerState.calls`, shared with gRPC's unary calls) and its bytes in
  the server-wide `ByteBudget` (`max_inflight_request_bytes`, shared with gRPC), each within the
  caller's share, while it is served; either full: 429.
- Disconnects: the work runs beside a watch of the connection (`until_disconnected`); when the
  client goes away the work is cancelled (a generation stops: the engine is told, as for a gRPC
  caller that cancels). A client that disconnects mid-body costs one short log line at most
  (`AbortLog`, rate-limited), never a traceback.

The client identity (x-eopd-client header, else the peer address) is the one gRPC uses
(`openai_compat._client`), for the batcher's fair queue and the per-client in-flight tokens; the
per-client shares of the global limits key on who the caller is (`peer_share_key`,
`shares.Identities`: the bearer token it presented at its address, else its address)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..serving.shares import Identities, peer_name
from ..serving.state import ServerState
from .openai_format import CompatError

log = logging.getLogger("eopd_teacher")

T = TypeVar("T")
DISCONNECT_POLL_S = 0.1  # how often a request in progress checks that its client is still there
ABORT_LOG_INTERVAL_S = 10.0


class AbortLog:
    """One short line per `interval_s` at most for clients that went away mid-body, with the count
    since the last line (a flood of aborted POSTs must not flood the log)."""

    def __init__(self, interval_s: float = ABORT_LOG_INTERVAL_S):
        self.interval_s = interval_s
        self.pending = 0
        self._last = float("-inf")

    def aborted(self) -> None:
        self.pending += 1
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            log.info("/v1/completions: %d client(s) disconnected before sending the whole body", self.pending)
            self.pending, self._last = 0, now


def json_content_type(request: Request) -> None:
    """415 unless the body is declared as JSON (a missing Content-Type included)."""
    declared = request.headers.get("content-type")
    if declared is None:
        raise CompatError(415, "content-type: missing; send the body as application/json", "content-type")
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise CompatError(415, f"content-type: {declared[:100]!r}; send the body as application/json", "content-type")


class Admission:
    """The shared call slots and byte budget, taken for one request (`admitted`)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.aborts = AbortLog()

    @contextlib.asynccontextmanager
    async def admitted(self, request: Request, body_limit: int) -> AsyncIterator[bytes]:
        """The request's body (`_body`), then a call slot and its bytes in the shared budget, held
        while the block runs (429 when either is full); all given back when the block ends."""
        key = peer_share_key(request, self.state.identities)
        raw = await self._body(request, body_limit, key)
        calls, budget = self.state.calls, self.state.request_bytes
        if not calls.try_take(1, key):
            if calls.refusal(1, key) == "share":
                raise CompatError(429, calls.share_message("calls in progress", "max_concurrent_calls", key))
            raise CompatError(429, f"{calls.held} calls in progress, limit {calls.limit} (max_concurrent_calls); retry later")
        try:
            if not budget.try_take(len(raw), key):
                raise CompatError(429, budget.refused_message(len(raw), key, what="this request"))
            try:
                yield raw
            finally:
                budget.give(len(raw), key)
        finally:
            calls.give(1, key)

    async def _body(self, request: Request, body_limit: int, key: str) -> bytes:
        """The body, declared as JSON (415) and within `body_limit` (413), read while one of the HTTP
        side's body slots is held (429 when none is free, before reading)."""
        json_content_type(request)
        bodies = self.state.http_bodies
        if not bodies.try_take(1, key):
            if bodies.refusal(1, key) == "share":
                raise CompatError(429, bodies.share_message("request bodies arriving", "http_max_concurrent_bodies", key))
            raise CompatError(429, f"{bodies.held} request bodies arriving, limit {bodies.limit} "
                                   "(http_max_concurrent_bodies); retry later")
        try:
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > body_limit:
                raise CompatError(413, f"body: {declared} bytes exceed the server's limit of {body_limit} bytes")
            chunks, size = [], 0
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > body_limit:
                        raise CompatError(413, f"body: over the server's limit of {body_limit} bytes")
                    chunks.append(chunk)
            except ClientDisconnect:
                self.aborts.aborted()
                raise CompatError(499, "the client disconnected before sending the whole body") from None
            return b"".join(chunks)
        finally:
            bodies.give(1, key)


def peer_address(request: Request) -> str:
    """The peer as the gRPC side names it ("ipv4:1.2.3.4", "ipv6:[::1]", "unknown"), without its port."""
    if request.client is None:
        return "unknown"
    return peer_name(request.client.host)


def peer_share_key(request: Request, identities: Identities) -> str:
    """Whose share of the global limits a request counts against (`shares.Identities.key`: the bearer
    token it presented at its address, else its address)."""
    return identities.key(peer_address(request), request.headers.get("authorization"))


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (and 499) once the client has gone away, checked every
    DISCONNECT_POLL_S, so that an abandoned request (a long generation) stops costing the engine."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise CompatError(499, "the client disconnected; its request was cancelled")
    finally:
        if not task.done():
            task.cancel()
