"""AsyncTeacherClient.score_stream across a teacher killed mid-stream and restarted: an async
generator source keeps producing, every request is answered exactly once, nothing is lost."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import pytest

from eopd_teacher.client import AsyncTeacherClient, ScoreBatch
from tests.procs import free_port, restart_port, start_teacher

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def test_stream_survives_teacher_sigkill_and_restart():
    gp, hp = restart_port(), restart_port()
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


@pytest.mark.parametrize("load_balancing", [None, "round_robin"], ids=["pick_first", "round_robin"])
def test_stream_fails_over_to_a_second_replica(load_balancing):
    """Two teacher replicas behind one two-address target (`ipv4:a,b`, what a headless Service's DNS
    gives the client): the replica serving the stream is SIGKILLed and NOT restarted; the client
    re-opens its stream on the other replica, every request is answered exactly once, and unary
    calls keep working too."""
    from eopd_teacher.client import TeacherClient

    replicas = [start_teacher("tiny-random", grpc_port=free_port(), http_port=free_port()) for _ in range(2)]
    target = "ipv4:" + ",".join(f"127.0.0.1:{r.grpc_port}" for r in replicas)
    killed_at: dict = {}
    try:
        async def source():
            for i in range(40):
                await asyncio.sleep(0.05)
                yield ScoreBatch(f"r{i}", [(f"s{i}", [1, 2, 3, 4, 5 + i], 2)], top_k=4)

        def chaos():
            time.sleep(1.0)
            # pick_first streams to the first address; round_robin to either: kill the first, then
            # (round_robin) the stream is on it or already on the other, and both paths must hold.
            replicas[0].signal(signal.SIGKILL)
            replicas[0].wait(30)
            killed_at["t"] = time.monotonic()

        async def consume():
            got = []
            kwargs = {"load_balancing": load_balancing} if load_balancing else {}
            async with AsyncTeacherClient(target, retry_timeout=60, **kwargs) as c:
                async for rid, scores in c.score_stream(source(), max_in_flight=4):
                    assert scores[0].topk_ids.shape == (3, 4)
                    got.append((rid, time.monotonic()))
            return got

        t = threading.Thread(target=chaos)
        t.start()
        got = asyncio.run(consume())
        t.join(60)
        assert "t" in killed_at, "the replica was not killed during the stream"
        assert sorted(r for r, _ in got) == sorted(f"r{i}" for i in range(40))  # all, exactly once
        after = [r for r, ts in got if ts > killed_at["t"]]
        assert after, "nothing was answered after the kill: the test did not exercise the failover"
        assert not replicas[0].alive() and replicas[1].alive()  # only the survivor served them
        with TeacherClient(target, retry_timeout=30, **({"load_balancing": load_balancing} if load_balancing else {})) as c:
            for i in range(4):
                assert c.score([(f"u{i}", [1, 2, 3, 4], 1)])[0].token_logprobs.shape == (3,)
    finally:
        for r in replicas:
            r.stop()
