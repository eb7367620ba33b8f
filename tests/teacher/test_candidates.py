"""Per-position candidate scoring (issue 19 section 3): `Sequence.candidate_ids [n, m]` ->
`SequenceScores.candidate_logprobs [n, m]`, through the statistics core, the validation, a real
server over TCP (unary, stream) and the Python clients (sync, async)."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
import torch

from eopd.v1 import teacher_pb2 as pb
from eopd.v1 import teacher_pb2_grpc as pb_grpc
from eopd_common.models import load_causal_lm
from eopd_teacher.client import AsyncTeacherClient, RequestFailed, ScoreBatch, SequenceInput, TeacherClient
from eopd_teacher.convert import scores_from_pb, scores_to_pb
from eopd_teacher.stats import token_statistics
from eopd_teacher.types import ModelInfo, SequenceScores
from eopd_teacher.validation import InvalidRequest
from tests.teacher.wire import items_from_request

VOCAB = 49152


def _info(max_candidates: int = 8, vocab: int = 100) -> ModelInfo:
    return ModelInfo("m", "r", vocab, 64, "float32", "transformers", 4, 8, "f" * 64, 16, 1024, "v", max_candidates)


def _candidates(rng, n: int, m: int, vocab: int) -> np.ndarray:
    c = rng.integers(0, vocab, (n, m))
    c[rng.random((n, m)) < 0.2] = -1  # filler
    return c


def test_statistics_candidates_match_the_full_log_softmax_chunked():
    """The candidates' log-probs equal the fp64 full-vocabulary log-softmax at those ids (temperature
    applied), filler is NaN, across chunk boundaries; the other statistics do not change."""
    g = torch.Generator().manual_seed(0)
    n, d, v, m = 37, 16, 300, 5
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g)
    targets = torch.randint(0, v, (n,), generator=g)
    inv_t = torch.full((n,), 1 / 0.7)
    cand = torch.from_numpy(_candidates(np.random.default_rng(1), n, m, v))
    got = token_statistics(h, w, targets, inv_t, 4, chunk_size=8, candidates=cand)
    plain = token_statistics(h, w, targets, inv_t, 4, chunk_size=8)
    ref = torch.log_softmax((h.double() @ w.double().T) * inv_t.double()[:, None], dim=-1)
    filler = cand < 0
    want = ref.gather(-1, cand.clamp(min=0)).float()
    assert got.candidate_logprobs.shape == (n, m)
    assert torch.isnan(got.candidate_logprobs[filler]).all()
    torch.testing.assert_close(got.candidate_logprobs[~filler], want[~filler], atol=1e-5, rtol=0)
    for name in ("token_logprobs", "entropies", "topk_ids", "topk_logprobs"):
        assert torch.equal(getattr(got, name), getattr(plain, name)), name
    assert plain.candidate_logprobs.shape == (n, 0)


@pytest.mark.parametrize(
    "num_candidates, ids, fragment",
    [
        (9, [0] * 18, "sequences[0].num_candidates: 9 exceeds the server's maximum 8"),
        (2, [0] * 5, "sequences[0].candidate_ids: 5 ids, expected 2 scored positions x num_candidates 2 = 4"),
        (2, [0, 1, 100, 3], "sequences[0].candidate_ids[2]: token id 100 is outside the vocabulary [0, 100)"),
        (2, [0, -2, 1, 3], "sequences[0].candidate_ids[1]: token id -2"),
        (0, [1, 2], "sequences[0].candidate_ids: 2 ids given but num_candidates is 0"),
    ],
)
def test_bad_candidates_are_refused_naming_the_field(num_candidates, ids, fragment):
    req = pb.ScoreRequest(sequences=[pb.Sequence(id="a", token_ids=[1, 2, 3], score_from=1,
                                                 candidate_ids=ids, num_candidates=num_candidates)])
    with pytest.raises(InvalidRequest) as e:
        items_from_request(req, _info())
    assert fragment in str(e.value)


def test_candidates_round_trip_through_protobuf():
    req = pb.ScoreRequest(sequences=[pb.Sequence(id="a", token_ids=[1, 2, 3, 4], score_from=1,
                                                 candidate_ids=[5, -1, 7, 8, 9, -1], num_candidates=2)])
    (item,) = items_from_request(req, _info())
    assert item.candidate_ids.tolist() == [[5, -1], [7, 8], [9, -1]]
    clp = np.array([[-1.0, np.nan], [-2.0, -3.0], [-4.0, np.nan]], dtype=np.float32)
    s = SequenceScores("a", np.zeros(3, np.float32), np.zeros(3, np.float32), np.zeros((3, 1), np.int32),
                       np.zeros((3, 1), np.float32), clp)
    back = scores_from_pb(scores_to_pb(s))
    np.testing.assert_array_equal(back.candidate_logprobs, clp)
    plain = scores_from_pb(scores_to_pb(SequenceScores("b", *(getattr(s, f) for f in
                                                             ("token_logprobs", "entropies", "topk_ids", "topk_logprobs")))))
    assert plain.candidate_logprobs.shape == (3, 0)


def test_engine_batch_with_mixed_m_equals_each_alone():
    """One transformers-engine batch mixing m = 0, 5 and 9 (padded with filler to the widest inside
    the engine): every item's candidates equal its answer scored alone; m = 0 items get None."""
    import dataclasses

    from eopd_teacher.engines.transformers_engine import TransformersEngine
    from eopd_teacher.settings import TeacherSettings
    from eopd_teacher.types import ScoreItem

    eng = TransformersEngine(TeacherSettings(model="tiny-random", chunk_size=7, compile_statistics=False).engine_settings())
    eng.load()
    try:
        rng = np.random.default_rng(3)
        items = []
        for i, (n, m) in enumerate([(9, 5), (30, 0), (14, 9), (3, 5)]):
            it = ScoreItem(f"s{i}", rng.integers(0, VOCAB, n).astype(np.int64), int(rng.integers(1, n)), 4, 0.9)
            items.append(dataclasses.replace(it, candidate_ids=_candidates(rng, it.num_scored, m, VOCAB)) if m else it)
        alone = [eng.score([it])[0] for it in items]
        for it, got, want in zip(items, eng.score(items), alone, strict=True):
            if it.candidate_ids is None:
                assert got.candidate_logprobs is None
                continue
            filler = it.candidate_ids < 0
            assert got.candidate_logprobs.shape == it.candidate_ids.shape and np.isnan(got.candidate_logprobs[filler]).all()
            np.testing.assert_allclose(got.candidate_logprobs[~filler], want.candidate_logprobs[~filler], atol=1e-5, rtol=0)
    finally:
        eng.shutdown()


# -- a real server over TCP ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def ref_model():
    return load_causal_lm("tiny-random").model


def _reference_logp(model, ids, score_from, temperature=1.0) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / temperature, -1)[score_from - 1 : len(ids) - 1].numpy()  # [n, V]


def _inputs(seed: int, count: int, m: int):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        n = int(rng.integers(4, 40))
        ids = rng.integers(0, VOCAB, n).tolist()
        score_from = int(rng.integers(1, n))
        out.append(SequenceInput(f"s{seed}-{i}", ids, score_from, _candidates(rng, n - score_from, m, VOCAB)))
    return out


def _check(ref_model, inputs, results, temperature=1.0):
    assert [r.seq_id for r in results] == [s.id for s in inputs]
    for s, r in zip(inputs, results, strict=True):
        ref = _reference_logp(ref_model, s.token_ids, s.score_from, temperature)
        c = s.candidate_ids
        assert r.candidate_logprobs.shape == c.shape and r.candidate_logprobs.dtype == np.float32
        assert np.isnan(r.candidate_logprobs[c < 0]).all()
        want = np.take_along_axis(ref, np.maximum(c, 0), axis=1)
        np.testing.assert_allclose(r.candidate_logprobs[c >= 0], want[c >= 0], atol=1e-4, rtol=0)


@pytest.mark.integration
def test_unary_candidates_match_reference_and_the_other_statistics(tiny_teacher, ref_model):
    """Candidates through Score (sync client): equal to the reference log-softmax; a candidate that
    is the scored token or a top-k id gets the same number as token_logprobs / topk_logprobs; a
    sequence without candidates in the same request gets an [n, 0] array."""
    inputs = _inputs(0, 3, 6)
    with TeacherClient(tiny_teacher.target) as c:
        info = c.info()
        assert info.max_candidates == 64
        results = c.score(inputs + [("plain", [1, 2, 3, 4], 1)], top_k=4, temperature=0.8)
        _check(ref_model, inputs, results[:3], temperature=0.8)
        assert results[3].candidate_logprobs.shape == (3, 0)
        # self-consistency: candidates = [scored token, top-k ids] at each position
        s = inputs[0]
        first = results[0]
        own = np.concatenate([np.asarray(s.token_ids[s.score_from:])[:, None], first.topk_ids], axis=1)
        (again,) = c.score([SequenceInput("again", s.token_ids, s.score_from, own)], top_k=4, temperature=0.8)
    # token_logprobs are computed from the max-shifted logits: equal up to fp32 rounding (1 ulp)
    np.testing.assert_allclose(again.candidate_logprobs[:, 0], first.token_logprobs, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(again.candidate_logprobs[:, 1:], first.topk_logprobs, atol=1e-6, rtol=0)


@pytest.mark.integration
def test_bad_candidates_invalid_argument_and_the_server_keeps_serving(tiny_teacher):
    with grpc.insecure_channel(tiny_teacher.target) as ch:
        stub = pb_grpc.TeacherServiceStub(ch)
        bad = pb.ScoreRequest(sequences=[pb.Sequence(id="a", token_ids=[1, 2, 3], score_from=1,
                                                     candidate_ids=[1, 2, 3, VOCAB], num_candidates=2)])
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(bad, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "sequences[0].candidate_ids[3]" in e.value.details()
        too_many = pb.ScoreRequest(sequences=[pb.Sequence(id="a", token_ids=[1, 2], score_from=1,
                                                          candidate_ids=[0] * 65, num_candidates=65)])
        with pytest.raises(grpc.RpcError) as e:
            stub.Score(too_many, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sequences[0].num_candidates" in e.value.details()
        ok = stub.Score(pb.ScoreRequest(sequences=[pb.Sequence(id="a", token_ids=[1, 2, 3], score_from=1,
                                                               candidate_ids=[5, -1, 6, 7], num_candidates=2)]), timeout=30)
        assert ok.results[0].num_candidates == 2 and len(ok.results[0].candidate_logprobs) == 4


@pytest.mark.integration
def test_stream_candidates_sync_and_async_clients(tiny_teacher, ref_model):
    """Candidates through ScoreStream, with the sync and the async client; a bad candidate request
    is answered in band and the requests around it are served."""
    batches = [ScoreBatch(f"r{i}", _inputs(10 + i, 2, 3), top_k=2) for i in range(3)]
    bad = ScoreBatch("bad", [SequenceInput("x", [1, 2, 3], 1, np.array([[1], [VOCAB]]))])
    with TeacherClient(tiny_teacher.target) as c:
        answers = dict(c.score_stream(iter(batches[:1] + [bad] + batches[1:]), on_error="yield"))
    assert isinstance(answers["bad"], RequestFailed) and "sequences[0].candidate_ids[1]" in answers["bad"].details
    for b in batches:
        _check(ref_model, b.sequences, answers[b.request_id])

    async def run():
        async with AsyncTeacherClient(tiny_teacher.target) as c:
            got = {rid: res async for rid, res in c.score_stream(batches, max_in_flight=2)}
            unary = await c.score(batches[0].sequences, top_k=2)
        return got, unary

    got, unary = asyncio.run(run())
    for b in batches:
        _check(ref_model, b.sequences, got[b.request_id])
    _check(ref_model, batches[0].sequences, unary)


# -- property: the validator accepts exactly what the contract allows ------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None, derandomize=True)
@given(n_tokens=st.integers(2, 6), score_from=st.integers(1, 5), m=st.integers(0, 10),
       ids=st.lists(st.integers(-3, 105), max_size=60), pad=st.booleans())
def test_candidate_validation_property(n_tokens, score_from, m, ids, pad):
    score_from = min(score_from, n_tokens - 1)
    n = n_tokens - score_from
    if pad:  # mostly well-sized requests, so the id checks are reached
        ids = (ids * (n * m))[: n * m] if ids else [0] * (n * m)
    req = pb.ScoreRequest(sequences=[pb.Sequence(id="a", token_ids=[1] * n_tokens, score_from=score_from,
                                                 candidate_ids=ids, num_candidates=m)])
    ok = (m == 0 and not ids) or (0 < m <= 8 and len(ids) == n * m and all(-1 <= i < 100 for i in ids))
    try:
        (item,) = items_from_request(req, _info())
    except InvalidRequest as exc:
        assert not ok and "sequences[0]." in str(exc) and ("num_candidates" in str(exc) or "candidate_ids" in str(exc))
    else:
        assert ok
        assert (item.candidate_ids is None) if m == 0 else item.candidate_ids.tolist() == np.reshape(ids, (n, m)).tolist()
