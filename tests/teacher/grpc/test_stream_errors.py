"""ScoreStream's in-band per-request errors (`ScoreResponse.error`) over a real server subprocess:
a bad request loses nothing else, the stream stays open, and the clients' `on_error` modes."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_teacher.client import AsyncTeacherClient, RequestFailed, ScoreBatch, TeacherClient
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

MAX_SEQUENCES = 3
CLIENT_TOKENS = 5000  # per-client in-flight tokens: two 3000-token requests at once are over it


@pytest.fixture(scope="module")
def teacher():
    args = ("--max-sequences-per-request", str(MAX_SEQUENCES), "--max-inflight-tokens-per-client", str(CLIENT_TOKENS), "--max-batch-wait-ms", "20")
    with running_teacher("tiny-random", *args) as proc:
        yield proc


def _req(rid: str, *, score_from: int = 1, n_seqs: int = 1, first: int = 1) -> pb.ScoreRequest:
    return pb.ScoreRequest(
        request_id=rid, sequences=[pb.Sequence(id=f"s{i}", token_ids=[first + i, 2, 3, 4], score_from=score_from) for i in range(n_seqs)]
    )


def test_raw_stream_answers_errors_in_band_and_stays_open(teacher):
    """Good, invalid, over a per-request limit, empty id, good: every request is answered on the
    same stream (errors in band, with their code and a message naming the field and request), and
    the stream ends OK when the client half-closes."""

    async def go():
        async with grpc.aio.insecure_channel(teacher.target) as ch:
            call = pb_grpc.TeacherServiceStub(ch).ScoreStream(timeout=60)
            sent = [_req("a"), _req("bad", score_from=9), _req("many", n_seqs=MAX_SEQUENCES + 1), _req(""), _req("b", first=7)]
            for r in sent:
                await call.write(r)
            got = {}
            for _ in sent:
                resp = await asyncio.wait_for(call.read(), 30)
                got[resp.request_id] = resp
            # Still open: one more request, answered, then a clean end.
            await call.write(_req("after"))
            after = await asyncio.wait_for(call.read(), 30)
            await call.done_writing()
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
            return got, after, await call.code()

    got, after, code = asyncio.run(go())
    assert code == grpc.StatusCode.OK
    assert set(got) == {"a", "bad", "many", "", "b"}
    for rid in ("a", "b"):
        assert not got[rid].HasField("error") and len(got[rid].results[0].token_logprobs) == 3
    bad = got["bad"]
    assert not bad.results and bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not bad.error.retryable
    assert "sequences[0].score_from" in bad.error.message and "'bad'" in bad.error.message
    many = got["many"].error
    assert many.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and not many.retryable
    assert f"exceed the limit of {MAX_SEQUENCES} per request" in many.message and "'many'" in many.message
    assert got[""].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "request_id" in got[""].error.message
    assert after.request_id == "after" and not after.HasField("error")


def test_duplicate_in_flight_request_id_is_refused_in_band(teacher):
    """The second of two requests with one id, sent while the first is unanswered, gets
    INVALID_ARGUMENT naming request_id; the first is scored."""

    async def go():
        async with grpc.aio.insecure_channel(teacher.target) as ch:
            call = pb_grpc.TeacherServiceStub(ch).ScoreStream(timeout=60)
            # A long first request keeps "dup" in flight while the second arrives.
            first = pb.ScoreRequest(request_id="dup", sequences=[pb.Sequence(id=f"x{i}", token_ids=list(range(1, 1500)), score_from=1) for i in range(2)])
            await call.write(first)
            await call.write(_req("dup"))
            answers = [await asyncio.wait_for(call.read(), 60) for _ in range(2)]
            await call.done_writing()
            await call.wait_for_connection()
            return answers, await call.code()

    answers, code = asyncio.run(go())
    assert code == grpc.StatusCode.OK
    errors = [a for a in answers if a.HasField("error")]
    scored = [a for a in answers if not a.HasField("error")]
    assert len(errors) == 1 and len(scored) == 1 and len(scored[0].results) == 2
    assert errors[0].request_id == "dup" and errors[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "request_id: 'dup' is already in flight" in errors[0].error.message


def _batches():
    return [
        ScoreBatch("ok-1", [("x", [1, 2, 3], 1)]),
        ScoreBatch("bad", [("x", [1, 2, 49152], 1)]),
        ScoreBatch("ok-2", [("x", [4, 5, 6, 7], 2)]),
        ScoreBatch("too-many", [(f"x{i}", [1, 2, 3], 1) for i in range(MAX_SEQUENCES + 1)]),
        ScoreBatch("ok-3", [("x", [8, 9], 1)]),
    ]


def test_async_client_on_error_yield_and_raise(teacher):
    async def go():
        async with AsyncTeacherClient(teacher.target, retry_timeout=5) as c:
            got = {rid: res async for rid, res in c.score_stream(_batches(), max_in_flight=2, on_error="yield")}
            raised = None
            seen = []
            try:
                async for rid, _ in c.score_stream([ScoreBatch("fine", [("x", [1, 2, 3], 1)]), ScoreBatch("bad", [("x", [1, 2], 5)])], max_in_flight=1):
                    seen.append(rid)
            except RequestFailed as exc:
                raised = exc
            return got, raised, seen

    got, raised, seen = asyncio.run(go())
    assert set(got) == {"ok-1", "bad", "ok-2", "too-many", "ok-3"}
    assert [len(got[r][0].token_logprobs) for r in ("ok-1", "ok-2", "ok-3")] == [2, 2, 1]
    bad, many = got["bad"], got["too-many"]
    assert isinstance(bad, RequestFailed) and bad.request_id == "bad" and bad.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequences[0].token_ids[2]" in bad.details
    assert isinstance(many, RequestFailed) and many.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert seen == ["fine"]
    assert isinstance(raised, RequestFailed) and raised.request_id == "bad" and raised.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "score_from" in raised.details


def test_async_client_refuses_a_request_id_already_in_flight(teacher):
    async def go():
        async with AsyncTeacherClient(teacher.target) as c:
            batches = [ScoreBatch("same", [("x", list(range(1, 1500)), 1)]), ScoreBatch("same", [("x", [1, 2], 1)])]
            async for _ in c.score_stream(batches, max_in_flight=4):
                pass

    with pytest.raises(ValueError, match="request_id 'same' is already in flight"):
        asyncio.run(asyncio.wait_for(go(), 60))


def test_sync_client_on_error(teacher):
    with TeacherClient(teacher.target) as c:
        got = dict(c.score_stream(iter(_batches()), on_error="yield"))
        assert set(got) == {"ok-1", "bad", "ok-2", "too-many", "ok-3"}
        assert isinstance(got["bad"], RequestFailed) and got["bad"].code == grpc.StatusCode.INVALID_ARGUMENT
        assert isinstance(got["too-many"], RequestFailed) and got["too-many"].code == grpc.StatusCode.RESOURCE_EXHAUSTED
        np.testing.assert_array_equal(got["ok-2"][0].topk_ids.shape, (2, 16))
        with pytest.raises(RequestFailed) as e:
            list(c.score_stream(iter(_batches())))
        assert e.value.request_id == "bad"
        with pytest.raises(ValueError, match="already in flight"):
            list(c.score_stream(iter([ScoreBatch("d", [("x", list(range(1, 1500)), 1)]), ScoreBatch("d", [("x", [1, 2], 1)])])))


def _big(rid: str, first: int) -> pb.ScoreRequest:
    ids = [first] + list(range(1, 1500))  # 2 x 1500 tokens
    return pb.ScoreRequest(request_id=rid, sequences=[pb.Sequence(id=f"big{i}", token_ids=ids, score_from=1) for i in range(2)])


def test_stream_level_overload_ends_the_stream_announced_first(teacher):
    """Overload (here the client's in-flight tokens) is stream-level: the stream ends with
    RESOURCE_EXHAUSTED after the requests in flight are answered. A client that asks with
    `eopd-stream-ending: 1` is told in band first (StreamEnding: the request, code and message);
    the server reads on, dropping what arrives, until the client half-closes; only then does the
    status follow, so no write of the client races the end (grpc/grpc#36066). A client that never
    half-closes still gets the status, after the grace period."""

    async def go():
        async with grpc.aio.insecure_channel(teacher.target) as ch:
            stub = pb_grpc.TeacherServiceStub(ch)
            results = []
            for n, half_close in enumerate((True, False)):
                queue: asyncio.Queue = asyncio.Queue()

                async def requests():
                    while (req := await queue.get()) is not None:
                        yield req

                md = (("eopd-stream-ending", "1"), ("x-eopd-client", f"ending-{n}"))
                call = stub.ScoreStream(requests(), timeout=60, metadata=md)
                queue.put_nowait(_big("A", 5))
                queue.put_nowait(_big("B", 6))  # while A is in flight: over the client's limit
                got, ending = [], None
                while ending is None:
                    resp = await asyncio.wait_for(call.read(), 30)
                    if resp.HasField("ending"):
                        ending = resp
                    else:
                        got.append(resp.request_id)
                assert got == ["A"]  # in flight before the failure: answered before the ending
                assert ending.request_id == "" and not ending.results and ending.ending.request_id == "B"
                assert ending.ending.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
                assert f"client 'id:ending-{n}' has" in ending.ending.message
                if half_close:
                    queue.put_nowait(_req("sent-after-the-ending"))  # read and dropped, no error
                    queue.put_nowait(None)  # half-close
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async with asyncio.timeout(30):
                        while (resp := await call.read()) is not grpc.aio.EOF:
                            raise AssertionError(f"nothing is answered after the ending: {resp}")
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert e.value.details() == ending.ending.message
                results.append(e.value.code())
            return results

    assert asyncio.run(go()) == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 2


def _metrics_text(http: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{http}/metrics", timeout=5) as r:
        return r.read().decode()


def _tokens_scored(http: str) -> float:
    text = _metrics_text(http)
    return float(next(line for line in text.splitlines() if line.startswith("eopd_teacher_tokens_scored_total")).split()[-1])


def _info_calls(http: str) -> float:
    """GetModelInfo calls the replica answered (its requests counter)."""
    return sum(float(line.split()[-1]) for line in _metrics_text(http).splitlines()
               if line.startswith("eopd_teacher_requests_total") and "GetModelInfo" in line)


def test_streams_spread_over_replicas(teacher, tiny_teacher):
    """Two replicas behind one round_robin target: score_stream(streams=2) opens two ScoreStream
    calls, which land on different replicas, and spreads the requests over them: both score."""
    target = f"ipv4:127.0.0.1:{teacher.grpc_port},127.0.0.1:{tiny_teacher.grpc_port}"
    before = [_tokens_scored(p.http) for p in (teacher, tiny_teacher)]

    async def go():
        async with AsyncTeacherClient(target, load_balancing="round_robin") as c:
            # round_robin connects to every address; wait until unary calls have reached both, so
            # that the two streams are placed over two READY subchannels (under load one subchannel
            # was still connecting after 20 calls: the calls, then both streams, went to the other)
            info_before = [_info_calls(p.http) for p in (teacher, tiny_teacher)]
            reached = [False, False]
            for _ in range(600):
                await c.info()
                reached = [_info_calls(p.http) > b for p, b in zip((teacher, tiny_teacher), info_before, strict=True)]
                if all(reached):
                    break
                await asyncio.sleep(0.05)
            assert all(reached), f"round_robin never reached both replicas: {reached}"
            batches = [ScoreBatch(f"r{i}", [("x", [1 + i, 2, 3, 4, 5], 1)]) for i in range(24)]
            return {rid: res async for rid, res in c.score_stream(batches, max_in_flight=4, streams=2, on_error="yield")}

    got = asyncio.run(go())
    assert sorted(got) == sorted(f"r{i}" for i in range(24))
    assert all(len(res[0].token_logprobs) == 4 for res in got.values())
    after = [_tokens_scored(p.http) for p in (teacher, tiny_teacher)]
    gained = [a - b for a, b in zip(after, before, strict=True)]
    assert all(g > 0 for g in gained), gained
    assert sum(gained) == 24 * 4
