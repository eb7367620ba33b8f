"""Which statuses the teacher clients retry (pure logic: statuses built by hand)."""

from __future__ import annotations

import grpc
import pytest

from eopd_teacher.client import LOST_STATUS_DETAILS, AsyncTeacherClient


def _err(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details=details)


@pytest.mark.parametrize(
    ("err", "retry_overload", "expected"),
    [
        (_err(grpc.StatusCode.UNAVAILABLE, "server draining"), True, True),
        (_err(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: ..."), True, True),
        (_err(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full: ..."), False, False),
        # Over a per-request limit: the same request would fail again.
        (_err(grpc.StatusCode.RESOURCE_EXHAUSTED, "sequences: 9 exceed ...", (("eopd-retryable", "0"),)), True, False),
        (_err(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)"), True, False),
        (_err(grpc.StatusCode.INVALID_ARGUMENT, "sequences[0].score_from ..."), True, False),
        # The server's own INTERNAL (an engine error) is not retried ...
        (_err(grpc.StatusCode.INTERNAL, "internal error: RuntimeError: engine exploded"), True, False),
        # ... but grpcio's substitute for a status lost to a write racing the stream's end is.
        (_err(grpc.StatusCode.INTERNAL, LOST_STATUS_DETAILS), False, True),
    ],
)
async def test_retryable(err, retry_overload, expected):
    async with AsyncTeacherClient("127.0.0.1:1", retry_overload=retry_overload) as c:
        assert c._retryable(err) is expected
