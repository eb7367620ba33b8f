"""The fused hidden-state loss (issue 31, `objective.fused`): gradients computed in the forward chunk
loop must equal the recomputing path's and a plain full-vocabulary autograd reference's."""

from __future__ import annotations

import pytest
import torch

from eopd_trainer.objective import LossConfig, LossInputs, compute_loss_from_hidden

EVERY_VARIANT = ["opd", "eopd", "opd_fkl", "full_fkl", "random_fkl", "entropy_bonus", "advantage_shaping",
                 "kd", "gkd", "grpo", "eopd_topk_rkl"]


def _case(n, vocab, d, k, seed, dtype, clip_active, mask_share=0.25, scale=1.0):
    """Hidden states, lm_head (+ bias) and every input any variant reads. `clip_active`: the old
    log-probs sit 0.6 nats below the student's (ratio ~1.8 > 1 + clip) with positive advantages on
    half the tokens, so the clipped branch is taken there; else ratios ~1 (clip inactive)."""
    g = torch.Generator().manual_seed(seed)
    hidden = scale * torch.randn(n, d, generator=g, dtype=dtype)
    weight = torch.randn(vocab, d, generator=g, dtype=dtype) / d ** 0.5
    bias = 0.1 * torch.randn(vocab, generator=g, dtype=dtype)
    logp = torch.log_softmax(hidden @ weight.t() + bias, -1)
    sampled = torch.randint(0, vocab, (n,), generator=g)
    own = logp.gather(1, sampled[:, None]).squeeze(1)
    old = own - (0.6 if clip_active else 0.0) + 0.01 * torch.randn(n, generator=g, dtype=dtype)
    adv_sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).to(dtype)
    t_lp = old + adv_sign * (0.5 + torch.rand(n, generator=g, dtype=dtype))
    t_ent = 0.8 + torch.randn(n, generator=g, dtype=dtype)
    t_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    t_tlp = torch.log_softmax(torch.randn(n, vocab, generator=g, dtype=dtype), -1)[:, :k]
    t_tlp[1, -1] = -torch.inf  # an absent teacher candidate
    mask = torch.rand(n, generator=g) > mask_share
    mask[0] = True
    cand = torch.randint(-1, vocab, (n, 3), generator=g)
    inputs = LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, candidate_ids=cand,
                        candidate_logprobs=torch.randn(n, 3, generator=g, dtype=dtype) - 4.0,
                        advantages=torch.randn(n, generator=g, dtype=dtype))
    return hidden, weight, bias, inputs


def _run(hidden, weight, bias, inputs, cfg, fused, scale=1.0):
    h, w, b = (t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias))
    loss, metrics = compute_loss_from_hidden(h, w, inputs, bias=b, config=cfg.model_copy(update={"fused_backward": fused}))
    (scale * loss).backward()
    return loss.detach(), metrics, h.grad, w.grad, b.grad


def _reference(hidden, weight, bias, inputs, cfg):
    """Plain autograd over full [N, V] log-softmax: the loss as the paper writes it (eopd family)."""
    h, w, b = (t.detach().clone().requires_grad_(True) for t in (hidden, weight, bias))
    lsm = torch.log_softmax((h @ w.t() + b) / cfg.temperature, -1)
    m = inputs.mask
    logp = lsm.gather(1, inputs.sampled_ids[:, None]).squeeze(1)[m]
    old, adv = inputs.old_logprobs[m], (inputs.teacher_logprobs - inputs.old_logprobs)[m]
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
    per = pg
    if cfg.variant in ("eopd", "full_fkl"):
        sel = inputs.teacher_entropies[m] >= cfg.tau if cfg.variant == "eopd" else torch.ones_like(m[m])
        p = torch.softmax(inputs.teacher_topk_logprobs[m], -1)
        lq = lsm[m].gather(1, inputs.teacher_topk_ids[m])
        fkl = torch.where(p > 0, p * (p.log() - lq), 0.0).sum(-1)
        per = per + cfg.alpha * sel.to(per.dtype) * fkl
    loss = per.mean()
    loss.backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("variant", EVERY_VARIANT)
def test_fused_equals_recomputing_path_every_variant(variant):
    """Values, every metric, and the gradients of hidden, lm_head weight and bias: fused (gradients in
    forward) == recomputing backward, fp64, scattered mask, a last partial chunk, T != 1, a scaled
    upstream gradient."""
    hidden, weight, bias, inputs = _case(n=23, vocab=41, d=6, k=4, seed=EVERY_VARIANT.index(variant),
                                         dtype=torch.float64, clip_active=True)
    cfg = LossConfig(variant=variant, chunk_size=5, temperature=0.8, entropy_coef=0.05, random_fraction=0.4,
                     aggregation="seq-mean-token-mean" if variant == "gkd" else "token-mean")
    if variant == "gkd":
        inputs = inputs.replace(seq_index=torch.arange(23) // 6)
    if variant in ("kd", "gkd"):
        inputs = inputs.replace(old_logprobs=None)
    fused = _run(hidden, weight, bias, inputs, cfg, fused=True, scale=2.5)
    slow = _run(hidden, weight, bias, inputs, cfg, fused=False, scale=2.5)
    torch.testing.assert_close(fused[0], slow[0], atol=1e-12, rtol=0)
    assert fused[1].keys() == slow[1].keys()
    for key in fused[1]:
        assert fused[1][key] == pytest.approx(slow[1][key], abs=1e-10), key
    for a, b in zip(fused[2:], slow[2:]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("variant", ["opd", "eopd", "full_fkl"])
@pytest.mark.parametrize("clip_active", [True, False])
@pytest.mark.parametrize("n,vocab,d,chunk", [(64, 257, 16, 16), (300, 1031, 32, 128)])
def test_fused_matches_full_vocabulary_reference_fp32(variant, clip_active, n, vocab, d, chunk):
    """fp32 at realistic proportions against the naive full-vocabulary autograd: loss to 1e-5,
    gradients to 1e-5 relative to their scale; the clip is really active (or not) where claimed."""
    hidden, weight, bias, inputs = _case(n=n, vocab=vocab, d=d, k=8, seed=n, dtype=torch.float32,
                                         clip_active=clip_active, scale=3.0)
    cfg = LossConfig(variant=variant, chunk_size=chunk, temperature=1.0)
    loss, metrics, *grads = _run(hidden, weight, bias, inputs, cfg, fused=True)
    ref, *ref_grads = _reference(hidden, weight, bias, inputs, cfg)
    torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5 * float(b.abs().max()), rtol=1e-4)
    assert (metrics["clip_frac"] > 0.2) if clip_active else (metrics["clip_frac"] == 0.0)
    if variant == "eopd":
        assert 0.0 < metrics["gate_ratio"] < 1.0 and metrics["fkl_gated_mean"] > 0.0
    assert metrics["student_entropy"] > 0.0 and 0.0 <= metrics["topk_overlap"] <= 1.0


def test_fused_gradcheck_tiny_double():
    """torch.autograd.gradcheck of the whole fused loss w.r.t. hidden, weight and bias (fp64; the
    entropy term differentiated too, so every piece of the closed-form chunk gradient is checked)."""
    hidden, weight, bias, inputs = _case(n=7, vocab=11, d=3, k=3, seed=1, dtype=torch.float64, clip_active=False)
    for variant in ("eopd", "entropy_bonus", "eopd_topk_rkl"):
        cfg = LossConfig(variant=variant, chunk_size=3, temperature=0.9, entropy_coef=0.3, tau=0.5)

        def f(h, w, b):
            return compute_loss_from_hidden(h, w, inputs, bias=b, config=cfg)[0]

        args = tuple(t.clone().requires_grad_(True) for t in (hidden, weight, bias))
        assert torch.autograd.gradcheck(f, args, fast_mode=True), variant


def test_fused_edge_cases():
    """No valid token: an exact 0 with zero gradients; a frozen lm_head gets no gradient; under
    no_grad the loss and metrics still come out; a second backward through the graph works."""
    hidden, weight, bias, inputs = _case(n=9, vocab=13, d=4, k=3, seed=2, dtype=torch.float64, clip_active=True)
    cfg = LossConfig(variant="eopd", chunk_size=4)
    h = hidden.clone().requires_grad_(True)
    loss, _ = compute_loss_from_hidden(h, weight, inputs.replace(mask=torch.zeros(9, dtype=torch.bool)), config=cfg)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(h.grad, torch.zeros_like(h))

    h = hidden.clone().requires_grad_(True)
    loss, _ = compute_loss_from_hidden(h, weight, inputs, bias=bias, config=cfg)  # frozen weight and bias
    g1 = torch.autograd.grad(loss, h, retain_graph=True)[0]
    g2 = torch.autograd.grad(3.0 * loss, h, retain_graph=True)[0]
    torch.testing.assert_close(g2, 3.0 * g1, atol=1e-12, rtol=0)
    g0 = torch.autograd.grad(0.0 * loss, h, retain_graph=True)[0]  # zero upstream gradient: zeros, no harm
    g3 = torch.autograd.grad(loss, h)[0]
    assert not g0.any()
    torch.testing.assert_close(g3, g1, atol=1e-12, rtol=0)

    with torch.no_grad():
        loss_ng, metrics = compute_loss_from_hidden(hidden, weight, inputs, bias=bias, config=cfg)
    assert loss_ng.item() == pytest.approx(loss.item(), abs=1e-12) and metrics["loss"] == pytest.approx(loss.item())
