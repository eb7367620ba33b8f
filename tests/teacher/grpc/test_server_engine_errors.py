"""An engine that raises, behind the real TeacherServer (gRPC over TCP, the interceptor, the batcher):
the caller gets INTERNAL, never a dead stream, and the server keeps serving.

The server runs in process because nothing makes the real engine raise on demand and the teacher
has no fault-injection setting; the engine is passed through TeacherServer's `engine=` parameter.
"""

from __future__ import annotations

import asyncio
import threading
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_teacher import __version__
from eopd_teacher.client import AsyncTeacherClient
from eopd_teacher.engines.base import ScoringEngine
from eopd_teacher.server import TeacherServer
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.types import EngineInfo, ScoreItem, SequenceScores

pytestmark = pytest.mark.integration

VOCAB = 100
# The server's limits (GetModelInfo: served_info adds them to what the engine loaded).
LIMITS = dict(default_top_k=4, max_top_k=8, max_sequences_per_request=16, max_tokens_per_request=1024)


class FlakyEngine(ScoringEngine):
    """Scores anything (constant numbers) except a batch holding a sequence whose id starts with
    'boom', which raises. A sequence whose id starts with 'hold' sets `holding` and blocks the
    engine's thread until `release` is set (at most 30 s): a request the test knows is in flight."""

    def __init__(self):
        self.holding = threading.Event()
        self.release = threading.Event()

    def load(self) -> EngineInfo:
        return EngineInfo(
            model_name="flaky", model_revision="0", vocab_size=VOCAB, max_context_length=64, dtype="float32",
            engine="flaky", tokenizer_fingerprint="0" * 64,
        )

    def score(self, items: list[ScoreItem]) -> list[SequenceScores]:
        if any(it.seq_id.startswith("boom") for it in items):
            raise RuntimeError("engine exploded")
        if any(it.seq_id.startswith("hold") for it in items):
            self.holding.set()
            self.release.wait(30)
        out = []
        for it in items:
            n = it.num_scored
            out.append(SequenceScores(
                it.seq_id, np.full(n, -1.0, np.float32), np.ones(n, np.float32),
                np.zeros((n, it.top_k), np.int32), np.full((n, it.top_k), -1.0, np.float32),
            ))
        return out

    def health(self) -> bool:
        return True


def _req(rid: str, sid: str) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=rid, sequences=[pb.Sequence(id=sid, token_ids=[1, 2, 3], score_from=1)])


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


async def test_engine_exception_is_internal_and_server_keeps_serving():
    settings = TeacherSettings(host="127.0.0.1", grpc_port=0, http_port=0, max_batch_wait_ms=1, grace_seconds=5,
                               **LIMITS, insecure_no_auth=True)
    engine = FlakyEngine()
    server = TeacherServer(settings, engine=engine)
    await server.start()
    try:
        async with asyncio.timeout(30):
            while not server.state.ready:
                await asyncio.sleep(0.02)
        target = f"127.0.0.1:{server.grpc_port}"
        async with AsyncTeacherClient(target, retry_timeout=0) as client:
            info = await client.info(timeout=10)
            assert (info.model_name, info.vocab_size, info.engine) == ("flaky", VOCAB, "flaky")
            assert {k: getattr(info, k) for k in LIMITS} == LIMITS and info.server_version == __version__
            # Unary.
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.score([("boom-1", [1, 2, 3], 1)], timeout=10)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "RuntimeError: engine exploded" in e.value.details()
            assert len(await client.score([("fine", [1, 2, 3, 4], 2)], timeout=10)) == 1

            # Stream: the failing request is answered in band (INTERNAL), the stream serves on.
            async with grpc.aio.insecure_channel(target) as ch:
                stub = pb_grpc.TeacherServiceStub(ch)
                queue: asyncio.Queue = asyncio.Queue()

                async def requests():
                    while (req := await queue.get()) is not None:  # open until None
                        yield req

                call = stub.ScoreStream(requests(), timeout=30)
                queue.put_nowait(_req("ok", "a"))
                assert (await call.read()).request_id == "ok"
                queue.put_nowait(_req("bad", "boom-2"))
                async with asyncio.timeout(10):
                    failed = await call.read()
                assert failed.request_id == "bad" and failed.error.code == grpc.StatusCode.INTERNAL.value[0]
                assert "engine exploded" in failed.error.message and not failed.results
                queue.put_nowait(_req("next", "d"))
                async with asyncio.timeout(10):
                    nxt = await call.read()
                assert nxt.request_id == "next" and not nxt.HasField("error")
                queue.put_nowait(None)
                assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK

                answers = [r.request_id async for r in stub.ScoreStream(iter([_req("after", "b")]), timeout=10)]
                assert answers == ["after"]

                # A stream the client cancels while a request of it is in flight is counted too
                # (code CANCELLED), not silently dropped. (A stream cancelled with nothing in flight
                # looks to the server like a half-close: gRPC's server sees the end of the requests
                # before the cancel, so if nothing is left to answer, the call may end OK.)
                queue2: asyncio.Queue = asyncio.Queue()

                async def requests2():
                    while True:
                        yield await queue2.get()

                call = stub.ScoreStream(requests2(), timeout=30)
                queue2.put_nowait(_req("c1", "c"))
                assert (await call.read()).request_id == "c1"
                queue2.put_nowait(_req("c2", "hold-c"))
                assert await asyncio.to_thread(engine.holding.wait, 10), "the held request never reached the engine"
                call.cancel()
                try:
                    for _ in range(200):
                        if 'eopd_teacher_requests_total{code="CANCELLED",method="ScoreStream"} 1.0' in await asyncio.to_thread(
                                _metrics, server.http_port):
                            break
                        await asyncio.sleep(0.05)
                finally:
                    engine.release.set()
        metrics = await asyncio.to_thread(_metrics, server.http_port)
        assert 'eopd_teacher_requests_total{code="INTERNAL",method="Score"} 1.0' in metrics
        assert 'eopd_teacher_stream_requests_total{code="INTERNAL"} 1.0' in metrics
        assert 'eopd_teacher_requests_total{code="CANCELLED",method="ScoreStream"} 1.0' in metrics
        assert server.state.ready
    finally:
        await server.stop()


async def test_shared_batch_engine_error_fails_only_the_culprit_request():
    """Two requests batched together, one of which makes the engine raise: the batch is re-scored
    item by item, so only that request gets INTERNAL."""
    settings = TeacherSettings(host="127.0.0.1", grpc_port=0, http_port=0, max_batch_wait_ms=200, grace_seconds=5,
                               **LIMITS, insecure_no_auth=True)
    server = TeacherServer(settings, engine=FlakyEngine())
    await server.start()
    try:
        async with asyncio.timeout(30):
            while not server.state.ready:
                await asyncio.sleep(0.02)
        async with AsyncTeacherClient(f"127.0.0.1:{server.grpc_port}", retry_timeout=0) as client:
            good, bad = await asyncio.gather(
                client.score([("fine", [1, 2, 3, 4], 1)], timeout=10), client.score([("boom-x", [1, 2, 3], 1)], timeout=10),
                return_exceptions=True,
            )
        assert not isinstance(good, BaseException) and len(good[0].token_logprobs) == 3
        assert isinstance(bad, grpc.aio.AioRpcError) and bad.code() == grpc.StatusCode.INTERNAL
        metrics = await asyncio.to_thread(_metrics, server.http_port)
        assert "eopd_teacher_batch_sequences_bucket" in metrics
    finally:
        await server.stop()


async def test_dead_batcher_turns_the_server_not_ready():
    """If the batcher's loop dies, the server reports not ready (/readyz 503, health NOT_SERVING)
    and requests get UNAVAILABLE (retry elsewhere) instead of hanging."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    settings = TeacherSettings(host="127.0.0.1", grpc_port=0, http_port=0, max_batch_wait_ms=1, grace_seconds=5,
                               **LIMITS, insecure_no_auth=True)
    server = TeacherServer(settings, engine=FlakyEngine())
    await server.start()
    try:
        async with asyncio.timeout(30):
            while not server.state.ready:
                await asyncio.sleep(0.02)

        def broken():
            raise KeyError("bug in batch forming")

        server.state.batcher._form_batch = broken
        target = f"127.0.0.1:{server.grpc_port}"
        async with AsyncTeacherClient(target, retry_timeout=0) as client:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await client.score([("a", [1, 2, 3], 1)], timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "batcher stopped" in e.value.details()

        def readyz() -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/readyz", timeout=5) as r:
                    return r.status
            except urllib.error.HTTPError as err:
                return err.code

        assert await asyncio.to_thread(readyz) == 503
        async with grpc.aio.insecure_channel(target) as ch:
            status = (await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert "eopd_teacher_ready 0.0" in await asyncio.to_thread(_metrics, server.http_port)
    finally:
        await server.stop()
