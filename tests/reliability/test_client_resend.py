"""AsyncTeacherClient.score_stream across a teacher killed mid-stream and restarted: an async
generator source keeps producing, every request is answered exactly once, nothing is lost."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from eopd_teacher.client import AsyncTeacherClient, ScoreBatch
from tests.procs import free_port, start_teacher

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_stream_survives_teacher_sigkill_and_restart():
    gp, hp = free_port(), free_port()
    proc = start_teacher("tiny-random", grpc_port=gp, http_port=hp)
    restarted: dict = {}
    try:
        async def source():
            for i in range(40):
                await asyncio.sleep(0.05)  # a producer that takes time (like sampling)
                yield ScoreBatch(f"r{i}", [(f"s{i}", [1, 2, 3, 4, 5 + i], 2)], top_k=4)

        def chaos():
            time.sleep(1.0)
            proc.signal(signal.SIGKILL)
            proc.wait(30)
            restarted["proc"] = start_teacher("tiny-random", grpc_port=gp, http_port=hp)

        async def consume():
            got = []
            async with AsyncTeacherClient(f"127.0.0.1:{gp}", retry_timeout=180) as c:
                async for rid, scores in c.score_stream(source(), max_in_flight=4):
                    assert scores[0].topk_ids.shape == (3, 4)
                    got.append(rid)
            return got

        t = threading.Thread(target=chaos)
        t.start()
        got = asyncio.run(consume())
        t.join(200)
        assert "proc" in restarted, "the teacher was not restarted during the stream"
        assert sorted(got) == sorted(f"r{i}" for i in range(40))  # all, exactly once
    finally:
        proc.stop()
        if "proc" in restarted:
            restarted["proc"].stop()
