"""gRPC server interceptors: the status policy applied to TeacherService handlers (statuses,
logs, per-method metrics, the concurrent-call limit) and the bearer-token check.

Bytes in flight: a unary TeacherService call is served by a request-streaming handler that reads
its one message itself, so a call refused before its body matters (over `max_concurrent_calls`,
or without a valid bearer token) is answered without reading the body at all: its bytes never
leave gRPC's flow-control window (issue 17, section 2)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from ..convert import NOT_RETRYABLE_KEY
from ..serving.admission import CallSlots
from ..serving.batcher import Overloaded
from ..serving.metrics import TeacherMetrics
from ..serving.resources import ByteBudget, MemoryReturner
from ..serving.status import describe
from ..validation import InvalidRequest, RequestTooLarge
from .servicer import SERVICE_NAME

log = logging.getLogger("eopd_teacher")


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
    Generate, unary in, streamed out) beyond `max_concurrent_calls` at once are refused (RESOURCE_EXHAUSTED, retryable) before their body
    is read; large messages hand their memory back once done (`memory`)."""

    def __init__(self, metrics: TeacherMetrics, *, max_concurrent_calls: int | None = None, memory: MemoryReturner | None = None,
                 request_bytes: ByteBudget | None = None, slots: CallSlots | None = None):
        self.metrics = metrics
        self.request_bytes = request_bytes  # the server-wide budget (unary bodies; streams: stream_session)
        self.max_concurrent_calls = max_concurrent_calls
        # unary TeacherService calls in progress, shared with /v1/completions (serving/admission.py)
        self.slots = slots if slots is not None else CallSlots(max_concurrent_calls)
        self.memory = memory or MemoryReturner()

    @property
    def calls(self) -> int:
        return self.slots.count

    @calls.setter
    def calls(self, n: int) -> None:
        self.slots.count = n

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

    async def _admit(self, request_iterator) -> tuple[bytes, int]:
        """Admission of a call with one request message (Score, Generate, GetModelInfo): refused
        before its body is read beyond `max_concurrent_calls` (this call already counted in
        `self.calls`), its body read, its bytes taken from the server-wide budget
        (`max_inflight_request_bytes`). Returns the body and the bytes taken, which the caller
        gives back when the call ends; raises Overloaded (RESOURCE_EXHAUSTED, retryable)."""
        limit = self.max_concurrent_calls
        if limit is not None and self.calls > limit:
            self.memory.refused_unread()
            raise Overloaded(f"{self.calls - 1} calls in progress, limit {limit} (max_concurrent_calls); retry later")
        raw = await _one_message(request_iterator)
        if self.request_bytes is None:
            return raw, 0
        if not self.request_bytes.try_take(len(raw)):
            self.memory.message_done(len(raw))
            raise Overloaded(f"{self.request_bytes.held} request bytes in flight, this call adds {len(raw)}, "
                             f"limit {self.request_bytes.limit} (max_inflight_request_bytes); retry later")
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
        nbytes = taken = 0
        self.calls += 1
        try:
            raw, taken = await self._admit(request_iterator)
            nbytes = len(raw)
            async for response in respond(decode(raw), context):
                yield response
        finally:
            self.calls -= 1
            if taken:
                self.request_bytes.give(taken)
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


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every call except grpc.health.v1 (probes
    cannot send metadata). Compared in constant time; the token is never logged."""

    EXEMPT = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str, metrics: TeacherMetrics, memory: MemoryReturner | None = None):
        self._expected = f"Bearer {token}".encode()
        self.metrics = metrics
        self.memory = memory or MemoryReturner()

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        for key, value in details.invocation_metadata or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(given, self._expected)
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
