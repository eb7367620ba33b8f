"""Admission of `POST /v1/completions` (issue 33, section 1): the same limits as a gRPC unary call,
taken through the shared objects' public API, and what a request may cost before it is refused.

- Content type: a body declared as anything but JSON (`application/json`, `*/*+json`) is refused
  with 415 before it is read (no Content-Type at all is taken as JSON, as FastAPI and vLLM do).
- Calls: each request holds one of the server's `max_concurrent_calls` slots (`ServerState.calls`, a `PerClientLimit` shared
  with gRPC's unary calls) while it is served, within the caller's per-client share (its address,
  `shares.share_key`); none free: 429 before the body is read.
- Bytes: the body's bytes are taken from the server-wide `ByteBudget` (`max_inflight_request_bytes`,
  shared with gRPC, and the caller's share of it) while the request is served: the declared Content-Length before reading, else
  each chunk as it arrives; over the budget: 429. The body itself is bounded (`body_limit`; 413).
- Disconnects: the work runs beside a watch of the connection (`until_disconnected`); when the
  client goes away the work is cancelled (a generation stops: the engine is told, as for a gRPC
  caller that cancels). A client that disconnects mid-body costs one short log line at most
  (`AbortLog`, rate-limited), never a traceback.

The client identity (x-eopd-client header, else the peer address) is the one gRPC uses
(`openai_compat._client`), for the batcher's fair queue and the per-client in-flight tokens; the
per-client shares of the global limits key on the address alone (`peer_share_key`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect

from ..serving.shares import share_key
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
    """415 unless the body is declared as JSON (or not declared at all)."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
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
        """The request's body, read within `body_limit` (413) and the byte budget (429), with a call
        slot held (429 when none is free, before reading); all given back when the block ends."""
        json_content_type(request)
        calls, budget, key = self.state.calls, self.state.request_bytes, peer_share_key(request)
        if not calls.try_take(1, key):
            if calls.refusal(1, key) == "share":
                raise CompatError(429, calls.share_message("calls in progress", "max_concurrent_calls", key))
            raise CompatError(429, f"{calls.held} calls in progress, limit {calls.limit} (max_concurrent_calls); retry later")
        taken = 0

        def take(nbytes: int) -> None:
            nonlocal taken
            if not budget.try_take(nbytes, key):
                raise CompatError(429, budget.refused_message(nbytes, key, what="this request"))
            taken += nbytes

        try:
            declared = request.headers.get("content-length")
            declared_n = int(declared) if declared is not None and declared.isdigit() else None
            if declared_n is not None and declared_n > body_limit:
                raise CompatError(413, f"body: {declared} bytes exceed the server's limit of {body_limit} bytes")
            if declared_n is not None:
                take(declared_n)
            chunks, size = [], 0
            try:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > body_limit:
                        raise CompatError(413, f"body: over the server's limit of {body_limit} bytes")
                    if declared_n is None:
                        take(len(chunk))
                    chunks.append(chunk)
            except ClientDisconnect:
                self.aborts.aborted()
                raise CompatError(499, "the client disconnected before sending the whole body") from None
            yield b"".join(chunks)
        finally:
            calls.give(1, key)
            if taken:
                budget.give(taken, key)


def peer_address(request: Request) -> str:
    """The peer as the gRPC side names it ("ipv4:1.2.3.4", "ipv6:[::1]", "unknown"), without its port."""
    if request.client is None:
        return "unknown"
    host = request.client.host
    return f"ipv6:[{host}]" if ":" in host else f"ipv4:{host}"


def peer_share_key(request: Request) -> str:
    """Whose share of the global limits a request counts against (`shares.share_key`: its address)."""
    return share_key(peer_address(request))


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
