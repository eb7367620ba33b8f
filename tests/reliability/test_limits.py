"""The teacher's limits end to end, against the real server (a subprocess over TCP, tiny-random
model) started with small limits: each is answered RESOURCE_EXHAUSTED with a message naming the
limit, and the server keeps serving afterwards.

    max_streams                      concurrent ScoreStream calls
    max_inflight_tokens_per_client   tokens one client (x-eopd-client, else peer) has in flight
    max_message_bytes                requests: gRPC's own receive limit (its status and message);
                                     answers: refused at admission when their size bound exceeds it
    max_sequences_per_request        sequences in one ScoreRequest

(`max_tokens_per_request` and `max_queue_tokens`:
tests/teacher/grpc/test_server.py::test_lifecycle_not_ready_overload_sigterm_and_client_retry.)"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import grpc
import numpy as np
import pytest

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_teacher.client import TeacherClient
from tests.procs import running_teacher

pytestmark = pytest.mark.integration

MAX_STREAMS = 2
MAX_SEQUENCES = 4
MAX_MESSAGE_BYTES = 1 << 20  # the smallest the settings allow
MAX_CLIENT_TOKENS = 1500  # below two 1000-token requests
# The totals, reached by one client: per-client shares off (they are tests/reliability/test_client_shares.py's).
LIMITS = ("--max-streams", str(MAX_STREAMS), "--max-sequences-per-request", str(MAX_SEQUENCES),
          "--max-message-bytes", str(MAX_MESSAGE_BYTES), "--max-inflight-tokens-per-client", str(MAX_CLIENT_TOKENS),
          "--max-client-share", "1")


@pytest.fixture(scope="module")
def teacher():
    with running_teacher("tiny-random", *LIMITS) as proc:
        yield proc


def req(rid: str = "", n_seqs: int = 1, n_tokens: int = 4, top_k: int = 0, first_token: int = 1) -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=rid, top_k=top_k, sequences=[
        pb.Sequence(id=f"{rid or 'q'}-{i}", token_ids=[(first_token + 7 * j + i) % 49152 for j in range(n_tokens)], score_from=1)
        for i in range(n_seqs)
    ])


def assert_serves(target: str, client: str = "check") -> None:
    """A small unary request and a small stream still succeed."""
    with grpc.insecure_channel(target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        md = (("x-eopd-client", client),)
        resp = stub.Score(req(n_tokens=5), timeout=60, metadata=md)
        assert len(resp.results[0].token_logprobs) == 4
        got = [r.request_id for r in stub.ScoreStream(iter([req("a"), req("b")]), timeout=60, metadata=md)]
        assert sorted(got) == ["a", "b"]


def wait_in_flight(teacher, n: int, timeout: float = 30) -> None:
    """Until the server's eopd_teacher_inflight_requests gauge is n (requests past admission)."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{teacher.http}/metrics", timeout=5) as r:
            if f"eopd_teacher_inflight_requests {float(n)}" in r.read().decode():
                return
        assert time.monotonic() < deadline, f"never {n} requests in flight"
        time.sleep(0.02)


def test_model_info_reports_the_limits(teacher):
    with grpc.insecure_channel(teacher.target) as ch:
        info = pb_grpc.TeacherServiceStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    assert info.max_sequences_per_request == MAX_SEQUENCES


def refused(err: grpc.aio.AioRpcError) -> bool:
    """The server's refusal of a stream, or a client write that raced it: grpc.aio then replaces
    the call's status with its own INTERNAL "Failed execute_batch" (seen in CI under load)."""
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return True
    return err.code() == grpc.StatusCode.INTERNAL and "execute_batch" in (err.debug_error_string() or "")


def test_max_streams(teacher):
    """Two streams held open (each has had an answer, the client keeps its side open): a third is
    refused at once; once one closes, a new stream is accepted."""

    async def go():
        async with grpc.aio.insecure_channel(teacher.target) as ch:
            stub = pb_grpc.TeacherServiceStub(ch)
            held = []
            for i in range(MAX_STREAMS):
                call = stub.ScoreStream(timeout=120)
                await call.write(req(f"held{i}"))
                assert (await asyncio.wait_for(call.read(), 60)).request_id == f"held{i}"
                held.append(call)
            extra = stub.ScoreStream(timeout=120)
            with pytest.raises(grpc.aio.AioRpcError) as e:  # refused as it opens, before any request
                await asyncio.wait_for(extra.read(), 30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
            assert e.value.details() == f"{MAX_STREAMS} streams open, limit {MAX_STREAMS}; retry later"
            # The held streams are unaffected and still answer.
            await held[1].write(req("again"))
            assert (await asyncio.wait_for(held[1].read(), 60)).request_id == "again"
            # One closes: its slot is free again.
            await held[0].done_writing()
            assert await asyncio.wait_for(held[0].read(), 30) is grpc.aio.EOF
            assert await held[0].code() == grpc.StatusCode.OK
            deadline = time.monotonic() + 10
            while True:  # the server's slot is released when its handler returns, just after the EOF
                new = stub.ScoreStream(timeout=120)
                try:
                    await new.write(req("new"))
                    assert (await asyncio.wait_for(new.read(), 60)).request_id == "new"
                    break
                except grpc.aio.AioRpcError as err:
                    assert refused(err) and time.monotonic() < deadline, err
                    await asyncio.sleep(0.1)
            await new.done_writing()
            await held[1].done_writing()
            assert await new.code() == await held[1].code() == grpc.StatusCode.OK

    asyncio.run(go())
    assert_serves(teacher.target)  # both streams closed: the full limit is available again
    assert_serves(teacher.target)


def test_max_inflight_tokens_per_client(teacher):
    """The limit is per client (x-eopd-client): a client with tokens in flight is refused a request
    that would take it over the limit, while another client is admitted at the same time; once the
    first request is answered the client is admitted again."""
    big = req("big", n_seqs=2, n_tokens=2000)  # 4000 tokens: alone, a request over the limit is admitted
    x, y = (("x-eopd-client", "x"),), (("x-eopd-client", "y"),)
    with grpc.insecure_channel(teacher.target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        first = stub.Score.future(big, timeout=120, metadata=x)
        wait_in_flight(teacher, 1)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(req("probe", n_tokens=10), timeout=60, metadata=x)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
        assert e.value.details() == f"client 'id:x' has 4000 tokens in flight; this request adds 10, limit {MAX_CLIENT_TOKENS}"
        assert not first.done()
        other = stub.Score(req("other", n_tokens=1000), timeout=120, metadata=y)  # admitted meanwhile
        assert len(other.results[0].token_logprobs) == 999
        assert len(first.result().results) == 2
        again = stub.Score(req("again", n_tokens=1000), timeout=120, metadata=x)  # x has nothing in flight now
        assert len(again.results[0].token_logprobs) == 999

    # On one stream (the same client): two 1000-token requests sent together; the first is
    # answered, the second refused, and the stream ends with that status.
    async def stream():
        async with grpc.aio.insecure_channel(teacher.target) as ch:
            call = pb_grpc.TeacherServiceStub(ch).ScoreStream(timeout=120, metadata=(("x-eopd-client", "s"),))
            await call.write(req("A", n_tokens=1000))
            await call.write(req("B", n_tokens=1000, first_token=2))
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while (resp := await asyncio.wait_for(call.read(), 60)) is not grpc.aio.EOF:
                    got.append(resp.request_id)
            assert got == ["A"]
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert e.value.details() == f"client 'id:s' has 1000 tokens in flight; this request adds 1000, limit {MAX_CLIENT_TOKENS}"

    asyncio.run(stream())
    assert_serves(teacher.target, client="x")


def test_max_sequences_per_request(teacher):
    with grpc.insecure_channel(teacher.target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        assert len(stub.Score(req(n_seqs=MAX_SEQUENCES), timeout=60).results) == MAX_SEQUENCES
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(req("five", n_seqs=MAX_SEQUENCES + 1), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == (f"sequences: {MAX_SEQUENCES + 1} sequences exceed the limit of {MAX_SEQUENCES} "
                                     "per request (request_id 'five')")
        # On a stream: a per-request limit is answered in band (ScoreResponse.error, not
        # retryable) and the stream goes on serving the requests before and after it.
        answers = {}
        for resp in stub.ScoreStream(iter([req("ok"), req("too-many", n_seqs=MAX_SEQUENCES + 1), req("after")]),
                                     timeout=60):
            answers[resp.request_id] = resp
        assert set(answers) == {"ok", "too-many", "after"}
        assert len(answers["ok"].results) == 1 and len(answers["after"].results) == 1
        bad = answers["too-many"]
        assert not bad.results and bad.HasField("error") and not bad.error.retryable
        assert bad.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert f"exceed the limit of {MAX_SEQUENCES} per request (request_id 'too-many')" in bad.error.message
    assert_serves(teacher.target)


def oversize_request(rid: str = "") -> pb.ScoreRequest:
    # 400 000 three-byte varints: ~1.2 MB on the wire, over the 1 MiB limit, yet under every other
    # limit (tokens per request 2^19); only the message size can refuse it.
    r = pb.ScoreRequest(request_id=rid, sequences=[pb.Sequence(id="huge", token_ids=[49000] * 400_000, score_from=1)])
    assert r.ByteSize() > MAX_MESSAGE_BYTES
    return r


def test_max_message_bytes_request(teacher):
    """A request over the receive limit is refused by gRPC itself before any handler runs: the client
    sees RESOURCE_EXHAUSTED with gRPC's message naming the size and the limit."""
    size = oversize_request().ByteSize()
    expected = f"SERVER: Received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})"
    with grpc.insecure_channel(teacher.target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(oversize_request(), timeout=60)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details() == expected
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for resp in stub.ScoreStream(iter([req("ok"), oversize_request("huge")]), timeout=60):
                got.append(resp.request_id)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert e.value.details().startswith("SERVER: Received message larger than max (") and f"vs. {MAX_MESSAGE_BYTES})" in e.value.details()
        assert got in ([], ["ok"])  # the stream is torn down by gRPC: the earlier answer may not get out
    # The project's client sees the same status and message (it has its own, larger, send limit).
    with TeacherClient(teacher.target, retry_overload=False) as client, pytest.raises(grpc.RpcError) as e:
        client.score([("huge", [49000] * 400_000, 1)])
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and e.value.details() == expected
    assert_serves(teacher.target)


def test_max_message_bytes_response(teacher):
    """The limit applies to answers too: a request within every other per-request limit whose
    answer could exceed max_message_bytes (2 x 2000 positions at top_k 64: up to ~2.3 MB) is refused
    at admission, before any scoring, with a message naming the bound and the limit and the
    not-retryable marker. A request whose bound fits is scored. The server serves on."""
    with grpc.insecure_channel(teacher.target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(req("wide", n_seqs=2, n_tokens=2000, top_k=64), timeout=120)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"over the server's message limit of {MAX_MESSAGE_BYTES} bytes" in e.value.details(), e.value.details()
        assert "split the request" in e.value.details() and "'wide'" in e.value.details()
        assert ("eopd-retryable", "0") in tuple(e.value.trailing_metadata())
        # Half of it fits the bound: scored, and the real answer is under the limit.
        resp = stub.Score(req("half", n_seqs=1, n_tokens=1000, top_k=64), timeout=120)
        assert len(resp.results[0].token_logprobs) == 999 and resp.ByteSize() < MAX_MESSAGE_BYTES
    assert_serves(teacher.target)


@pytest.mark.parametrize("case", ["sequences", "response size", "message size"])
def test_client_does_not_retry_a_request_over_a_per_request_limit(teacher, case):
    """RESOURCE_EXHAUSTED for a full queue or too many streams is retried (it may pass later); for a
    request over a per-request limit it is not: the same request would fail every time."""
    seqs = {
        "sequences": [(f"s{i}", [1, 2, 3], 1) for i in range(MAX_SEQUENCES + 1)],
        "response size": [("wide-a", list(range(1, 2001)), 1), ("wide-b", list(range(2, 2002)), 1)],
        "message size": [("huge", [49000] * 400_000, 1)],
    }[case]
    with TeacherClient(teacher.target, retry_timeout=20) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as e:
            client.score(seqs, top_k=64)
        elapsed = time.monotonic() - started
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert elapsed < 5, f"a request that can never be admitted was retried for {elapsed:.1f}s"


# Issue 17, section 5: answer sizes counted with the ids' UTF-8 bytes; the documented minimum temperature.

EMOJI_ID = "\U0001F600" * 256  # 256 characters (the id limit), 1,024 UTF-8 bytes


def emoji_request(rid: str, n_seqs: int) -> pb.ScoreRequest:
    """n_seqs sequences of 3 tokens (2 scored) at top_k 16 whose ids are 256 emoji: at 900 sequences
    the request (~0.94 MB) fits a 1 MiB limit and its answer (~1.2 MB) does not."""
    return pb.ScoreRequest(request_id=rid, top_k=16, sequences=[
        pb.Sequence(id=f"{i:03d}" + EMOJI_ID[3:], token_ids=[1 + i % 900, 2, 3], score_from=1) for i in range(n_seqs)])


@pytest.fixture(scope="module")
def wide_teacher():
    """The smallest message limit (1 MiB) and the default sequences per request (4096)."""
    with running_teacher("tiny-random", "--max-message-bytes", str(MAX_MESSAGE_BYTES)) as proc:
        yield proc


def test_answer_size_counts_id_bytes(wide_teacher):
    """A request whose answer cannot be sent because of its ids' bytes (900 ids of 256 emoji) is
    refused at admission, before any scoring, on Score and in band on ScoreStream, whose stream goes
    on: the requests before and after it are answered. Before, ids were counted as 256 bytes: the
    request was scored, then the answer failed (on a stream, the whole stream died). Half of it is
    admitted and its real answer fits the limit."""
    big = emoji_request("emoji", 900)
    assert big.ByteSize() < MAX_MESSAGE_BYTES
    scored_before = scored_sequences(wide_teacher)
    with grpc.insecure_channel(wide_teacher.target, options=[("grpc.max_receive_message_length", 64 << 20),
                                                            ("grpc.max_send_message_length", 64 << 20)]) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(big, timeout=120)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"over the server's message limit of {MAX_MESSAGE_BYTES} bytes (request_id 'emoji'); split" in e.value.details()
        assert ("eopd-retryable", "0") in tuple(e.value.trailing_metadata())
        answers = {r.request_id: r for r in stub.ScoreStream(iter([req("before"), big, req("after")]), timeout=120)}
        assert set(answers) == {"before", "emoji", "after"}
        assert len(answers["before"].results) == 1 and len(answers["after"].results) == 1
        bad = answers["emoji"]
        assert not bad.results and not bad.error.retryable
        assert bad.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and "message limit" in bad.error.message
        half = stub.Score(emoji_request("half", 450), timeout=120)
        assert len(half.results) == 450 and half.results[0].id.endswith(EMOJI_ID[:8])
        assert half.ByteSize() <= MAX_MESSAGE_BYTES
    assert scored_sequences(wide_teacher) == scored_before + 2 + 450  # none of the 900 was scored
    assert_serves(wide_teacher.target)


def scored_sequences(teacher) -> float:
    """The server's eopd_teacher_sequences_scored_total counter."""
    with urllib.request.urlopen(f"{teacher.http}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("eopd_teacher_sequences_scored_total "):
                return float(line.split()[1])
    raise AssertionError("no eopd_teacher_sequences_scored_total in /metrics")


def test_documented_minimum_temperature_is_served(wide_teacher):
    """temperature 1e-4, the documented minimum, travels as float32 (9.99999974e-05) and is scored:
    finite log-probs, near-zero entropies (the distribution is almost one-hot)."""
    with TeacherClient(wide_teacher.target) as client:
        (s,) = client.score([("cold", [5, 6, 7, 8], 1)], top_k=4, temperature=1e-4)
    assert np.isfinite(s.token_logprobs).all() and np.isfinite(s.entropies).all()
    assert (s.entropies < 1e-3).all() and np.isfinite(s.topk_logprobs).all()
    with TeacherClient(wide_teacher.target, retry_timeout=0) as client, pytest.raises(grpc.RpcError) as e:
        client.score([("colder", [5, 6, 7, 8], 1)], temperature=9e-5)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details().startswith("temperature: ")
