"""The real teacher server as a subprocess over TCP: contract, concurrency, errors, lifecycle."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_common.models import load_causal_lm
from eopd_teacher.client import AsyncTeacherClient, RequestFailed, ScoreBatch, TeacherClient
from eopd_teacher.server import write_ports_file
from tests.procs import free_port, restart_port, start_teacher, wait_teacher_ready

from ..reference import assert_topk_match, reference_scores

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ref_model():
    return load_causal_lm("tiny-random").model


def _seqs(seed: int, count: int, vocab: int = 49152):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(3, 60))
        out.append((f"seq{seed}-{i}", rng.integers(0, vocab, n).tolist(), int(rng.integers(1, n))))
    return out


def _check(ref_model, seqs, results, top_k=16, temperature=1.0):
    assert [r.seq_id for r in results] == [s[0] for s in seqs]
    for (sid, ids, score_from), r in zip(seqs, results, strict=True):
        lp, ent, ti, tv = reference_scores(ref_model, ids, score_from, top_k, temperature)
        np.testing.assert_allclose(r.token_logprobs, lp, atol=1e-4, rtol=0)
        np.testing.assert_allclose(r.entropies, ent, atol=1e-4, rtol=0)
        assert_topk_match(r.topk_ids, r.topk_logprobs, ti, tv)


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_model_info_health_and_reflection(tiny_teacher):
    with TeacherClient(tiny_teacher.target) as c:
        info = c.info()
    assert info.model_name == "tiny-random" and info.engine == "transformers" and info.vocab_size == 49152
    assert info.default_top_k == 16 and info.max_top_k == 64 and len(info.tokenizer_fingerprint) == 64
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        hs = health_pb2_grpc.HealthStub(ch)
        for service in ("", "eopd.v1.TeacherService"):
            assert hs.Check(health_pb2.HealthCheckRequest(service=service)).status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
        assert {"eopd.v1.TeacherService", "grpc.health.v1.Health"} <= names


def test_unary_matches_reference(tiny_teacher, ref_model):
    seqs = _seqs(0, 6)
    with TeacherClient(tiny_teacher.target) as c:
        _check(ref_model, seqs, c.score(seqs))
        seqs2 = _seqs(1, 3)
        res = c.score(seqs2, top_k=5, temperature=0.7)
        assert all(r.topk_ids.shape[1] == 5 for r in res)
        _check(ref_model, seqs2, res, top_k=5, temperature=0.7)


def test_stream_pipelines_many_requests(tiny_teacher, ref_model):
    batches = [ScoreBatch(f"req-{i}", _seqs(100 + i, 3), top_k=4) for i in range(12)]
    with TeacherClient(tiny_teacher.target) as c:
        answers = dict(c.score_stream(iter(batches)))
    assert set(answers) == {b.request_id for b in batches}
    for b in batches:
        _check(ref_model, b.sequences, answers[b.request_id], top_k=4)


def test_async_stream_and_unary(tiny_teacher, ref_model):
    async def go():
        async with AsyncTeacherClient(tiny_teacher.target) as c:
            batches = [ScoreBatch(f"a-{i}", _seqs(200 + i, 2)) for i in range(6)]
            got = {rid: res async for rid, res in c.score_stream(batches, max_in_flight=3)}
            unary = await c.score(_seqs(300, 2))
            return batches, got, unary

    batches, got, unary = asyncio.run(go())
    assert len(got) == 6
    for b in batches:
        _check(ref_model, b.sequences, got[b.request_id])
    _check(ref_model, _seqs(300, 2), unary)


def _batch_counts(http: str) -> tuple[float, float]:
    """(forward batches, sequences in them) so far, from /metrics."""
    _, metrics = _http(f"{http}/metrics")
    lines = metrics.splitlines()
    count = float(next(line for line in lines if line.startswith("eopd_teacher_batch_sequences_count")).split()[-1])
    total = float(next(line for line in lines if line.startswith("eopd_teacher_batch_sequences_sum")).split()[-1])
    return count, total


def test_concurrent_clients_no_cross_talk(tiny_teacher, ref_model):
    n_clients, per_client = 16, 4
    barrier = threading.Barrier(n_clients)

    def worker(i):
        seqs = _seqs(1000 + i, per_client)
        with TeacherClient(tiny_teacher.target) as c:
            c.info()  # connected before the barrier: the requests arrive together
            barrier.wait(30)
            return seqs, c.score(seqs)

    batches_before, seqs_before = _batch_counts(tiny_teacher.http)
    with ThreadPoolExecutor(n_clients) as pool:
        outcomes = list(pool.map(worker, range(n_clients)))
    for seqs, res in outcomes:  # every client got its own sequences' numbers
        _check(ref_model, seqs, res)
    batches_after, seqs_after = _batch_counts(tiny_teacher.http)
    # This test's 64 sequences (and nothing else: the session's tests run one at a time) went
    # through fewer forward batches than there were requests, so by pigeonhole some batch held
    # sequences of more than one request: the numbers above were checked with batches shared.
    assert seqs_after - seqs_before == n_clients * per_client
    assert batches_after - batches_before < n_clients, (batches_after - batches_before)


def _add(r: pb.ScoreRequest, token_ids, score_from=1, sid="seq-7") -> None:
    r.sequences.add(id=sid, token_ids=token_ids, score_from=score_from)


# (build the request, a fragment naming the field, whether the error is about one sequence, so the
# message must name it: the issue requires "a message that names the field and the sequence").
BAD = [
    (lambda r: _add(r, [1, 49152, 2]), "sequences[0].token_ids[1]", True),
    (lambda r: _add(r, [-1, 2, 3]), "sequences[0].token_ids[0]", True),
    (lambda r: _add(r, []), "sequences[0].token_ids: empty", True),
    (lambda r: _add(r, [1]), "sequences[0].token_ids: 1 token", True),
    (lambda r: _add(r, [1, 2, 3], score_from=3), "sequences[0].score_from", True),
    (lambda r: _add(r, [1, 2, 3], score_from=0), "sequences[0].score_from", True),
    (lambda r: (_add(r, [1, 2], sid="ok"), _add(r, [1] * 2049)), "sequences[1].token_ids: 2049 tokens exceed the model's context of 2048", True),
    (lambda r: (_add(r, [1, 2]), _add(r, [1, 2])), "sequences[1].id: duplicate sequence id", True),
    (lambda r: (_add(r, [1, 2]), setattr(r, "top_k", 65)), "top_k: 65 exceeds", False),
    (lambda r: (_add(r, [1, 2]), setattr(r, "temperature", -0.5)), "temperature", False),
    (lambda r: None, "sequences: at least one", False),
]


def test_bad_input_invalid_argument_and_still_serving(tiny_teacher, ref_model):
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        for build, fragment, names_sequence in BAD:
            r = pb.ScoreRequest(request_id="bad-req")
            build(r)
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(r, timeout=30)
            details = e.value.details()
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (fragment, details)
            assert fragment in details, details
            assert "'bad-req'" in details, details
            if names_sequence:
                assert "'seq-7'" in details, details
    seqs = _seqs(7, 2)
    with TeacherClient(tiny_teacher.target) as c:
        _check(ref_model, seqs, c.score(seqs))
    _, metrics = _http(f"{tiny_teacher.http}/metrics")
    assert 'eopd_teacher_errors_total{code="INVALID_ARGUMENT"}' in metrics


def test_bad_request_in_stream_is_answered_in_band(tiny_teacher):
    """A bad request on a stream is answered in band (ScoreResponse.error, naming the field and the
    request); the requests before and after it are scored and the stream ends OK."""
    good = [pb.ScoreRequest(request_id=f"g{i}", sequences=[pb.Sequence(id="x", token_ids=[1, 2, 3, 4], score_from=1)]) for i in range(4)]
    bad = pb.ScoreRequest(request_id="the-bad-one", sequences=[pb.Sequence(id="x", token_ids=[1, 2], score_from=5)])
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        call = pb_grpc.TeacherServiceStub(ch).ScoreStream(iter(good[:2] + [bad] + good[2:]), timeout=60)
        answers = {resp.request_id: resp for resp in call}
        assert call.code() == grpc.StatusCode.OK
    assert sorted(answers) == ["g0", "g1", "g2", "g3", "the-bad-one"]
    assert all(not answers[f"g{i}"].HasField("error") and len(answers[f"g{i}"].results) == 1 for i in range(4))
    err = answers["the-bad-one"].error
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and not answers["the-bad-one"].results
    assert "the-bad-one" in err.message and "score_from" in err.message


def test_deadline_honoured_and_still_serving(tiny_teacher):
    big = [(f"d{i}", list(range(1, 1500)), 1) for i in range(8)]
    with TeacherClient(tiny_teacher.target, retry_timeout=0) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.score(big, timeout=0.01)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(c.score(_seqs(9, 1))) == 1


def test_http_probes_and_metrics(tiny_teacher):
    assert _http(f"{tiny_teacher.http}/healthz") == (200, '{"status":"alive"}')
    status, body = _http(f"{tiny_teacher.http}/readyz")
    assert status == 200 and json.loads(body)["ready"] is True
    with TeacherClient(tiny_teacher.target) as c:
        c.score([("m", [1, 2, 3, 4, 5], 2)])
    _, metrics = _http(f"{tiny_teacher.http}/metrics")
    for name in (
        'eopd_teacher_requests_total{code="OK",method="Score"}',
        "eopd_teacher_sequences_scored_total",
        "eopd_teacher_tokens_scored_total",
        "eopd_teacher_batch_sequences_bucket",
        "eopd_teacher_batch_tokens_bucket",
        "eopd_teacher_queue_tokens",
        'eopd_teacher_request_latency_seconds_bucket{le="0.005",method="Score"}',
        "eopd_teacher_ready 1.0",
    ):
        assert name in metrics, name


def test_lifecycle_not_ready_overload_sigterm_and_client_retry(ref_model):
    """One server with tight limits: NOT_SERVING while loading, RESOURCE_EXHAUSTED past the
    admission limit, SIGTERM finishes in-flight work, a client retries across a restart."""
    gp, hp = restart_port(), restart_port()
    args = ("--max-queue-tokens", "3000", "--max-batch-tokens", "2048", "--max-tokens-per-request", "4000", "--grace-seconds", "60")
    proc = start_teacher("tiny-random", *args, grpc_port=gp, http_port=hp, wait=False)
    try:
        # 1. While loading: /readyz 503 and health NOT_SERVING (or not yet bound).
        saw_not_ready = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not saw_not_ready:
            status, _ = _http(f"{proc.http}/readyz") if _port_open(hp) else (None, "")
            if status == 503:
                saw_not_ready = True
                with grpc.insecure_channel(proc.target) as ch:
                    st = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                    assert st == health_pb2.HealthCheckResponse.NOT_SERVING
            time.sleep(0.05)
        assert saw_not_ready
        wait_teacher_ready(proc)

        # 2. Over the admission limit -> RESOURCE_EXHAUSTED; per-request token limit too.
        with grpc.insecure_channel(proc.target) as ch:
            stub = pb_grpc.TeacherServiceStub(ch)
            too_big = pb.ScoreRequest(sequences=[pb.Sequence(id=str(i), token_ids=[1] * 1000, score_from=1) for i in range(5)])
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(too_big, timeout=30)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "limit of 4000" in e.value.details()
            load = pb.ScoreRequest(sequences=[pb.Sequence(id=str(i), token_ids=[1] * 1500, score_from=1) for i in range(2)])
            futures = [stub.Score.future(load, timeout=120) for _ in range(6)]
            codes = []
            for f in futures:
                try:
                    f.result()
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
            assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes and grpc.StatusCode.OK in codes

            # 3. SIGTERM while requests are in flight: they finish, the process exits 0.
            seqs = [pb.Sequence(id=str(i), token_ids=list(range(1, 2000)), score_from=1) for i in range(2)]
            # A stream opened before the SIGTERM (its connection stays up during the grace).
            import queue as queue_mod

            stream_q: queue_mod.Queue = queue_mod.Queue()
            stream = stub.ScoreStream(iter(stream_q.get, None), timeout=120)
            stream_q.put(pb.ScoreRequest(request_id="before", sequences=[pb.Sequence(id="x", token_ids=[1, 2, 3], score_from=1)]))
            assert next(stream).request_id == "before"
            inflight = [stub.Score.future(pb.ScoreRequest(sequences=seqs), timeout=120) for _ in range(1)]
            time.sleep(0.05)
            assert not any(f.done() for f in inflight)
            proc.signal(signal.SIGTERM)
            time.sleep(0.2)
            # Draining: new work is refused with UNAVAILABLE (retryable elsewhere), in-flight work
            # finishes. A new call gets gRPC's own refusal (the listener is closed); a request on the
            # open stream gets the server's draining message (a stream-level failure).
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(pb.ScoreRequest(sequences=[pb.Sequence(id="late", token_ids=[1, 2], score_from=1)]), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            stream_q.put(pb.ScoreRequest(request_id="late", sequences=[pb.Sequence(id="x", token_ids=[1, 2, 3], score_from=1)]))
            with pytest.raises(grpc.RpcError) as e:
                next(stream)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            assert e.value.details() == "the server is shutting down; retry on another replica", e.value.details()
            stream_q.put(None)
            for f in inflight:
                assert len(f.result().results) == 2
        assert proc.wait(90) == 0
        assert "draining" in proc.log()

        # 4. A client call started while the server is down succeeds once it is back.
        result: dict = {}

        def call():
            with TeacherClient(f"127.0.0.1:{gp}", retry_timeout=120) as c:
                result["scores"] = c.score([("r", [1, 2, 3], 1)])

        t = threading.Thread(target=call)
        t.start()
        time.sleep(1.0)
        proc = start_teacher("tiny-random", grpc_port=gp, http_port=hp)
        t.join(120)
        assert result["scores"][0].token_logprobs.shape == (2,)
    finally:
        proc.stop()


def _port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _stream_req(rid: str, score_from: int = 1, seq_id: str = "x") -> pb.ScoreRequest:
    return pb.ScoreRequest(request_id=rid, sequences=[pb.Sequence(id=seq_id, token_ids=[1, 2, 3, 4], score_from=score_from)])


def test_bad_request_in_open_stream_answered_promptly(tiny_teacher, ref_model):
    """A producer sends good requests and a bad one, then keeps its side of the stream open
    without sending more: every answer arrives, the bad one in band (INVALID_ARGUMENT naming the
    field, the sequence and the request), without waiting for the client to send or close; the
    same stream serves on afterwards."""

    async def go():
        async with grpc.aio.insecure_channel(tiny_teacher.target) as ch:
            stub = pb_grpc.TeacherServiceStub(ch)
            queue: asyncio.Queue = asyncio.Queue()

            async def requests():
                while (req := await queue.get()) is not None:
                    yield req

            call = stub.ScoreStream(requests(), timeout=120)
            queue.put_nowait(_stream_req("first"))
            first = await asyncio.wait_for(call.read(), 30)
            assert first.request_id == "first"
            for i in range(3):  # in flight together with the bad one
                queue.put_nowait(_stream_req(f"g{i}"))
            queue.put_nowait(_stream_req("the-bad-one", score_from=9, seq_id="seq-bad"))
            started = time.monotonic()
            got = {}
            while len(got) < 4:
                resp = await asyncio.wait_for(call.read(), 30)
                got[resp.request_id] = resp
            elapsed = time.monotonic() - started
            queue.put_nowait(_stream_req("after"))  # the same stream serves on
            after = await asyncio.wait_for(call.read(), 30)
            queue.put_nowait(None)
            assert await asyncio.wait_for(call.read(), 30) is grpc.aio.EOF
            return elapsed, got, after, await call.code()

    elapsed, got, after, code = asyncio.run(go())
    assert elapsed < 20, elapsed
    assert code == grpc.StatusCode.OK and after.request_id == "after" and not after.HasField("error")
    assert sorted(got) == ["g0", "g1", "g2", "the-bad-one"]
    err = got["the-bad-one"].error
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "sequences[0].score_from" in err.message and "seq-bad" in err.message and "the-bad-one" in err.message
    _, metrics = _http(f"{tiny_teacher.http}/metrics")
    assert 'eopd_teacher_stream_requests_total{code="INVALID_ARGUMENT"}' in metrics
    assert 'eopd_teacher_errors_total{code="INVALID_ARGUMENT"}' in metrics
    assert "eopd_teacher_inflight_requests 0.0" in metrics


def test_async_client_stream_bad_request_fails_promptly(tiny_teacher):
    """The same through AsyncTeacherClient.score_stream with a source that stalls after the bad
    request: the in-band INVALID_ARGUMENT is not retried and reaches the caller as RequestFailed."""

    async def go():
        stall = asyncio.Event()

        async def source():
            yield ScoreBatch("ok", [("x", [1, 2, 3], 1)])
            yield ScoreBatch("bad", [("x", [1, 2, 49152], 1)])
            await stall.wait()  # never set

        got = []
        async with AsyncTeacherClient(tiny_teacher.target) as c:
            with pytest.raises(RequestFailed) as e:
                async with asyncio.timeout(30):
                    async for rid, _ in c.score_stream(source()):
                        got.append(rid)
        return got, e.value

    got, err = asyncio.run(go())
    assert err.code == grpc.StatusCode.INVALID_ARGUMENT and err.request_id == "bad" and "sequences[0].token_ids[2]" in err.details
    assert got in ([], ["ok"])


def test_async_client_stream_timeout_is_a_deadline_for_the_whole_stream(tiny_teacher):
    """score_stream(timeout=...) bounds a stream whose source stalls (answers before the deadline
    are delivered), and bounds re-sending to an unreachable server too."""

    async def stalled():
        stall = asyncio.Event()

        async def source():
            yield ScoreBatch("before", [("x", [1, 2, 3], 1)])
            await stall.wait()  # never set

        got = []
        started = time.monotonic()
        async with AsyncTeacherClient(tiny_teacher.target) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for rid, _ in c.score_stream(source(), timeout=3):
                    got.append(rid)
        return got, e.value.code(), time.monotonic() - started

    got, code, elapsed = asyncio.run(stalled())
    assert got == ["before"] and code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert 2.5 < elapsed < 30, elapsed

    async def unreachable():
        started = time.monotonic()
        async with AsyncTeacherClient(f"127.0.0.1:{free_port()}", retry_timeout=300) as c:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in c.score_stream([ScoreBatch("r", [("x", [1, 2, 3], 1)])], timeout=2):
                    pass
        return e.value.code(), time.monotonic() - started

    code, elapsed = asyncio.run(unreachable())
    assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert elapsed < 30, elapsed  # not the 300 s retry budget


def test_failed_load_is_reported_by_readyz_then_exits_1(tmp_path):
    """A model that cannot be loaded: /readyz answers 503 with the error for load_failure_grace_s,
    then the process exits 1."""
    missing = tmp_path / "no-such-model"
    proc = start_teacher(str(missing), "--load-failure-grace-s", "5", wait=False)
    try:
        body = None
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.alive():
            if _port_open(proc.http_port):
                status, text = _http(f"{proc.http}/readyz")
                if status == 503 and "error" in json.loads(text):
                    body = json.loads(text)
                    break
            time.sleep(0.2)
        assert body is not None, proc.log()[-3000:]
        assert body["ready"] is False and "no-such-model" in body["error"], body
        assert proc.wait(60) == 1
        assert "loading the model failed" in proc.log()
    finally:
        proc.stop()


def test_write_ports_file_replaces_the_file_whole(tmp_path):
    """The ports file is written beside and renamed over (a reader sees the old file or the new
    one, never half of one), holds the ports and this pid, and leaves no temp file behind."""
    path = tmp_path / "teacher.ports.json"
    path.write_text("stale")
    write_ports_file(path, 50123, 8123)
    assert json.loads(path.read_text()) == {"grpc_port": 50123, "http_port": 8123, "pid": os.getpid(), "http_scheme": "http"}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
