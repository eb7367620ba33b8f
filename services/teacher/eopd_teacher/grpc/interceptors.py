"""gRPC server interceptors: the status policy applied to TeacherService handlers (statuses,
logs, per-method metrics, the concurrent-call limit and each client's share of it, the deadline
for receiving a unary call's request, the limit on health Watch streams) and the bearer-token check.

Bytes in flight: a unary TeacherService call is served by a request-streaming handler that reads
its one message itself, so a call refused before its body matters (over `max_concurrent_calls`,
or without a valid bearer token) is answered without reading the body at all: its bytes never
leave gRPC's flow-control window (issue 17, section 2)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from ..convert import NOT_RETRYABLE_KEY
from ..serving.batcher import Overloaded
from ..serving.metrics import TeacherMetrics
from ..serving.resources import ByteBudget, MemoryReturner
from ..serving.shares import Identities, PerClientLimit
from ..serving.status import DeadlinePassed, describe
from ..validation import InvalidRequest, RequestTooLarge
from .servicer import SERVICE_NAME, client_share_key

log = logging.getLogger("eopd_teacher")

HEALTH_WATCH = "/grpc.health.v1.Health/Watch"


def _decoder(deserializer: Callable[[bytes], object] | None) -> Callable[[bytes], object]:
    """Protobuf decoding inside the handler, so malformed bytes get INVALID_ARGUMENT with the
    reason instead of gRPC's generic UNKNOWN."""
    if deserializer is None:
        return lambda raw: raw

    def decode(raw: bytes) -> object:
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and friends
            raise InvalidRequest(f"request: not a valid protobuf message of the method's request type ({exc})") from None

    return decode


async def _one_message(request_iterator) -> bytes:
    """The single request message of a unary call, read by its handler."""
    async for raw in request_iterator:
        return raw
    raise InvalidRequest("request: the call carried no request message")


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions of TeacherService handlers to statuses (never a dead stream or a bare
    UNKNOWN), logs unexpected ones, and counts every RPC by method and code. Unary calls (and
    Generate, unary in, streamed out) beyond `max_concurrent_calls` at once, or beyond their
    client's share of it (`calls`, a `PerClientLimit` keyed on `servicer.client_share_key`), are
    refused (RESOURCE_EXHAUSTED, retryable) before their body is read; a call whose request has not
    arrived within `receive_timeout_s` ends with DEADLINE_EXCEEDED; large messages hand their
    memory back once done (`memory`). With `watches`, grpc.health.v1 Watch streams beyond it (or a
    client's share of it) are refused with RESOURCE_EXHAUSTED."""

    def __init__(self, metrics: TeacherMetrics, *, max_concurrent_calls: int | None = None, memory: MemoryReturner | None = None,
                 request_bytes: ByteBudget | None = None, calls: PerClientLimit | None = None,
                 receive_timeout_s: float | None = None, watches: PerClientLimit | None = None,
                 identities: Identities | None = None):
        self.metrics = metrics
        self.identities = identities or Identities()  # who a call is, for the shares (`servicer.client_share_key`)
        self.request_bytes = request_bytes  # the server-wide budget (unary bodies; streams: stream_session)
        if calls is None:
            calls = PerClientLimit(max_concurrent_calls if max_concurrent_calls is not None else sys.maxsize)
        self.calls = calls  # unary TeacherService calls in progress, by client
        self.max_concurrent_calls = calls.limit
        self.receive_timeout_s = receive_timeout_s
        self.watches = watches
        self.memory = memory or MemoryReturner()

    def _finish(self, method: str, code: grpc.StatusCode, started: float | None) -> None:
        self.metrics.requests.labels(method, code.name).inc()
        if code != grpc.StatusCode.OK:
            self.metrics.errors.labels(code.name).inc()
        if started is not None:
            self.metrics.latency.labels(method).observe(time.perf_counter() - started)

    async def _abort(self, context: grpc.aio.ServicerContext, method: str, exc: BaseException) -> None:
        code, message = describe(exc)
        if code == grpc.StatusCode.INTERNAL:
            log.exception("unexpected error in %s", method, exc_info=exc)
        # The traceback's frames hold the request (megabytes); gRPC's AbortError would keep them in a
        # reference cycle until a full garbage collection. Only the status and message are needed now.
        exc.__traceback__ = None
        self._finish(method, code, None)
        # A request over a per-request limit fails the same way every time: say so, so that clients
        # that retry RESOURCE_EXHAUSTED (a full queue, too many streams) do not retry this one.
        trailing = ((NOT_RETRYABLE_KEY, "0"),) if isinstance(exc, RequestTooLarge) else ()
        await context.abort(code, message, trailing_metadata=trailing)

    def _take_call(self, client: str) -> None:
        """Counts a call of `client` in `calls`; raises Overloaded (RESOURCE_EXHAUSTED, retryable)
        beyond `max_concurrent_calls` or the client's share of it, before its body is read."""
        calls = self.calls
        if calls.try_take(1, client):
            return
        self.memory.refused_unread()
        if calls.refusal(1, client) == "share":
            raise Overloaded(calls.share_message("calls in progress", "max_concurrent_calls", client))
        raise Overloaded(f"{calls.held} calls in progress, limit {calls.limit} (max_concurrent_calls); retry later")

    async def _receive(self, request_iterator) -> bytes:
        """The call's request message, due within `receive_timeout_s` (DeadlinePassed after it)."""
        if self.receive_timeout_s is None:
            return await _one_message(request_iterator)
        try:
            return await asyncio.wait_for(_one_message(request_iterator), self.receive_timeout_s)
        except TimeoutError:
            raise DeadlinePassed(f"request: the request message had not arrived {self.receive_timeout_s:g}s after the call "
                                 "started (request_receive_timeout_s)") from None

    async def _admit(self, request_iterator, client: str) -> tuple[bytes, int]:
        """Admission of a call with one request message (Score, Generate, GetModelInfo), already
        counted in `calls`: its body read (`_receive`), its bytes taken from the server-wide budget
        (`max_inflight_request_bytes`) and `client`'s share of it. Returns the body and the bytes
        taken, which the caller gives back when the call ends; raises Overloaded (RESOURCE_EXHAUSTED,
        retryable) or DeadlinePassed."""
        raw = await self._receive(request_iterator)
        if self.request_bytes is None:
            return raw, 0
        if not self.request_bytes.try_take(len(raw), client):
            self.memory.message_done(len(raw))
            raise Overloaded(self.request_bytes.refused_message(len(raw), client))
        return raw, len(raw)

    async def _statuses(self, method: str, context: grpc.aio.ServicerContext, responses: AsyncIterator[object],
                        started: float | None) -> AsyncIterator[object]:
        """`responses`, with their handler's errors mapped to statuses (never a dead stream or a bare
        UNKNOWN) and the call counted (and timed when `started` is given)."""
        try:
            async for response in responses:
                yield response
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:  # the client went away (cancelled, deadline passed)
            self._finish(method, grpc.StatusCode.CANCELLED, None)
            raise
        except Exception as exc:  # noqa: BLE001
            await self._abort(context, method, exc)  # raises AbortError
            return
        self._finish(method, grpc.StatusCode.OK, started)

    async def _admitted(self, request_iterator, context: grpc.aio.ServicerContext, decode: Callable[[bytes], object],
                        respond) -> AsyncIterator[object]:
        """The answers of a call with one request message: admitted (`_admit`), decoded, answered by
        `respond(request, context)`; the call slot and the budget's bytes given back however it ends."""
        client = client_share_key(context, self.identities)
        self._take_call(client)
        nbytes = taken = 0
        try:
            raw, taken = await self._admit(request_iterator, client)
            nbytes = len(raw)
            async for response in respond(decode(raw), context):
                yield response
        finally:
            self.calls.give(1, client)
            if taken:
                self.request_bytes.give(taken, client)
            self.memory.message_done(nbytes)

    async def _one_request(self, method: str, request_iterator, context: grpc.aio.ServicerContext,
                           decode: Callable[[bytes], object], respond) -> AsyncIterator[object]:
        """A call with one request message (Score, GetModelInfo; Generate, whose answers stream):
        `_admitted`'s answers through `_statuses`; closed early, its slot and bytes are freed at once."""
        started = time.perf_counter()
        async with contextlib.aclosing(self._admitted(request_iterator, context, decode, respond)) as answers:
            async for response in self._statuses(method, context, answers, started):
                yield response

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]], details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is not None and details.method == HEALTH_WATCH and self.watches is not None:
            return self._bounded_watch(handler)
        if handler is None or not details.method.startswith(f"/{SERVICE_NAME}/"):
            return handler
        method = details.method.rsplit("/", 1)[-1]
        decode = _decoder(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def answer_once(request, context):
                yield await inner_uu(request, context)

            async def unary_unary(request_iterator, context):
                responses = self._one_request(method, request_iterator, context, decode, answer_once)
                return [response async for response in responses][0]

            # Request-streaming on the server side only (the wire is the same): the handler reads the body.
            return grpc.stream_unary_rpc_method_handler(unary_unary, response_serializer=handler.response_serializer)
        if handler.unary_stream is not None:  # Generate: one request, answers streamed
            inner_us = handler.unary_stream

            async def unary_stream(request_iterator, context):
                # aclosing: a caller that leaves mid-stream frees the call slot and bytes at once
                async with contextlib.aclosing(self._one_request(method, request_iterator, context, decode, inner_us)) as responses:
                    async for response in responses:
                        yield response

            # Streaming both ways on the server side only (the wire is the same): the handler reads the body.
            return grpc.stream_stream_rpc_method_handler(unary_stream, response_serializer=handler.response_serializer)
        if handler.stream_stream is not None:
            inner_ss = handler.stream_stream

            async def decoded(raw_iterator):
                async for raw in raw_iterator:
                    request = decode(raw)
                    self.memory.message_done(len(raw))  # the raw bytes are dropped here
                    yield request

            async def stream_stream(request_iterator, context):
                async for response in self._statuses(method, context, inner_ss(decoded(request_iterator), context), None):
                    yield response

            return grpc.stream_stream_rpc_method_handler(stream_stream, response_serializer=handler.response_serializer)
        return handler


    def _bounded_watch(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """grpc.health.v1 Watch, counted in `watches` while it is open (RESOURCE_EXHAUSTED beyond
        it or the client's share): health needs no token, and each open Watch costs memory."""
        inner = handler.unary_stream
        watches = self.watches

        async def watch(request, context):
            client = client_share_key(context, self.identities)
            if not watches.try_take(1, client):
                if watches.refusal(1, client) == "share":
                    message = watches.share_message("health Watch streams", "max_health_watches", client)
                else:
                    message = f"{watches.held} health Watch streams open, limit {watches.limit} (max_health_watches); retry later"
                self._finish("Watch", grpc.StatusCode.RESOURCE_EXHAUSTED, None)
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
            try:
                return await inner(request, context)
            finally:
                watches.give(1, client)

        return grpc.unary_stream_rpc_method_handler(watch, request_deserializer=handler.request_deserializer,
                                                    response_serializer=handler.response_serializer)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except grpc.health.v1 (probes
    cannot send metadata). Compared in constant time; the token is never logged."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str, metrics: TeacherMetrics, memory: MemoryReturner | None = None):
        self._identities = Identities(token)
        self.metrics = metrics
        self.memory = memory or MemoryReturner()

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                return self._identities.holds_token(value)
        return False

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(self.EXEMPT) or self._authorized(details):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method.rsplit("/", 1)[-1]
        self.metrics.requests.labels(method, "UNAUTHENTICATED").inc()
        self.metrics.errors.labels("UNAUTHENTICATED").inc()
        message = "missing or invalid bearer token (metadata 'authorization: Bearer <token>')"

        # Request-streaming handlers that never read: the body of a refused call is not read.
        async def deny_unary(request_iterator, context):
            self.memory.refused_unread()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(request_iterator, context):
            self.memory.refused_unread()
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        kw = dict(response_serializer=handler.response_serializer)
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
        return grpc.stream_unary_rpc_method_handler(deny_unary, **kw)
