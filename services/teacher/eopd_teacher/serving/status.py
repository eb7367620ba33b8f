"""The status policy: which gRPC status each exception of the teacher's service is answered with
(the HTTP front end maps these to HTTP statuses), and which failures end a ScoreStream rather than
one request."""

from __future__ import annotations

import asyncio

import grpc

from ..types import GenerationCancelled
from ..validation import GenerateNotServed, InvalidRequest, RequestTooLarge
from .batcher import Draining, Overloaded


class NotReady(Exception):
    """The model is still loading: UNAVAILABLE."""


class DeadlinePassed(Exception):
    """The call's deadline passed between Generate's jobs: DEADLINE_EXCEEDED."""


class OutputHeadNotServed(Exception):
    """The engine cannot return hidden states, so serves no output head: UNIMPLEMENTED."""


# Exceptions the servicer raises, and the status each maps to.
STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    RequestTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Draining: grpc.StatusCode.UNAVAILABLE,
    NotReady: grpc.StatusCode.UNAVAILABLE,
    GenerateNotServed: grpc.StatusCode.UNIMPLEMENTED,
    OutputHeadNotServed: grpc.StatusCode.UNIMPLEMENTED,
    DeadlinePassed: grpc.StatusCode.DEADLINE_EXCEEDED,
    GenerationCancelled: grpc.StatusCode.DEADLINE_EXCEEDED,  # (a cancelled caller hears nothing)
}


# Failures that end a ScoreStream (the server, not the request, is the problem); every other
# failure of a request is answered in band and the stream goes on.
STREAM_LEVEL: tuple[type[Exception], ...] = (Overloaded, Draining, NotReady)


def status_of(exc: BaseException) -> grpc.StatusCode:
    for cls, code in STATUS_OF.items():
        if isinstance(exc, cls):
            return code
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


def describe(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status and message a handler's exception is answered with."""
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        return code, f"internal error: {type(exc).__name__}: {exc}"
    return code, str(exc)
