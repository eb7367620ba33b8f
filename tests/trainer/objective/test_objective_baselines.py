"""The paper's KD, GKD and GRPO baselines (app. A, sec. 5.5) against a plain fp64 reference written
here with explicit loops, in every input form (logits / hidden states, flat / batched), both
aggregations, with masks; `group_advantages` against hand-computed values and TRL's formula; the
errors that name a missing or bad argument."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from eopd_trainer.objective import (
    METRIC_KEYS,
    VARIANTS,
    LossConfig,
    LossInputs,
    Variant,
    compute_loss,
    compute_loss_from_hidden,
    group_advantages,
    register_variant,
)
from eopd_trainer.objective.variants import everywhere

ATOL = 1e-9
B, T, V, D, K = 4, 5, 23, 6, 5
NAN = float("nan")


# --------------------------------------------------------------------------------------------
# The reference: full [N, V] log-softmax in fp64, one token at a time.
# --------------------------------------------------------------------------------------------
def _fkl(logp_row, ids, tlp):
    """sum over the finite top-k entries of p~ (log p~ - log pi_theta), p~ renormalised over them."""
    finite = [j for j in range(len(ids)) if math.isfinite(float(tlp[j]))]
    if not finite:
        return logp_row.new_zeros(())
    lse = torch.logsumexp(torch.stack([tlp[j] for j in finite]), 0)
    out = logp_row.new_zeros(())
    for j in finite:
        log_p = tlp[j] - lse
        out = out + log_p.exp() * (log_p - logp_row[ids[j]])
    return out


def reference(logits, sampled, old, adv, t_ids, t_tlp, mask, seq, cfg: LossConfig):
    """The loss of cfg.variant from [N, V] logits (fp64), per the paper / the issue:
    kd: ce_weight * -log pi(x) + kl_weight * FKL; gkd: FKL; grpo: PPO clip with the given A."""
    logp_all = torch.log_softmax(logits.double() / cfg.temperature, dim=-1)
    per, seq_of = [], []
    for t in range(logits.shape[0]):
        if not bool(mask[t]):
            continue
        row = logp_all[t]
        if cfg.variant == "kd":
            term = cfg.ce_weight * -row[sampled[t]] + cfg.kl_weight * _fkl(row, t_ids[t], t_tlp[t])
        elif cfg.variant == "gkd":
            term = _fkl(row, t_ids[t], t_tlp[t])
        elif cfg.variant == "grpo":
            r = torch.exp(row[sampled[t]] - old[t])
            a = adv[t]
            term = torch.maximum(-r * a, -r.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * a)
        else:
            raise AssertionError(cfg.variant)
        per.append(term)
        seq_of.append(int(seq[t]))
    if cfg.aggregation == "token-mean":
        return torch.stack(per).sum() / len(per)
    if cfg.aggregation == "token-sum":
        return torch.stack(per).sum() / cfg.sum_divisor
    means = []
    for s in sorted(set(seq_of)):
        terms = [p for p, q in zip(per, seq_of) if q == s]
        means.append(torch.stack(terms).sum() / len(terms))
    return torch.stack(means).sum() / len(means)


def make_inputs(seed):
    """Flat [N = B * T] inputs, a mask with holes (whole sequence 2 partly masked), garbage at masked
    positions (-100 ids, NaN) that must never be read, -inf teacher top-k entries."""
    g = torch.Generator().manual_seed(seed)
    n = B * T
    hidden = torch.randn(n, D, generator=g, dtype=torch.float64)
    weight = torch.randn(V, D, generator=g, dtype=torch.float64)
    logits = hidden @ weight.t()
    sampled = torch.randint(0, V, (n,), generator=g)
    old = (torch.log_softmax(logits, -1).gather(1, sampled[:, None]).squeeze(1)
           + 0.4 * torch.randn(n, generator=g, dtype=torch.float64))  # ratios on both sides of the clip
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    t_lp = torch.randn(n, generator=g, dtype=torch.float64) - 2.0
    t_ent = torch.rand(n, generator=g, dtype=torch.float64) * 2.0
    t_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(n)])
    t_tlp = torch.log_softmax(torch.randn(n, V, generator=g, dtype=torch.float64), -1)[:, :K].clone()
    t_tlp[3, 1:] = -torch.inf  # k = 1 effectively
    t_tlp[7, -1] = -torch.inf
    mask = torch.rand(n, generator=g) > 0.3
    mask[0] = True
    mask[2 * T:3 * T - 1] = False  # sequence 2 keeps one token
    for x in (old, adv, t_lp, t_ent):
        x[~mask] = NAN
    sampled[~mask] = -100
    t_ids[~mask] = -100
    t_tlp[~mask] = NAN
    seq = torch.arange(n) // T
    return dict(hidden=hidden, weight=weight, logits=logits, sampled=sampled, old=old, adv=adv, t_lp=t_lp,
                t_ent=t_ent, t_ids=t_ids, t_tlp=t_tlp, mask=mask, seq=seq)


def run(form, x, cfg, *, old=True, teacher=True):
    """The loss and the gradient w.r.t. its differentiable source (logits, or hidden and weight)."""
    flat = form.endswith("flat")
    shape = (lambda t: t) if flat else (lambda t: None if t is None else t.reshape(B, T, *t.shape[1:]))
    args = [shape(x["sampled"]), shape(x["old"]) if old else None]
    if teacher:
        args += [shape(x["t_lp"]), shape(x["t_ent"]), shape(x["t_ids"]), shape(x["t_tlp"])]
    else:
        args += [None, None, None, None]
    kw = dict(seq_index=x["seq"] if flat else None, advantages=shape(x["adv"]))
    if form.startswith("logits"):
        z = shape(x["logits"]).clone().requires_grad_(True)
        loss, metrics = compute_loss(z, LossInputs(*args, shape(x["mask"]), **kw), cfg)
        return loss, metrics, torch.autograd.grad(loss, [z])
    h = shape(x["hidden"]).clone().requires_grad_(True)
    w = x["weight"].clone().requires_grad_(True)
    loss, metrics = compute_loss_from_hidden(h, w, LossInputs(*args, shape(x["mask"]), **kw), config=cfg)
    return loss, metrics, torch.autograd.grad(loss, [h, w])


def reference_and_grads(form, x, cfg):
    flat = form.endswith("flat")
    if form.startswith("logits"):
        z = x["logits"].clone().requires_grad_(True)
        ref = reference(z, x["sampled"], x["old"], x["adv"], x["t_ids"], x["t_tlp"], x["mask"], x["seq"], cfg)
        (g,) = torch.autograd.grad(ref, [z])
        return ref, [g if flat else g.reshape(B, T, V)]
    h = x["hidden"].clone().requires_grad_(True)
    w = x["weight"].clone().requires_grad_(True)
    ref = reference(h @ w.t(), x["sampled"], x["old"], x["adv"], x["t_ids"], x["t_tlp"], x["mask"], x["seq"], cfg)
    gh, gw = torch.autograd.grad(ref, [h, w])
    return ref, [gh if flat else gh.reshape(B, T, D), gw]


FORMS = ["logits-flat", "logits-batched", "hidden-flat", "hidden-batched"]
AGGS = ["token-mean", "seq-mean-token-mean", "token-sum"]
CONFIGS = {
    "kd": dict(ce_weight=0.3, kl_weight=0.9),
    "gkd": dict(gkd_lambda=0.8),
    "grpo": dict(clip_low=0.15, clip_high=0.25),
}


# --------------------------------------------------------------------------------------------
# Values and gradients against the reference.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", AGGS)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("variant", ["kd", "gkd", "grpo"])
def test_matches_fp64_reference(variant, form, aggregation):
    x = make_inputs(seed=["kd", "gkd", "grpo"].index(variant))
    cfg = LossConfig(variant=variant, aggregation=aggregation, chunk_size=3, temperature=0.8, **CONFIGS[variant])
    # kd / gkd take no old log-probs; grpo takes no teacher scores
    loss, metrics, grads = run(form, x, cfg, old=variant == "grpo", teacher=variant != "grpo")
    ref, ref_grads = reference_and_grads(form, x, cfg)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    for g, g_ref in zip(grads, ref_grads):
        torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    assert metrics["loss"] == pytest.approx(ref.item(), abs=ATOL)
    assert all(math.isfinite(v) for v in metrics.values())
    valid = x["mask"]
    logp = torch.log_softmax(x["logits"] / 0.8, -1)[valid].gather(1, x["sampled"][valid, None]).squeeze(1)
    assert metrics["ce"] == pytest.approx(-logp.mean().item(), abs=ATOL)
    assert metrics["n_tokens"] == int(valid.sum())


def test_default_defaults_are_the_papers():
    cfg = LossConfig()
    assert (cfg.ce_weight, cfg.kl_weight, cfg.gkd_lambda, cfg.grpo_eps) == (0.5, 0.5, 0.5, 1e-4)
    assert cfg.alpha == 1.0  # untouched: kd has its own weights


def test_kd_is_ce_plus_fkl_terms():
    """kd = ce_weight * ce + kl_weight * FKL: the metrics decompose; ce_weight 0 is gkd scaled by
    kl_weight; kl_weight 0 is the plain CE (sequence-level KD) on the teacher's tokens."""
    x = make_inputs(seed=3)
    args = (x["logits"], LossInputs(x["sampled"], None, x["t_lp"], x["t_ent"], x["t_ids"], x["t_tlp"], x["mask"]))
    kd, m = compute_loss(*args, LossConfig(variant="kd"))
    assert m["loss"] == pytest.approx(m["fkl_loss"] + 0.5 * m["ce"], abs=1e-12)
    assert m["pg_loss"] == 0.0 and m["fkl_ratio"] == 1.0
    gkd, _ = compute_loss(*args, LossConfig(variant="gkd"))
    only_kl, _ = compute_loss(*args, LossConfig(variant="kd", ce_weight=0.0, kl_weight=0.7))
    torch.testing.assert_close(only_kl, 0.7 * gkd, atol=1e-12, rtol=0)
    only_ce, m_ce = compute_loss(*args, LossConfig(variant="kd", ce_weight=1.0, kl_weight=0.0))
    assert only_ce.item() == pytest.approx(m_ce["ce"], abs=1e-12)
    assert m_ce["fkl_loss"] == 0.0


def test_kd_and_gkd_ignore_old_logprobs_and_have_no_ratio_metrics():
    x = make_inputs(seed=4)
    rest = (x["t_lp"], x["t_ent"], x["t_ids"], x["t_tlp"], x["mask"])
    for variant in ("kd", "gkd"):
        cfg = LossConfig(variant=variant)
        a, ma = compute_loss(x["logits"], LossInputs(x["sampled"], None, *rest), cfg)
        b, mb = compute_loss(x["logits"], LossInputs(x["sampled"], x["old"], *rest), cfg)
        assert torch.equal(a, b)
        assert "ratio_mean" not in ma and "clip_frac" not in ma and "advantage_mean" not in ma
        assert "ratio_mean" in mb  # measured when given
        assert {"gate_ratio", "teacher_entropy", "teacher_topk_mass"} <= set(ma)


def test_gkd_equals_opd_fkl():
    """GKD's loss on a batch is the on-policy forward KL: the mixing is the data path's (teacher_share)."""
    x = make_inputs(seed=5)
    args = (x["logits"], LossInputs(x["sampled"], x["old"], x["t_lp"], x["t_ent"], x["t_ids"], x["t_tlp"], x["mask"]))
    a, _ = compute_loss(*args, LossConfig(variant="gkd", gkd_lambda=0.5))
    b, _ = compute_loss(*args, LossConfig(variant="opd_fkl"))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_grpo_never_reads_teacher_scores():
    """Teacher inputs of any content or shape (or None) give the same loss and gradient."""
    x = make_inputs(seed=6)
    cfg = LossConfig(variant="grpo")
    z = x["logits"].clone().requires_grad_(True)
    a, ma = compute_loss(z, LossInputs(x["sampled"], x["old"], None, None, None, None, x["mask"], advantages=x["adv"]), cfg)
    (ga,) = torch.autograd.grad(a, [z])
    junk = torch.full((3, 2), NAN)
    b, _ = compute_loss(z, LossInputs(x["sampled"], x["old"], junk, junk, junk.long(), junk, x["mask"], advantages=x["adv"]), cfg)
    (gb,) = torch.autograd.grad(b, [z])
    assert torch.equal(a, b) and torch.equal(ga, gb)
    assert not {"gate_ratio", "fkl_gated_mean", "teacher_entropy", "teacher_topk_mass", "topk_overlap"} & set(ma)
    assert ma["advantage_mean"] == pytest.approx(x["adv"][x["mask"]].mean().item(), abs=1e-12)
    assert 0 < ma["clip_frac"] < 1
    assert set(METRIC_KEYS) - set(ma) == {"gate_ratio", "fkl_gated_mean", "teacher_entropy", "teacher_topk_mass"}


def test_grpo_advantages_are_detached():
    x = make_inputs(seed=7)
    adv = x["adv"].clone().requires_grad_(True)
    z = x["logits"].clone().requires_grad_(True)
    loss, _ = compute_loss(z, LossInputs(x["sampled"], x["old"], None, None, None, None, x["mask"], advantages=adv), LossConfig(variant="grpo"))
    g_z, g_adv = torch.autograd.grad(loss, [z, adv], allow_unused=True)
    assert g_adv is None and g_z.abs().sum() > 0


def test_teacher_share_and_flags():
    assert LossConfig(variant="kd").teacher_share == 1.0
    for lam in (0.5, 0.8, 1.0):
        assert LossConfig(variant="gkd", gkd_lambda=lam).teacher_share == pytest.approx(1.0 - lam)
    for v in ("opd", "eopd", "grpo", "opd_fkl"):
        assert LossConfig(variant=v).teacher_share == 0.0
    assert not LossConfig(variant="grpo").needs_teacher_scores
    assert LossConfig(variant="kd").needs_teacher_scores and LossConfig(variant="gkd").needs_teacher_scores
    assert VARIANTS["grpo"].advantages_from == "given" and VARIANTS["eopd"].advantages_from == "teacher"
    assert VARIANTS["kd"].ce_coef(LossConfig(ce_weight=0.25)) == 0.25
    assert VARIANTS["eopd"].ce_coef(LossConfig()) == 0.0


# --------------------------------------------------------------------------------------------
# Errors naming the argument.
# --------------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    x = make_inputs(seed=8)
    z, s, old, mask = x["logits"], x["sampled"], x["old"], x["mask"]
    grpo = LossConfig(variant="grpo")
    with pytest.raises(ValueError, match="loss variant 'grpo' needs advantages"):
        compute_loss(z, LossInputs(s, old, None, None, None, None, mask), grpo)
    with pytest.raises(ValueError, match="loss variant 'grpo' needs advantages"):
        compute_loss_from_hidden(x["hidden"], x["weight"], LossInputs(s, old, None, None, None, None, mask), config=grpo)
    with pytest.raises(ValueError, match=r"advantages must have shape \(20,\)"):
        compute_loss(z, LossInputs(s, old, None, None, None, None, mask, advantages=x["adv"][:5]), grpo)
    bad = x["adv"].clone()
    bad[0] = torch.inf
    with pytest.raises(ValueError, match=r"advantages has 1 non-finite value\(s\)"):
        compute_loss(z, LossInputs(s, old, None, None, None, None, mask, advantages=bad), grpo)
    with pytest.raises(ValueError, match="loss variant 'grpo' needs old_logprobs"):
        compute_loss(z, LossInputs(s, None, None, None, None, None, mask, advantages=x["adv"]), grpo)
    with pytest.raises(ValueError, match="loss variant 'opd' needs old_logprobs"):
        compute_loss(z, LossInputs(s, None, x["t_lp"], x["t_ent"], x["t_ids"], x["t_tlp"], mask), LossConfig(variant="opd"))
    with pytest.raises(ValueError, match="loss variant 'kd' needs the teacher's scores: teacher_topk_ids, "
                                         "teacher_topk_logprobs missing"):
        compute_loss(z, LossInputs(s, None, x["t_lp"], x["t_ent"], None, None, mask), LossConfig(variant="kd"))
    with pytest.raises(ValueError, match="needs the teacher's scores: teacher_logprobs, teacher_entropies, "
                                         "teacher_topk_ids, teacher_topk_logprobs missing"):
        compute_loss(z, LossInputs(s, old, None, None, None, None, mask), LossConfig(variant="eopd"))
    # other variants ignore `advantages`
    toks = (s, old, x["t_lp"], x["t_ent"], x["t_ids"], x["t_tlp"], mask)
    eopd = LossConfig(variant="eopd")
    assert torch.equal(compute_loss(z, LossInputs(*toks), eopd)[0],
                       compute_loss(z, LossInputs(*toks, advantages=torch.zeros(3)), eopd)[0])


@pytest.mark.parametrize("bad", [{"ce_weight": -0.1}, {"kl_weight": -1.0}, {"gkd_lambda": 1.5},
                                 {"gkd_lambda": -0.1}, {"grpo_eps": 0.0}])
def test_config_bounds_name_the_field(bad):
    with pytest.raises(ValidationError, match=next(iter(bad))):
        LossConfig(variant="kd", **bad)


def test_registration_rejects_teacher_free_variants_that_use_the_teacher():
    with pytest.raises(ValueError, match="needs_teacher_scores=False but uses them: fkl_positions"):
        register_variant(Variant("bad_grpo", "x", advantages_from="given", needs_teacher_scores=False,
                                 fkl_positions=everywhere))
    with pytest.raises(ValueError, match="pg with advantages_from='teacher'"):
        register_variant(Variant("bad_opd", "x", needs_teacher_scores=False))
    with pytest.raises(ValueError, match="advantages_from must be"):
        register_variant(Variant("bad_adv", "x", advantages_from="reward"))
    v = register_variant(Variant("ce_only_test", "x", pg=False, ce_coef=lambda cfg: 1.0))  # a CE-only term is a term
    try:
        assert LossConfig(variant="ce_only_test").variant == "ce_only_test"
    finally:
        VARIANTS.pop(v.name)
    assert not {"bad_grpo", "bad_opd", "bad_adv"} & set(VARIANTS)


def test_no_valid_token_gives_a_graph_attached_zero():
    x = make_inputs(seed=9)
    none = torch.zeros_like(x["mask"])
    z = x["logits"].clone().requires_grad_(True)
    for cfg, old, teacher in ((LossConfig(variant="kd"), None, True), (LossConfig(variant="grpo"), x["old"], False)):
        t = (x["t_lp"], x["t_ent"], x["t_ids"], x["t_tlp"]) if teacher else (None,) * 4
        loss, m = compute_loss(z, LossInputs(x["sampled"], old, *t, none, advantages=x["adv"]), cfg)
        (g,) = torch.autograd.grad(loss, [z])
        assert loss.item() == 0.0 and torch.count_nonzero(g) == 0 and m["n_tokens"] == 0


# --------------------------------------------------------------------------------------------
# group_advantages.
# --------------------------------------------------------------------------------------------
def test_group_advantages_by_hand():
    # group 7: rewards 1, 0, 1 -> mean 2/3, sample std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    # group 3: 0.5 alone -> 0; group 1: 2, 2 -> equal -> 0; group 4: 0, 1 -> mean .5, std sqrt(.5)
    r = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.5, 0.0, 2.0, 1.0])
    gid = torch.tensor([7, 7, 1, 7, 3, 4, 1, 4])
    eps = 1e-4
    s3, s2 = math.sqrt(1 / 3), math.sqrt(0.5)
    expected = torch.tensor([(1 / 3) / (s3 + eps), (-2 / 3) / (s3 + eps), 0.0, (1 / 3) / (s3 + eps), 0.0,
                             -0.5 / (s2 + eps), 0.0, 0.5 / (s2 + eps)])
    out = group_advantages(r, gid, eps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)


def test_group_advantages_match_trls_formula():
    """TRL GRPOTrainer (scale_rewards="group"): contiguous groups of G, `rewards.view(-1, G).std(dim=1)`
    (Bessel-corrected), `(r - mean) / (std + 1e-4)`; the same for any order of the group ids."""
    g = torch.Generator().manual_seed(0)
    n_groups, size = 6, 8
    rewards = torch.randint(0, 3, (n_groups * size,), generator=g).double() / 2
    rewards[:size] = 1.0  # an all-equal group: TRL gives 0 / (0 + eps) = 0 too
    grouped = rewards.view(-1, size)
    trl = (rewards - grouped.mean(dim=1).repeat_interleave(size)) / (grouped.std(dim=1).repeat_interleave(size) + 1e-4)
    gid = torch.arange(n_groups).repeat_interleave(size)
    out = group_advantages(rewards, gid, 1e-4)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, trl, atol=1e-12, rtol=0)
    perm = torch.randperm(rewards.numel(), generator=g)
    torch.testing.assert_close(group_advantages(rewards[perm], gid[perm] * 10 + 3, 1e-4), trl[perm], atol=1e-12, rtol=0)


def test_group_advantages_edge_cases_and_errors():
    assert group_advantages(torch.zeros(0), torch.zeros(0, dtype=torch.long), 1e-4).shape == (0,)
    assert torch.equal(group_advantages(torch.tensor([0.3, 5.0]), torch.tensor([0, 1]), 1e-4), torch.zeros(2))
    third = torch.tensor([0.1, 0.1, 0.1], dtype=torch.float64)  # mean rounds off 0.1: still exactly 0
    assert torch.equal(group_advantages(third, torch.zeros(3, dtype=torch.long), 1e-4), torch.zeros(3, dtype=torch.float64))
    assert group_advantages(torch.tensor([1, 0]), torch.tensor([0, 0]), 1e-4).dtype == torch.float32
    with pytest.raises(ValueError, match=r"rewards must have shape \[B\]"):
        group_advantages(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long), 1e-4)
    with pytest.raises(ValueError, match=r"group_ids must have shape \(3,\)"):
        group_advantages(torch.zeros(3), torch.zeros(2, dtype=torch.long), 1e-4)
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        group_advantages(torch.zeros(3), torch.zeros(3), 1e-4)
    with pytest.raises(ValueError, match="eps must be > 0"):
        group_advantages(torch.zeros(3), torch.zeros(3, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match=r"rewards has 1 non-finite value\(s\)"):
        group_advantages(torch.tensor([0.0, NAN]), torch.zeros(2, dtype=torch.long), 1e-4)
