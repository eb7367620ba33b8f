"""Per-position candidates through the pipeline's pure parts (issue 19, eopd_topk_rkl): the
student's top-k from the old-log-prob pass, the request, the ScoredRollout codec, packing."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from eopd.v1 import rollout_pb2 as pb
from eopd_common.models import load_causal_lm
from eopd_teacher.types import SequenceScores
from eopd_trainer.batching import pack_rollouts
from eopd_trainer.objective import LossConfig
from eopd_trainer.queue.messages import PoisonMessage, PromptTask, decode_rollout, encode_rollout
from eopd_trainer.queue.rollout_checks import check_rollout_metadata
from eopd_trainer.rollout.requests import Pending, RequestShaper, answer_problems
from eopd_trainer.rollout.samplers.transformers_sampler import sequence_logprobs
from eopd_trainer.config import TeacherConfig
from eopd_trainer.teacher_context import TeacherPrompts
from tests.trainer.test_pipeline_units import make_rollout


def with_candidates(r, m=3, seed=0, vocab=100):
    rng = np.random.default_rng(seed)
    n = r.num_response_tokens
    ids = rng.integers(0, vocab, (n, m)).astype(np.int32)
    ids[0, -1] = -1
    lp = -rng.random((n, m)).astype(np.float32) * 5
    lp[ids < 0] = np.nan
    return dataclasses.replace(r, candidate_ids=ids, candidate_logprobs=lp)


def test_loss_config_asks_for_candidates_only_for_the_topk_rkl_variant():
    assert LossConfig(variant="eopd").num_candidates == 0
    assert LossConfig(variant="eopd_topk_rkl", candidate_k=8).num_candidates == 8


def test_rollout_candidates_round_trip_and_bytes():
    r = with_candidates(make_rollout(n=5, k=4))
    back = decode_rollout(encode_rollout(r), vocab_size=100)
    np.testing.assert_array_equal(back.candidate_ids, r.candidate_ids)
    np.testing.assert_array_equal(back.candidate_logprobs, r.candidate_logprobs)
    plain = make_rollout(n=5, k=4)
    assert decode_rollout(encode_rollout(plain)).candidate_ids is None
    # packed: 4 bytes per log-prob, a 1-2 byte varint per small id, plus a few header bytes
    extra = len(encode_rollout(r)) - len(encode_rollout(plain))
    assert 5 * 3 * 5 <= extra <= 5 * 3 * (4 + 5) + 16


def _without_last_row_on_the_wire(r) -> bytes:
    """A forged entry: the candidates' last row dropped from the encoded message (a `Rollout` itself
    cannot hold candidates of the wrong shape)."""
    msg = pb.ScoredRollout.FromString(encode_rollout(r))
    m = msg.num_candidates
    del msg.candidate_ids[-m:]
    del msg.candidate_logprobs[-m:]
    return msg.SerializeToString()


@pytest.mark.parametrize("mutate, reason", [
    (lambda r: _without_last_row_on_the_wire(r), "candidate_ids has 12 values, expected 15"),
    (lambda r: dataclasses.replace(r, candidate_ids=np.where(r.candidate_ids < 0, -1, 100).astype(np.int32)),
     "candidate_ids outside [-1, 100)"),
    (lambda r: dataclasses.replace(r, candidate_logprobs=np.zeros_like(r.candidate_logprobs)),
     "NaN exactly at -1 filler"),
    (lambda r: dataclasses.replace(r, candidate_logprobs=np.where(r.candidate_ids < 0, np.nan, 3.0).astype(np.float32)),
     "candidate_logprobs outside"),
])
def test_inconsistent_candidates_are_poison(mutate, reason):
    r = mutate(with_candidates(make_rollout(n=5, k=4)))
    data = r if isinstance(r, bytes) else encode_rollout(r)
    with pytest.raises(PoisonMessage, match=reason.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        decode_rollout(data, vocab_size=100)


def test_a_rollout_without_the_candidates_the_variant_needs_is_refused():
    r = make_rollout(n=5, k=4)
    check_rollout_metadata(r, temperature=1.0)
    with pytest.raises(PoisonMessage, match="0 per-position candidates, the loss variant needs loss.candidate_k 3"):
        check_rollout_metadata(r, temperature=1.0, num_candidates=3)
    check_rollout_metadata(with_candidates(r), temperature=1.0, num_candidates=3)


def test_pack_rollouts_carries_candidates_padded_with_filler():
    a = with_candidates(make_rollout("t0-s0", n=3, k=4), m=3)
    b = with_candidates(make_rollout("t1-s0", n=2, k=4, seed=1), m=2, seed=1)
    c = make_rollout("t2-s0", n=2, k=4, seed=2)
    packed = pack_rollouts([a, b, c], pad_id=0)
    x = packed.loss_inputs
    assert x.candidate_ids.shape == (7, 3) and x.candidate_logprobs.shape == (7, 3)
    assert x.candidate_ids[:3].tolist() == a.candidate_ids.tolist()
    assert x.candidate_ids[3:5, 2].tolist() == [-1, -1] and x.candidate_ids[5:].eq(-1).all()
    assert torch.isnan(x.candidate_logprobs[5:]).all()
    assert pack_rollouts([c], pad_id=0).loss_inputs.candidate_ids is None


def test_old_logprob_pass_gives_the_students_topk():
    """The top-k from the old-log-prob pass is the top-k of the model's own logits at the sampling
    temperature (chunked, one pass), and the log-probs are unchanged by asking for it."""
    model = load_causal_lm("tiny-random").model
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7, 8, 9], [10, 11]]
    top: list = []
    lps = sequence_logprobs(model, prompts, responses, temperature=0.7, pad_id=0, chunk_size=3, top_k=5, topk_out=top)
    plain = sequence_logprobs(model, prompts, responses, temperature=0.7, pad_id=0, chunk_size=3)
    for a, b in zip(lps, plain):
        np.testing.assert_array_equal(a, b)
    for p, r, t in zip(prompts, responses, top):
        with torch.no_grad():
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) + len(r) - 1]
        want = logits.topk(5, dim=-1).indices.numpy()
        assert t.shape == (len(r), 5) and t.dtype == np.int32
        np.testing.assert_array_equal(t, want)


def test_request_carries_remapped_candidates_and_the_answer_must_hold_them():
    task = PromptTask(task_seq=3, prompt_index=0, num_samples=1, min_policy_version=0)
    top = np.array([[5, 9], [9, 2]], dtype=np.int32)
    p = Pending("e", task, 0, [1, 2], [9, 4], False, np.zeros(2, np.float32), 0, 0, top)
    teacher = TeacherConfig(token_remap={9: 7})
    (batch,), refused = RequestShaper("w", teacher, None, TeacherPrompts()).shape([p])
    assert refused == []
    (seq,) = batch.sequences
    assert seq.candidate_ids.tolist() == [[5, 7], [7, 2]] and list(seq.token_ids) == [1, 2, 7, 4]
    base = dict(seq_id=p.rollout_id, token_logprobs=np.zeros(2), entropies=np.zeros(2),
                topk_ids=np.zeros((2, 1)), topk_logprobs=np.zeros((2, 1)))
    assert answer_problems([p], [SequenceScores(**base, candidate_logprobs=np.zeros((2, 2)))]) == [None]
    (problem,) = answer_problems([p], [SequenceScores(**base, candidate_logprobs=np.zeros((2, 0)))])
    assert "candidate_logprobs" in problem


def test_worker_refuses_a_teacher_that_serves_too_few_candidates():
    from types import SimpleNamespace

    from eopd_trainer.config import load_config
    from eopd_trainer.rollout.teacher_checks import TeacherIncompatible, check_teacher_limits
    from tests.trainer.test_pipeline_units import TINY

    info = SimpleNamespace(model_name="t", max_context_length=4096, max_top_k=64, max_sequences_per_request=0,
                           vocab_size=49152, max_candidates=8)
    tok = [0] * 100
    check_teacher_limits(info, load_config(TINY, ["loss.variant=eopd_topk_rkl", "loss.candidate_k=8"]), tok)
    check_teacher_limits(info, load_config(TINY, ["loss.candidate_k=64"]), tok)  # eopd asks for none
    with pytest.raises(TeacherIncompatible, match=r"loss.candidate_k \(9, per-position candidates of loss.variant "
                                                   r"eopd_topk_rkl\) exceeds the teacher's max_candidates \(8\)"):
        check_teacher_limits(info, load_config(TINY, ["loss.variant=eopd_topk_rkl", "loss.candidate_k=9"]), tok)


def test_candidate_fields_are_all_set_or_all_none_in_one_place():
    """`Rollout.__post_init__`: candidate_ids and candidate_logprobs come together, both [n, m]."""
    r = with_candidates(make_rollout(n=5, k=4), m=3)
    assert r.num_candidates == 3
    with pytest.raises(ValueError, match="candidate_ids and candidate_logprobs must be given together"):
        dataclasses.replace(r, candidate_logprobs=None)
    with pytest.raises(ValueError, match="candidate_ids and candidate_logprobs must be given together"):
        dataclasses.replace(r, candidate_ids=None)
    with pytest.raises(ValueError, match=r"must both be \[n, m\] with n = 5"):
        dataclasses.replace(r, candidate_logprobs=r.candidate_logprobs[:, :2])
    with pytest.raises(ValueError, match=r"must both be \[n, m\] with n = 5"):
        dataclasses.replace(r, candidate_ids=r.candidate_ids[:4], candidate_logprobs=r.candidate_logprobs[:4])
    assert dataclasses.replace(r, candidate_ids=None, candidate_logprobs=None).num_candidates == 0
