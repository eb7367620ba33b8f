"""Pure logic behind the teacher's bounds (tests/reliability/test_teacher_bounds.py runs them end to
end): when memory passes run, the open-file limit, the gRPC options, the
server-wide byte budget."""

from __future__ import annotations

import asyncio
import resource
import time

import pytest

from eopd_teacher.serving import resources
from eopd_teacher.serving.resources import LARGE_MESSAGE_BYTES, ByteBudget, MemoryReturner, raise_open_file_limit
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
    """Judged on when the passes really ran (a loaded machine can stall the loop or a pass's
    gc.collect): at least two while the stream lasts, never two closer than MIN_INTERVAL_S."""
    async def main():
        m = MemoryReturner()
        times = []
        pass_once = m._return_memory

        def recorded(*args, **kwargs):
            times.append(time.monotonic())
            pass_once(*args, **kwargs)

        m._return_memory = recorded
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        while loop.time() < end and len(times) < 3:
            m.message_done(LARGE_MESSAGE_BYTES)
            await asyncio.sleep(0.01)
        m.close()
        return times

    times = asyncio.run(main())
    assert len(times) >= 2, times  # not starved by the stream
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert min(gaps) >= resources.MIN_INTERVAL_S - 0.01, gaps  # never more often than allowed


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


def test_receive_limit_is_the_smaller_of_the_two():
    opts = dict(grpc_options(TeacherSettings()))
    assert opts["grpc.max_receive_message_length"] == 8 * MiB and opts["grpc.max_send_message_length"] == 64 * MiB
    opts = dict(grpc_options(TeacherSettings(max_message_bytes=MiB)))
    assert opts["grpc.max_receive_message_length"] == MiB == opts["grpc.max_send_message_length"]


def test_byte_budget_admits_up_to_its_limit_and_a_request_alone():
    b = ByteBudget(10)
    assert b.try_take(6) and b.try_take(4) and b.held == 10 and not b.has_room
    assert not b.try_take(1) and b.held == 10  # refused: nothing taken
    b.give(6)
    assert b.has_room and not b.try_take(7) and b.try_take(6)
    b.give(10)
    assert b.held == 0 and b.peak == 10
    assert b.try_take(25) and b.held == 25  # alone: always admitted (the limit is >= the receive limit)
    b.give(25)


def test_byte_budget_wait_room_returns_once_bytes_are_given_back():
    async def main():
        b = ByteBudget(10)
        b.try_take(10)
        waiter = asyncio.ensure_future(b.wait_room())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        b.give(1)
        await asyncio.wait_for(waiter, 5)
        return b.has_room

    assert asyncio.run(main())


def test_byte_budget_must_hold_the_largest_request():
    assert TeacherSettings().max_inflight_request_bytes >= TeacherSettings().max_request_bytes
    with pytest.raises(ValueError, match="max_inflight_request_bytes"):
        TeacherSettings(max_inflight_request_bytes=4 * MiB, max_request_bytes=8 * MiB)
    TeacherSettings(max_inflight_request_bytes=2 * MiB, max_request_bytes=8 * MiB, max_message_bytes=2 * MiB)
