"""`eopd_topk_rkl` (issue 19): the reverse KL exactly over the student's top-k (teacher log-probs
from per-position candidates) + EOPD's gated forward KL, against a plain fp64 reference."""

from __future__ import annotations

import pytest
import torch

from eopd_trainer.objective import LossConfig, LossInputs, compute_loss, compute_loss_from_hidden

from tests.trainer.objective.test_objective import ATOL, grads_of, make_inputs, reference_loss

M = 6


def candidates_for(logits, t_full_logp, m=M, seed=0):
    """The behaviour policy's top-m ids (here: of slightly perturbed logits, as pi_old != pi_theta),
    some replaced by -1 filler, and the teacher's full-vocabulary log-probs there (NaN at filler)."""
    g = torch.Generator().manual_seed(seed)
    old_logits = logits.detach() + 0.3 * torch.randn(logits.shape, generator=g, dtype=logits.dtype)
    ids = old_logits.topk(m, dim=-1).indices
    ids[torch.rand(ids.shape, generator=g) < 0.15] = -1
    lp = t_full_logp.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, float("nan"))
    return ids, lp


def reference_topk_rkl(logits, t_ids_c, t_lp_c, t_ent, t_ids, t_tlp, mask, cfg, seq_index=None):
    """Written out: per valid token, sum over non-filler candidates of q (log q - log p_te) with q the
    student's full-vocabulary softmax, plus the tail outcome q_tail (log q_tail - log p_tail) with
    q_tail = 1 - sum q, p_tail = 1 - sum p_te over them, + alpha * 1[H >= tau] * FKL (the
    reference's FKL, pg off)."""
    valid = mask.bool()
    logp_all = torch.log_softmax(logits / cfg.temperature, dim=-1)
    real = t_ids_c >= 0
    lq = logp_all.gather(1, t_ids_c.clamp(min=0))
    rkl = torch.where(real, lq.exp() * (lq - torch.where(real, t_lp_c, 0.0)), 0.0).sum(-1)
    # the mass outside the candidates is one more outcome on both sides (the tail bucket, issue 48)
    q_tail = 1 - torch.where(real, lq.exp(), 0.0).sum(-1)
    p_tail = 1 - torch.where(real, torch.where(real, t_lp_c, 0.0).exp(), 0.0).sum(-1)
    rkl = rkl + q_tail * (q_tail.log() - p_tail.log())
    fkl_cfg = LossConfig(**{**cfg.model_dump(), "variant": "eopd", "clip_low": 0.0, "clip_high": 0.0})
    # eopd's reference = pg + alpha*gate*fkl; take pg out with zero advantages (t_lp = old)
    zeros = torch.zeros_like(t_ent)
    sampled = torch.zeros(logits.shape[0], dtype=torch.long)
    eopd_no_pg = reference_loss(logits, sampled, zeros, zeros, t_ent, t_ids, t_tlp, mask, fkl_cfg, seq_index)
    per = torch.where(valid, rkl, 0.0)
    if cfg.aggregation == "token-mean":
        return per.sum() / valid.sum() + eopd_no_pg
    seq_means = [per[valid & (seq_index == s)].sum() / (valid & (seq_index == s)).sum()
                 for s in torch.unique(seq_index[valid])]
    return torch.stack(seq_means).mean() + eopd_no_pg


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_topk_rkl_matches_fp64_reference(aggregation):
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq = make_inputs(n=17, vocab=41, seed=5)
    t_full = torch.log_softmax(torch.randn(17, 41, generator=torch.Generator().manual_seed(9), dtype=torch.float64), -1)
    c_ids, c_lp = candidates_for(logits, t_full)
    cfg = LossConfig(variant="eopd_topk_rkl", aggregation=aggregation, chunk_size=4, temperature=0.7, alpha=0.5)
    loss, metrics = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq_index=seq, candidate_ids=c_ids, candidate_logprobs=c_lp), cfg)
    ref = reference_topk_rkl(logits, c_ids, c_lp, t_ent, t_ids, t_tlp, mask, cfg, seq_index=seq)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    (g,), (g_ref,) = grads_of(loss, logits), grads_of(ref, logits)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    assert metrics["pg_loss"] == 0.0
    assert metrics["loss"] == pytest.approx(metrics["topk_rkl_loss"] + metrics["fkl_loss"], abs=1e-12)
    assert 0 < metrics["student_candidate_mass"] <= 1


def test_full_vocabulary_candidates_give_the_exact_reverse_kl():
    """With every vocabulary id as a candidate the term is the exact KL(q || p_te) (alpha = 0)."""
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=9, vocab=23, seed=2)
    t_full = torch.log_softmax(torch.randn(9, 23, generator=torch.Generator().manual_seed(4), dtype=torch.float64), -1)
    c_ids = torch.arange(23).repeat(9, 1)
    cfg = LossConfig(variant="eopd_topk_rkl", alpha=0.0)
    loss, _ = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=c_ids, candidate_logprobs=t_full), cfg)
    q = torch.log_softmax(logits, -1)
    kl = (q.exp() * (q - t_full)).sum(-1)
    torch.testing.assert_close(loss, kl[mask].mean(), atol=1e-12, rtol=0)


def test_hidden_path_matches_logits_path():
    g = torch.Generator().manual_seed(1)
    n, d, v = 15, 8, 29
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, generator=g, dtype=torch.float64, requires_grad=True)
    _, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=n, vocab=v, seed=3)
    logits = hidden @ weight.t()
    c_ids, c_lp = candidates_for(logits, torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64), -1))
    cfg = LossConfig(variant="eopd_topk_rkl", chunk_size=4)
    a, _ = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=c_ids, candidate_logprobs=c_lp), cfg)
    b, _ = compute_loss_from_hidden(hidden, weight, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=c_ids, candidate_logprobs=c_lp), config=cfg)
    torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    ga, gb = grads_of(a, hidden, weight), grads_of(b, hidden, weight)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=0)


def test_missing_or_bad_candidates_are_named():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=5, vocab=11)
    cfg = LossConfig(variant="eopd_topk_rkl")
    with pytest.raises(ValueError, match="needs candidate_ids and candidate_logprobs"):
        compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), cfg)
    bad = torch.full((5, 2), 11)
    with pytest.raises(ValueError, match=rf"candidate_ids has {int(mask.sum()) * 2} id\(s\) out of range \[0, 11\)"):
        compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=bad, candidate_logprobs=torch.zeros(5, 2, dtype=torch.float64)), cfg)
    with pytest.raises(ValueError, match="candidate_logprobs must have shape"):
        compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=torch.zeros(5, 2, dtype=torch.long), candidate_logprobs=torch.zeros(4, 2)), cfg)
    # other variants ignore candidates
    a, _ = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), LossConfig(variant="eopd"))
    b, _ = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=torch.zeros(5, 2, dtype=torch.long), candidate_logprobs=torch.zeros(5, 2)), LossConfig(variant="eopd"))
    assert torch.equal(a, b)
