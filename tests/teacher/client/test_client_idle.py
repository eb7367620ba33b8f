"""AsyncTeacherClient.score_stream when the teacher closes its idle streams (the server's
`stream_idle_timeout_s`, UNAVAILABLE with no request in flight): a producer that pauses longer than
that (a KD stage that only calls Generate, a slow sampler) must not fail the stream. Nothing of ours
was in flight, so no retry budget is spent: the lane re-opens when it has something to send, every
request is answered once with the teacher's scores, and a source that ends during the pause ends
the stream cleanly. A real teacher over TCP with a 1-second idle timeout, a client whose retry
budget (0.5 s) is far shorter than the pause (the run that found it died after 300 s of KD)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from eopd_teacher.client import AsyncTeacherClient, ScoreBatch, TeacherClient
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

IDLE_S = 1.0
PAUSE_S = 3.5  # more than three idle timeouts


def _batch(i: int) -> ScoreBatch:
    return ScoreBatch(f"r{i}", [(f"s{i}", [1, 2, 3, 4, 5 + i, 6 + i], 2)], top_k=4)


async def _paused_source(before: int, after: int):
    for i in range(before):
        yield _batch(i)
    await asyncio.sleep(PAUSE_S)  # every lane's stream is closed by the server meanwhile
    for i in range(before, before + after):
        yield _batch(i)


@pytest.fixture(scope="module")
def idle_teacher():
    with running_teacher("tiny-random", "--stream-idle-timeout-s", str(IDLE_S)) as t:
        yield t


async def _collect(target: str, source) -> list:
    async with AsyncTeacherClient(target, retry_timeout=0.5) as c:
        return [item async for item in c.score_stream(source, max_in_flight=4, streams=2, on_error="raise")]


def test_a_pause_longer_than_the_idle_timeout_loses_nothing(idle_teacher):
    got = asyncio.run(_collect(idle_teacher.target, _paused_source(2, 5)))
    assert sorted(rid for rid, _ in got) == sorted(f"r{i}" for i in range(7))  # all, exactly once
    with TeacherClient(idle_teacher.target) as c:
        for rid, (s,) in got:
            (e,) = c.score(_batch(int(rid[1:])).sequences, top_k=4)
            np.testing.assert_array_equal(s.topk_ids, e.topk_ids)
            np.testing.assert_allclose(s.token_logprobs, e.token_logprobs, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(s.entropies, e.entropies, rtol=1e-5, atol=1e-5)


def test_a_source_that_ends_during_the_pause_ends_the_stream(idle_teacher):
    got = asyncio.run(_collect(idle_teacher.target, _paused_source(3, 0)))
    assert sorted(rid for rid, _ in got) == ["r0", "r1", "r2"]


def test_a_source_that_starts_after_the_idle_timeout_is_served(idle_teacher):
    """Nothing at all before the pause: both lanes' first calls are closed idle."""
    got = asyncio.run(_collect(idle_teacher.target, _paused_source(0, 3)))
    assert sorted(rid for rid, _ in got) == ["r0", "r1", "r2"]
