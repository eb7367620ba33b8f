"""Pure logic behind the teacher's bounds (tests/reliability/test_teacher_bounds.py runs them end to
end): when memory passes run, the open-file limit, the gRPC options."""

from __future__ import annotations

import asyncio
import resource

import pytest

from eopd_teacher import resources
from eopd_teacher.resources import LARGE_MESSAGE_BYTES, MemoryReturner, raise_open_file_limit, resident_bytes
from eopd_teacher.server import grpc_options
from eopd_teacher.settings import MiB, TeacherSettings


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(resources, "DELAY_S", 0.05)
    monkeypatch.setattr(resources, "MIN_INTERVAL_S", 0.5)


def test_small_messages_never_trigger_a_pass(fast):
    async def main():
        m = MemoryReturner()
        for _ in range(100):
            m.message_done(LARGE_MESSAGE_BYTES - 1)
        await asyncio.sleep(0.3)
        return m.passes

    assert asyncio.run(main()) == 0


def test_a_burst_gets_one_pass_after_it_and_one_follow_up(fast):
    """Timing-tolerant on a loaded machine: each count is checked only when the sleeps before it
    kept to their schedule (the loop's clock says how long they really took)."""
    async def main():
        loop = asyncio.get_running_loop()
        m = MemoryReturner()
        start = loop.time()
        for _ in range(5):  # a burst shorter than MIN_INTERVAL_S: no pass during it
            m.message_done(LARGE_MESSAGE_BYTES)
            await asyncio.sleep(0.01)
        burst_s, during = loop.time() - start, m.passes
        last = loop.time()
        await asyncio.sleep(0.2)  # DELAY_S after the last message
        waited_s, after = loop.time() - last, m.passes
        await asyncio.sleep(1.5)  # the follow-up, MIN_INTERVAL_S later; nothing more
        m.close()
        return burst_s, during, waited_s, after, m.passes

    burst_s, during, waited_s, after, final = asyncio.run(main())
    if burst_s < resources.MIN_INTERVAL_S:
        assert during == 0
    if waited_s < resources.MIN_INTERVAL_S:
        assert after == 1
    assert final == 2


def test_a_steady_stream_of_large_messages_gets_passes_at_most_every_min_interval(fast):
    async def main():
        m = MemoryReturner()
        loop = asyncio.get_running_loop()
        end = loop.time() + 1.5
        while loop.time() < end:
            m.message_done(LARGE_MESSAGE_BYTES)
            await asyncio.sleep(0.01)
        m.close()
        return m.passes

    passes = asyncio.run(main())
    assert 2 <= passes <= 1.5 / 0.5 + 1, passes  # not starved by the stream, never more often than allowed


def test_refused_calls_count_as_large():
    async def main():
        m = MemoryReturner()
        m.refused_unread()
        pending = m._timer is not None
        m.close()
        return pending

    assert asyncio.run(main())


def test_open_file_limit_raised_to_the_hard_limit():
    soft, hard = raise_open_file_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (soft, hard)
    assert soft == hard or hard == resource.RLIM_INFINITY


def test_resident_bytes_reads_this_process():
    rss = resident_bytes()
    assert rss is None or rss > 10 * MiB


def test_receive_limit_is_the_smaller_of_the_two():
    opts = dict(grpc_options(TeacherSettings()))
    assert opts["grpc.max_receive_message_length"] == 8 * MiB and opts["grpc.max_send_message_length"] == 64 * MiB
    opts = dict(grpc_options(TeacherSettings(max_message_bytes=MiB)))
    assert opts["grpc.max_receive_message_length"] == MiB == opts["grpc.max_send_message_length"]
