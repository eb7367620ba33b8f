"""Property-based fuzzing of the teacher's request handling against the real server: random ids,
lengths, score_from, top_k, temperatures, huge and negative values, empty and duplicated entries,
and malformed bytes on the wire. Every case gets a status with a message, and the server keeps
serving."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc

pytestmark = pytest.mark.integration

VOCAB, CONTEXT, MAX_K = 49152, 2048, 64
EXPECTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}

token = st.one_of(st.integers(0, VOCAB - 1), st.integers(-(2**31), 2**31 - 1))
sequence = st.builds(
    lambda sid, ids, frm: pb.Sequence(id=sid, token_ids=ids, score_from=frm),
    st.one_of(st.just("s"), st.text(max_size=8), st.text(min_size=250, max_size=300)),
    st.one_of(st.lists(token, max_size=40), st.integers(CONTEXT - 1, CONTEXT + 2).map(lambda n: [7] * n)),
    st.one_of(st.integers(0, 45), st.integers(0, 2**32 - 1)),
)
request = st.builds(
    lambda rid, seqs, k, t: pb.ScoreRequest(request_id=rid, sequences=seqs, top_k=k, temperature=t),
    st.text(max_size=300),
    st.lists(sequence, max_size=6),
    st.one_of(st.integers(0, 70), st.integers(0, 2**32 - 1)),
    st.one_of(st.just(0.0), st.floats(width=32, allow_nan=True, allow_infinity=True)),
)


def _expected_code(req: pb.ScoreRequest) -> grpc.StatusCode:
    """What a correct server must answer (a plain re-statement of the contract)."""
    ok = bool(req.sequences) and len(req.request_id) <= 256
    t = req.temperature or 1.0
    ok &= math.isfinite(t) and 1e-4 <= t <= 1e4 and (req.top_k or 16) <= MAX_K
    ids = [s.id for s in req.sequences]
    ok &= all(ids) and len(set(ids)) == len(ids) and all(len(i) <= 256 for i in ids)
    for s in req.sequences:
        n = len(s.token_ids)
        ok &= 2 <= n <= CONTEXT and all(0 <= t < VOCAB for t in s.token_ids) and 1 <= s.score_from < n
    return grpc.StatusCode.OK if ok else grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def stub(tiny_teacher):
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        yield pb_grpc.TeacherServiceStub(ch)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(req=request)
def test_score_request_fuzz(stub, req):
    try:
        resp = stub.Score(req, timeout=60)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        code, details = err.code(), err.details()
    assert code in EXPECTED, (code, details)
    assert code == _expected_code(req), (code, details, req)
    if code == grpc.StatusCode.OK:
        assert [r.id for r in resp.results] == [s.id for s in req.sequences]
        for s, r in zip(req.sequences, resp.results, strict=True):
            n = len(s.token_ids) - s.score_from
            assert len(r.token_logprobs) == len(r.entropies) == n and len(r.topk_ids) == n * r.top_k
            assert all(math.isfinite(x) for x in r.entropies) and all(x <= 1e-6 for x in r.token_logprobs)
    else:
        assert details and ("sequences" in details or "top_k" in details or "temperature" in details or "request_id" in details)


def _corrupt(raw: bytes, at: int, junk: bytes) -> bytes:
    """Truncates a valid message at a random point, or splices junk bytes in."""
    cut = at * len(raw) // 100
    return raw[:cut] if not junk else raw[:cut] + junk + raw[cut + len(junk):]


VALID = pb.ScoreRequest(request_id="r", top_k=4, sequences=[
    pb.Sequence(id="a", token_ids=[1, 2, 3, 4, 5], score_from=2), pb.Sequence(id="b", token_ids=[9, 8, 7], score_from=1)
]).SerializeToString()


@pytest.fixture(scope="module")
def raw_score(tiny_teacher):
    """ScoreRequest bytes as given, no serializer (one channel for every case)."""
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        yield ch.unary_unary("/eopd.v1.TeacherService/Score", request_serializer=None, response_deserializer=None)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(payload=st.one_of(
    st.binary(max_size=200),
    st.tuples(st.integers(0, 99), st.binary(max_size=8)).map(lambda t: _corrupt(VALID, *t)),
))
def test_malformed_bytes_on_the_wire(raw_score, payload):
    try:
        raw_score(payload, timeout=30)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as err:
        code, details = err.code(), err.details()
    # Undecodable bytes get INVALID_ARGUMENT naming the problem; bytes that happen to decode to
    # some ScoreRequest are validated like any other request.
    assert code in EXPECTED, (code, details)
    if code != grpc.StatusCode.OK:
        assert details.startswith(("request: not a valid protobuf", "sequences", "top_k", "temperature", "request_id")), details


def test_server_still_serves_after_fuzzing(stub):
    resp = stub.Score(pb.ScoreRequest(sequences=[pb.Sequence(id="after", token_ids=[1, 2, 3], score_from=1)]), timeout=30)
    assert len(resp.results[0].entropies) == 2
