"""Property-based fuzzing of ScoreStream against the real server (the `tiny_teacher` subprocess over
TCP): each example opens a stream and sends 1-4 random requests (random ids, lengths, score_from,
top_k, temperatures, huge and negative values, empty and duplicated entries: the ScoreRequest
strategy of test_fuzz.py). Every request is answered with its results, or with an in-band
`ScoreResponse.error` naming the problem (the stream goes on), or the stream ends with a status
whose message names the problem; a valid request is never refused and an invalid one never scored.
The test counts the examples hypothesis actually ran (>= 500), and the server still serves after."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from tests.reliability.test_fuzz import EXPECTED, _expected_code, request

pytestmark = pytest.mark.integration

EXAMPLES = 500
# What a refusal's message must start with: the field (or the request) it is about.
NAMED = ("request: ", "request_id", "sequences", "top_k", "temperature")


@st.composite
def valid_sequence(draw, sid: str) -> pb.Sequence:
    ids = draw(st.lists(st.integers(0, 49151), min_size=2, max_size=40))
    return pb.Sequence(id=sid, token_ids=ids, score_from=draw(st.integers(1, len(ids) - 1)))


# Valid requests too (random ones are almost never valid), mixed with the random ones in a stream.
valid_request = st.integers(1, 4).flatmap(lambda n: st.builds(
    lambda seqs, k, t: pb.ScoreRequest(sequences=seqs, top_k=k, temperature=t),
    st.tuples(*[valid_sequence(f"v{i}") for i in range(n)]).map(list),
    st.integers(0, 64),
    st.one_of(st.just(0.0), st.floats(0.25, 4.0)),
))


def _unique_ids(reqs: list[pb.ScoreRequest]) -> list[pb.ScoreRequest]:
    """Request ids made unique within the stream (answers are matched by id), keeping an over-long
    (invalid) id over-long."""
    out = []
    for i, r in enumerate(reqs):
        r = pb.ScoreRequest.FromString(r.SerializeToString())
        r.request_id = f"q{i}" + ("x" * 300 if len(r.request_id) > 256 else "")
        out.append(r)
    return out


def _check_scored(req: pb.ScoreRequest, resp: pb.ScoreResponse) -> None:
    assert [r.id for r in resp.results] == [s.id for s in req.sequences]
    for s, r in zip(req.sequences, resp.results, strict=True):
        n = len(s.token_ids) - s.score_from
        assert len(r.token_logprobs) == len(r.entropies) == n and len(r.topk_ids) == n * r.top_k
        assert all(math.isfinite(x) for x in r.entropies) and all(x <= 1e-6 for x in r.token_logprobs)


@pytest.fixture(scope="module")
def stub(tiny_teacher):
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        yield pb_grpc.TeacherServiceStub(ch)


def test_score_stream_fuzz(stub):
    ran = []
    outcomes = {"scored": 0, "in_band_error": 0, "stream_status": 0}

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
              database=None)
    @given(reqs=st.lists(st.one_of(request, valid_request), min_size=1, max_size=4))
    def case(reqs):
        ran.append(1)
        reqs = _unique_ids(reqs)
        by_id = {r.request_id: r for r in reqs}
        answers: dict[str, pb.ScoreResponse] = {}
        code, details = grpc.StatusCode.OK, ""
        try:
            for resp in stub.ScoreStream(iter(reqs), timeout=60):
                assert not resp.HasField("ending"), "an `ending` message without asking for it"
                assert resp.request_id in by_id and resp.request_id not in answers, resp.request_id
                answers[resp.request_id] = resp
        except grpc.RpcError as err:
            code, details = err.code(), err.details()
        assert code in EXPECTED, (code, details)
        for r in reqs:
            expected = _expected_code(r)
            resp = answers.get(r.request_id)
            if resp is None:
                continue
            if resp.HasField("error"):
                assert expected != grpc.StatusCode.OK or resp.error.retryable, (r, resp.error)
                assert resp.error.message.startswith(NAMED) or resp.error.retryable, resp.error.message
                assert not resp.results
                outcomes["in_band_error"] += 1
            else:
                assert expected == grpc.StatusCode.OK, ("an invalid request was scored", r)
                _check_scored(r, resp)
                outcomes["scored"] += 1
        unanswered = [r for r in reqs if r.request_id not in answers]
        if code == grpc.StatusCode.OK:
            assert not unanswered, f"the stream ended OK with {len(unanswered)} request(s) unanswered"
        else:
            # The stream ended with a status: its message names the problem, and a request it did
            # not answer is one that deserved a refusal (or was sent after it).
            outcomes["stream_status"] += 1
            assert details and details.startswith(NAMED), details
            assert unanswered and any(_expected_code(r) != grpc.StatusCode.OK for r in reqs), (details, reqs)

    case()
    print(f"ScoreStream fuzz: {len(ran)} examples, {outcomes}")
    assert len(ran) >= EXAMPLES, f"hypothesis ran only {len(ran)} examples"
    assert outcomes["scored"] > 0 and outcomes["in_band_error"] + outcomes["stream_status"] > 0, outcomes


def test_server_still_serves_after_stream_fuzzing(stub):
    resp = stub.Score(pb.ScoreRequest(sequences=[pb.Sequence(id="after", token_ids=[1, 2, 3], score_from=1)]), timeout=30)
    assert len(resp.results[0].entropies) == 2
    answers = list(stub.ScoreStream(iter([pb.ScoreRequest(request_id="s", sequences=[
        pb.Sequence(id="a", token_ids=[1, 2, 3, 4], score_from=1)])]), timeout=30))
    assert [a.request_id for a in answers] == ["s"] and len(answers[0].results[0].entropies) == 3
