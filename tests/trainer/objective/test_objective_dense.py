"""`objective/dense.py`: TRL's generalized JSD over a named support (tail bucket for a partial one,
chunked for the full vocabulary), against plain fp64 references written here from probabilities."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from eopd_trainer.objective.dense import (
    full_vocab_divergence,
    generalized_jsd,
    log_tail,
    support_divergence,
)

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def naive_jsd(q: torch.Tensor, p: torch.Tensor, beta: float) -> torch.Tensor:
    """Written from probabilities (rows of q = student, p = teacher, fp64): TRL's definition."""
    def kl(a, b):
        a_, b_ = a.clamp_min(1e-300), b.clamp_min(1e-300)  # no NaN gradient through the zero entries
        return torch.where(a > 0, a * (a_.log() - b_.log()), 0.0).sum(-1)
    if beta == 0.0:
        return kl(p, q)
    if beta == 1.0:
        return kl(q, p)
    m = beta * p + (1 - beta) * q
    return beta * kl(p, m) + (1 - beta) * kl(q, m)


def logits_pair(n=7, v=23, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    s = (scale * torch.randn(n, v, generator=g, dtype=torch.float64)).requires_grad_()
    t = scale * torch.randn(n, v, generator=g, dtype=torch.float64)
    return s, t


@pytest.mark.parametrize("beta", BETAS)
def test_full_vocab_matches_naive_value_and_gradient(beta):
    s, t = logits_pair()
    got = full_vocab_divergence(s, t, beta, chunk_size=3, temperature=0.7)
    ref = naive_jsd(torch.softmax(s / 0.7, -1), torch.softmax(t, -1), beta)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(got.sum(), s)
    (g_ref,) = torch.autograd.grad(ref.sum(), s)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("teacher", ["tensor", "rows"])
def test_written_out_gradients_of_both_kl_directions(beta, teacher):
    """Beta 0 and 1 with a constant teacher take the student's gradient written out by hand
    (dense._DenseKL): the same values and gradients as the autograd path, checked against finite
    differences too, with ids the teacher masks (-inf) and a teacher given as a row function."""
    s, t = logits_pair(n=5, v=9, seed=2)
    if beta == 0.0:  # zero teacher mass adds nothing to the forward KL (the reverse KL would be infinite)
        t[:, :3] = -torch.inf
        t[1, 5] = -torch.inf
    else:  # an id the student masks: zero student mass adds nothing to the reverse KL
        s = s.detach().clone()
        s[2, 4] = -torch.inf
        s.requires_grad_(True)
    src = t if teacher == "tensor" else (lambda a, b: t[a:b])
    got = full_vocab_divergence(s, src, beta, chunk_size=3, temperature=0.7, teacher_requires_grad=False)
    ref = full_vocab_divergence(s, t, beta, chunk_size=3, temperature=0.7)  # the checkpointed autograd path
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(got.sum(), s)
    (g_ref,) = torch.autograd.grad(ref.sum(), s)
    torch.testing.assert_close(g, g_ref, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda a: full_vocab_divergence(a, src, beta, chunk_size=3, temperature=0.7,
                                                                    teacher_requires_grad=False), (s,), atol=1e-8)


def test_full_vocab_from_row_functions_equals_tensors():
    """The student's logits from hidden states and the teacher's built per chunk (never [N, V])."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 5, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(31, 5, generator=g, dtype=torch.float64, requires_grad=True)
    t_hidden, t_weight = torch.randn(9, 6, generator=g, dtype=torch.float64), torch.randn(31, 6, generator=g,
                                                                                           dtype=torch.float64)
    calls = []

    def teacher(a, b):
        calls.append((a, b))
        return t_hidden[a:b] @ t_weight.T

    got = full_vocab_divergence(lambda a, b: hidden[a:b] @ weight.T, teacher, 0.5, num_rows=9, chunk_size=4)
    ref = full_vocab_divergence(hidden @ weight.T, t_hidden @ t_weight.T, 0.5, chunk_size=9)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    assert max(b - a for a, b in calls) <= 4
    g1 = torch.autograd.grad(got.sum(), (hidden, weight))
    g2 = torch.autograd.grad(ref.sum(), (hidden, weight))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


def test_full_vocab_masked_teacher_ids_and_errors():
    s, t = logits_pair(n=4, v=10)
    t = t.clone()
    t[:, -3:] = -torch.inf  # a padded vocabulary the teacher masks
    for beta in (0.0, 0.5):  # finite: the teacher puts no mass where it is -inf
        got = full_vocab_divergence(s, t, beta)
        ref = naive_jsd(torch.softmax(s, -1), torch.softmax(t, -1), beta)
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
        (g,) = torch.autograd.grad(got.sum(), s)
        assert torch.isfinite(g).all()
    with pytest.raises(ValueError, match="beta"):
        full_vocab_divergence(s, t, 1.5)
    with pytest.raises(ValueError, match="teacher_logits"):
        full_vocab_divergence(s, t[:3], 0.0)
    with pytest.raises(ValueError, match="num_rows"):
        full_vocab_divergence(lambda a, b: s[a:b], lambda a, b: t[a:b], 0.0)


def naive_support(s_full_logp, t_full_logp, ids, valid, beta):
    """The k support outcomes plus one tail outcome, from probabilities (fp64)."""
    q = s_full_logp.exp().gather(1, ids) * valid
    p = t_full_logp.exp().gather(1, ids) * valid
    q_all = torch.cat([q, (1 - q.sum(-1, keepdim=True))], -1)
    p_all = torch.cat([p, (1 - p.sum(-1, keepdim=True))], -1)
    return naive_jsd(q_all, p_all, beta)


@pytest.mark.parametrize("beta", BETAS)
def test_support_divergence_matches_naive_tail_bucket(beta):
    s, t = logits_pair(n=8, v=30, seed=1)
    ls, lt = torch.log_softmax(s, -1), torch.log_softmax(t, -1)
    ids = torch.stack([torch.randperm(30, generator=torch.Generator().manual_seed(i))[:6] for i in range(8)])
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[0, 3:] = False
    valid[1] = False  # a row without a support: 0
    got = support_divergence(ls.gather(1, ids), lt.gather(1, ids), valid, beta)
    ref = naive_support(ls, lt, ids, valid, beta)
    torch.testing.assert_close(got, ref, atol=1e-12, rtol=0)
    assert got[1] == 0
    (g,) = torch.autograd.grad(got.sum(), s, retain_graph=True)
    (g_ref,) = torch.autograd.grad(ref.sum(), s)
    torch.testing.assert_close(g, g_ref, atol=1e-11, rtol=0)


def test_support_covering_the_vocabulary_is_the_full_divergence():
    s, t = logits_pair(n=5, v=12, seed=2)
    lt = torch.log_softmax(t, -1)
    valid = torch.ones(5, 12, dtype=torch.bool)
    for beta in (0.0, 0.5, 1.0):
        ls = torch.log_softmax(s, -1)
        got = support_divergence(ls, lt, valid, beta)
        torch.testing.assert_close(got, full_vocab_divergence(s, t, beta), atol=1e-12, rtol=0)
        (g,) = torch.autograd.grad(got.sum(), s)
        assert torch.isfinite(g).all()


def test_log_tail_is_stable():
    lp = torch.tensor([[-1e-20, -50.0], [-30.0, -31.0], [math.log(0.5), math.log(0.25)]], dtype=torch.float64)
    valid = torch.tensor([[True, False], [True, True], [True, True]])
    got = log_tail(lp, valid)
    # (nearly) all the mass in the support: floored at about log(eps), never -inf or NaN
    assert abs(float(got[0]) - math.log(torch.finfo(torch.float64).eps)) < 1e-6
    torch.testing.assert_close(got[1], torch.log1p(-(torch.exp(lp[1]).sum())), atol=1e-15, rtol=0)
    torch.testing.assert_close(got[2], torch.tensor(math.log(0.25), dtype=torch.float64))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), beta=st.sampled_from(BETAS), k=st.integers(1, 8), scale=st.floats(0.1, 6.0))
def test_support_divergence_is_nonnegative_and_zero_only_at_agreement(seed, beta, k, scale):
    s, t = logits_pair(n=4, v=16, seed=seed, scale=scale)
    ls, lt = torch.log_softmax(s.detach(), -1), torch.log_softmax(t, -1)
    ids = lt.topk(k, -1).indices
    valid = torch.ones_like(ids, dtype=torch.bool)
    d = support_divergence(ls.gather(1, ids), lt.gather(1, ids), valid, beta)
    assert (d >= -1e-12).all()
    same = support_divergence(lt.gather(1, ids), lt.gather(1, ids), valid, beta)
    assert same.abs().max() < 1e-12
    if beta in (0.0, 1.0):  # a KL is 0 only at agreement: differing rows give a positive value
        differs = (ls.gather(1, ids) - lt.gather(1, ids)).abs().max(-1).values > 1e-3
        assert (d[differs] > 0).all()


def test_tail_bucket_reverse_kl_trains_where_the_bare_sum_collapses():
    """A few Adam steps on a student's logits: the reverse KL over the student's own top-k with the
    tail bucket lowers the true full-vocabulary KL(q || p) and keeps the entropy near the teacher's;
    the bare sum `sum_S q (log q - log p)` (eopd_topk_rkl before issue 48) drives the mass off S."""
    g = torch.Generator().manual_seed(0)
    v, k = 200, 8
    t_logp = torch.log_softmax(3.0 * torch.randn(16, v, generator=g, dtype=torch.float64), -1)

    def train(tail: bool):
        s = (t_logp + 0.5 * torch.randn(16, v, generator=g, dtype=torch.float64)).clone().requires_grad_()
        opt = torch.optim.Adam([s], lr=0.05)
        for _ in range(150):
            ls = torch.log_softmax(s, -1)
            ids = ls.detach().topk(k, -1).indices
            a, b = ls.gather(1, ids), t_logp.gather(1, ids)
            valid = torch.ones_like(ids, dtype=torch.bool)
            loss = support_divergence(a, b, valid, 1.0) if tail else (a.exp() * (a - b)).sum(-1)
            opt.zero_grad()
            loss.mean().backward()
            opt.step()
        ls = torch.log_softmax(s.detach(), -1)
        return (ls.exp() * (ls - t_logp)).sum(-1).mean(), -(ls.exp() * ls).sum(-1).mean()

    t_ent = -(t_logp.exp() * t_logp).sum(-1).mean()
    kl_tail, ent_tail = train(True)
    kl_bare, ent_bare = train(False)
    assert kl_tail < 0.05 and abs(ent_tail - t_ent) < 0.5
    assert kl_bare > 5 * kl_tail and ent_bare > t_ent + 1.0


def test_generalized_jsd_rejects_bad_beta():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(x, x, -0.1)


@pytest.mark.parametrize("every_token", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_support_full_from_hidden_states_equals_from_logits(beta, every_token):
    """`loss.support: full` on the learner's fused path (hidden states and the output projection;
    beta 0 and 1 through `dense._DenseKLFromHidden`) gives the loss and gradients of the logits path."""
    from eopd_trainer.objective import LossConfig, LossInputs, compute_loss, compute_loss_from_hidden

    g = torch.Generator().manual_seed(11)
    n, d, v = 9, 6, 17
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64)
    weight, bias = torch.randn(v, d, generator=g, dtype=torch.float64), torch.randn(v, generator=g, dtype=torch.float64)
    teacher = 2.0 * torch.randn(n, v, generator=g, dtype=torch.float64)
    t_logp = torch.log_softmax(teacher, -1)
    sampled = torch.randint(0, v, (n,), generator=g)
    top = t_logp.topk(4, -1)
    mask = torch.ones(n, dtype=torch.bool) if every_token else torch.tensor([1, 1, 0, 1, 0, 1, 1, 1, 0], dtype=torch.bool)
    inputs = LossInputs(sampled, teacher_logprobs=t_logp.gather(-1, sampled[:, None]).squeeze(-1),
                        teacher_entropies=-(t_logp.exp() * t_logp).sum(-1), teacher_topk_ids=top.indices,
                        teacher_topk_logprobs=top.values, mask=mask, teacher_logits=teacher)
    cfg = LossConfig(variant="gkd", gkd_lambda=1.0, gkd_beta=beta, support="full", chunk_size=4, temperature=0.8)
    h, w, b = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    loss_h, _ = compute_loss_from_hidden(h, w, inputs, bias=b, config=cfg)
    grads_h = torch.autograd.grad(loss_h, [h, w, b])
    h2, w2, b2 = (x.clone().requires_grad_(True) for x in (hidden, weight, bias))
    loss_z, _ = compute_loss(h2 @ w2.T + b2, inputs, cfg)
    grads_z = torch.autograd.grad(loss_z, [h2, w2, b2])
    torch.testing.assert_close(loss_h, loss_z, atol=1e-12, rtol=0)
    for a, c in zip(grads_h, grads_z, strict=True):
        torch.testing.assert_close(a, c, atol=1e-12, rtol=0)
