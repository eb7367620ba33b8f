"""AsyncTeacherClient.score_stream against a real teacher behind a TCP proxy that stalls (stops
forwarding without closing anything, tests/stalling_proxy.py): with `stall_timeout_s` the client
notices the silence, reports it (`on_stall`), reconnects and re-sends, and every request is
answered exactly once with the teacher's scores; `give_up_s` ends it with StreamStalled; without
`stall_timeout_s` nothing of this happens (the stream just waits, as before)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from eopd_teacher.client import AsyncTeacherClient, ScoreBatch, StallReport, StreamStalled, TeacherClient
from tests.stalling_proxy import StallingProxy

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

N = 24


def _batch(i: int) -> ScoreBatch:
    return ScoreBatch(f"r{i}", [(f"s{i}", [1, 2, 3, 4, 5 + i, 6 + i], 2)], top_k=4)


async def _source(n: int = N, pause: float = 0.05):
    for i in range(n):
        await asyncio.sleep(pause)  # a producer that takes time (like sampling)
        yield _batch(i)


@pytest.fixture(scope="module")
def expected(tiny_teacher):
    """The teacher's scores of every request, asked directly (no proxy)."""
    with TeacherClient(tiny_teacher.target) as c:
        return {f"r{i}": c.score(_batch(i).sequences, top_k=4) for i in range(N)}


def _check(got: list, expected: dict) -> None:
    assert sorted(rid for rid, _ in got) == sorted(expected)  # all, exactly once
    for rid, scores in got:
        (s,), (e,) = scores, expected[rid]
        assert s.topk_ids.shape == (4, 4)
        np.testing.assert_array_equal(s.topk_ids, e.topk_ids)
        np.testing.assert_allclose(s.token_logprobs, e.token_logprobs, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(s.entropies, e.entropies, rtol=1e-5, atol=1e-5)


async def _stall_for(proxy: StallingProxy, after: asyncio.Event, seconds: float) -> None:
    await after.wait()
    proxy.stall()
    await asyncio.sleep(seconds)
    proxy.restore()


async def test_frozen_connection_is_detected_reconnected_and_every_request_answered_once(tiny_teacher, expected):
    reports: list[StallReport] = []
    got = []
    first = asyncio.Event()
    with StallingProxy(("127.0.0.1", tiny_teacher.grpc_port)) as proxy:
        async with AsyncTeacherClient(proxy.target, retry_timeout=60) as c:
            staller = asyncio.ensure_future(_stall_for(proxy, first, 3.0))
            async for rid, scores in c.score_stream(_source(), max_in_flight=4, streams=2, stall_timeout_s=1.0,
                                                    on_stall=reports.append):
                got.append((rid, scores))
                if len(got) == 3:
                    first.set()  # freeze the path mid-run, with requests on the wire
            await staller
        connections = proxy.connections
    _check(got, expected)
    assert reports, "no stall reported"
    assert [r.restarts for r in reports] == list(range(1, len(reports) + 1))
    assert all(r.silent_s >= 1.0 and r.outstanding >= 1 and r.stall_timeout_s == 1.0 and r.target == proxy.target
               for r in reports), reports
    assert connections >= 2, connections  # reconnected (a new channel: a new TCP connection)


async def test_give_up_raises_stream_stalled(tiny_teacher):
    reports: list[StallReport] = []
    got = []
    with StallingProxy(("127.0.0.1", tiny_teacher.grpc_port)) as proxy:
        async with AsyncTeacherClient(proxy.target, retry_timeout=60) as c:
            started = None
            with pytest.raises(StreamStalled) as e:
                async for rid, _ in c.score_stream(_source(), max_in_flight=4, stall_timeout_s=0.5, give_up_s=2.0,
                                                   on_stall=reports.append):
                    got.append(rid)
                    if len(got) == 2:
                        proxy.stall()  # never restored
                        started = time.monotonic()
            elapsed = time.monotonic() - started
    assert isinstance(e.value, RuntimeError)
    assert f"no answer from the teacher at {proxy.target} for 2s with " in str(e.value)
    assert "requests outstanding" in str(e.value)
    assert reports, "stalls before giving up are reported"
    assert 2.0 <= elapsed < 6.0, elapsed
    assert len(got) < N


async def test_slow_consumer_is_no_stall(tiny_teacher, expected):
    """The clock measures the teacher's silence, not the caller's pace: a consumer that takes
    longer than stall_timeout_s over each answer causes no stall."""
    reports: list[StallReport] = []
    got = []
    with StallingProxy(("127.0.0.1", tiny_teacher.grpc_port)) as proxy:
        async with AsyncTeacherClient(proxy.target) as c:
            async for rid, scores in c.score_stream(_source(6, 0.0), max_in_flight=2, stall_timeout_s=0.3,
                                                    on_stall=reports.append):
                await asyncio.sleep(0.6)
                got.append((rid, scores))
        assert proxy.connections == 1
    assert reports == []
    _check(got, {rid: expected[rid] for rid in (f"r{i}" for i in range(6))})


async def test_default_waits_without_reconnecting(tiny_teacher, expected):
    """No stall_timeout_s (the default): a stalled path is waited out on the same connection,
    nothing is re-sent, and the stream completes once the path is restored."""
    got = []
    first = asyncio.Event()
    with StallingProxy(("127.0.0.1", tiny_teacher.grpc_port)) as proxy:
        async with AsyncTeacherClient(proxy.target, retry_timeout=60) as c:
            staller = asyncio.ensure_future(_stall_for(proxy, first, 3.0))
            async for rid, scores in c.score_stream(_source(), max_in_flight=4, streams=2):
                got.append((rid, scores))
                if len(got) == 3:
                    first.set()
            await staller
        assert proxy.connections == 1
    _check(got, expected)


async def test_give_up_needs_stall_timeout():
    async with AsyncTeacherClient("127.0.0.1:1") as c:
        with pytest.raises(ValueError, match="give_up_s"):
            async for _ in c.score_stream([_batch(0)], give_up_s=5.0):
                pass
        with pytest.raises(ValueError, match="stall_timeout_s"):
            async for _ in c.score_stream([_batch(0)], stall_timeout_s=0):
                pass
