"""Which statuses the teacher clients retry (pure logic: statuses built by hand)."""

from __future__ import annotations

import grpc
import pytest

from eopd_teacher.client import AsyncTeacherClient
from eopd_teacher.client.channel import LOST_STATUS_DETAILS


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
        assert c.should_retry(err) is expected


def _dead_target() -> str:
    from tests.procs import free_port

    return f"127.0.0.1:{free_port()}"  # nothing listens: every attempt fails UNAVAILABLE


@pytest.mark.parametrize("timeout", [0, 1.0])
def test_sync_timeout_is_an_overall_deadline_across_retries(timeout):
    """A 300 s retry budget does not outlive the caller's timeout; timeout=0 is a real deadline
    (one attempt, failing at once), not "use the default"."""
    import time

    from eopd_teacher.client import TeacherClient

    with TeacherClient(_dead_target(), timeout=300, retry_timeout=300) as c:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            c.info(timeout=timeout)
        elapsed = time.monotonic() - started
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed < timeout + 2.0, elapsed


@pytest.mark.parametrize("timeout", [0, 1.0])
async def test_async_timeout_is_an_overall_deadline_across_retries(timeout):
    import time

    async with AsyncTeacherClient(_dead_target(), timeout=300, retry_timeout=300) as c:
        started = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await c.info(timeout=timeout)
        elapsed = time.monotonic() - started
    assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed < timeout + 2.0, elapsed


def test_call_plan_budget_and_attempt_timeouts():
    """Pure logic: the attempt timeout shrinks with the time spent; None means no deadline."""
    import time

    from eopd_teacher.client import TeacherClient
    from eopd_teacher.client.channel import CallPlan

    with TeacherClient(_dead_target(), timeout=None, retry_timeout=60) as c:
        assert CallPlan(c, None, None).attempt_timeout() is None
        plan = CallPlan(c, 2.0, None)
        first = plan.attempt_timeout()
        time.sleep(0.2)
        assert 1.9 <= first <= 2.0 and plan.attempt_timeout() <= first - 0.2
        assert CallPlan(c, 0, None).attempt_timeout() == 0.0
        assert plan.backoff.deadline <= time.monotonic() + 2.0  # retries bounded by min(timeout, retry_timeout)
