"""The EOPD objective against a plain fp64 reference written here, plus edge cases and metrics."""

from __future__ import annotations

import math
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from eopd_trainer.objective import (
    METRIC_KEYS,
    VARIANTS,
    LossConfig,
    LossInputs,
    Variant,
    VocabPlan,
    aggregation_weights,
    compute_loss,
    compute_loss_from_hidden,
    register_variant,
    step_generator,
    step_seed,
    vocab_stats,
)
from eopd_trainer.objective import loss as loss_module
from eopd_trainer.objective.variants import everywhere

ALL_VARIANTS = ["opd", "eopd", "opd_fkl", "full_fkl", "random_fkl", "entropy_bonus", "advantage_shaping"]
ATOL = 1e-6


# --------------------------------------------------------------------------------------------
# A plain reference: full log-softmax, autograd, every formula written out (paper eq. 7, 9, 11).
# --------------------------------------------------------------------------------------------
def reference_loss(logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, cfg: LossConfig, seq_index=None):
    valid = mask.bool()
    logp_all = torch.log_softmax(logits / cfg.temperature, dim=-1)  # [N, V]
    logp = logp_all.gather(1, sampled.clamp(0, logits.shape[1] - 1)[:, None]).squeeze(1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    adv = t_lp - old
    if cfg.variant == "advantage_shaping":
        adv = adv + torch.minimum(cfg.shaping_alpha * ent.detach(), adv.abs() / cfg.shaping_kappa)
    ratio = torch.exp(logp - old)
    pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
    # FKL over the teacher's renormalised top-k; -inf entries dropped.
    finite = torch.isfinite(t_tlp)
    p_t = torch.softmax(torch.where(finite, t_tlp, -1e30), dim=-1) * finite
    p_t = p_t / p_t.sum(-1, keepdim=True).clamp_min(1e-300)
    lq = logp_all.gather(1, torch.where(finite, t_ids, 0))
    fkl = (torch.special.xlogy(p_t, p_t) - p_t * torch.where(finite, lq, 0.0)).sum(-1)
    gate = (t_ent >= cfg.tau) if cfg.gate == "ge" else (t_ent > cfg.tau)
    v = cfg.variant
    if v in ("opd", "advantage_shaping"):
        per = pg
    elif v == "eopd":
        per = pg + cfg.alpha * gate * fkl
    elif v == "opd_fkl":
        per = fkl
    elif v == "full_fkl":
        per = pg + cfg.alpha * fkl
    elif v == "random_fkl":  # the documented draw: randperm over the valid tokens, in order
        m = int(valid.sum())
        n = int(math.floor(cfg.random_fraction * m + 0.5))
        pick = torch.randperm(m, generator=torch.Generator().manual_seed(cfg.random_seed))[:n]
        sel_valid = torch.zeros(m, dtype=torch.bool)
        sel_valid[pick] = True
        sel = torch.zeros_like(valid)
        sel[valid.nonzero().squeeze(1)] = sel_valid
        per = pg + cfg.alpha * sel * fkl
    elif v == "entropy_bonus":
        per = pg - cfg.entropy_coef * ent
    else:
        raise AssertionError(v)
    per = torch.where(valid, per, 0.0)
    if cfg.aggregation == "token-mean":
        return per.sum() / valid.sum()
    if cfg.aggregation == "token-sum":
        return per.sum() / cfg.sum_divisor
    seq_means = []
    for s in torch.unique(seq_index[valid]):
        in_s = valid & (seq_index == s)
        seq_means.append(per[in_s].sum() / in_s.sum())
    return torch.stack(seq_means).mean()


def make_inputs(n=13, vocab=37, k=5, seed=0, dtype=torch.float64, tau=0.8):
    g = torch.Generator().manual_seed(seed)
    logits = (2.0 * torch.randn(n, vocab, generator=g, dtype=dtype)).requires_grad_(True)
    sampled = torch.randint(0, vocab, (n,), generator=g)
    old = (torch.log_softmax(logits.detach(), -1).gather(1, sampled[:, None]).squeeze(1)
           + 0.3 * torch.randn(n, generator=g, dtype=dtype))
    t_lp = old + torch.randn(n, generator=g, dtype=dtype)
    t_ent = tau + torch.randn(n, generator=g, dtype=dtype)  # about half above tau
    t_ids = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)])
    t_tlp = torch.log_softmax(torch.randn(n, vocab, generator=g, dtype=dtype), -1)[:, :k]
    mask = torch.rand(n, generator=g) > 0.25
    mask[0] = True
    seq_index = torch.arange(n) // 4
    return logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq_index


def grads_of(loss, *tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True, retain_graph=True)


# --------------------------------------------------------------------------------------------
# Every variant against the reference, values and gradients, every aggregation.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "token-sum"])
@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_variant_matches_reference(variant, aggregation):
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq = make_inputs(seed=ALL_VARIANTS.index(variant))
    cfg = LossConfig(variant=variant, aggregation=aggregation, chunk_size=4, temperature=0.7,
                     entropy_coef=0.05, random_fraction=0.3, sum_divisor=3.0)
    loss, metrics = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq_index=seq), cfg)
    ref = reference_loss(logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, cfg, seq_index=seq)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    (g,), (g_ref,) = grads_of(loss, logits), grads_of(ref, logits)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    assert metrics["loss"] == pytest.approx(ref.item(), abs=ATOL)
    terms = metrics["pg_loss"] + metrics["fkl_loss"] + metrics["entropy_loss"]
    assert metrics["loss"] == pytest.approx(terms, abs=1e-12)
    assert set(METRIC_KEYS) <= set(metrics)
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("variant", ["opd", "eopd", "advantage_shaping"])
def test_asymmetric_clip_matches_reference(variant):
    """clip_low != clip_high (DAPO-style clip-higher): each bound is applied on its own side."""
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(seed=11)
    old = old + 0.5 * torch.randn(old.shape, generator=torch.Generator().manual_seed(3), dtype=old.dtype)  # ratios far from 1
    cfg = LossConfig(variant=variant, clip_low=0.05, clip_high=0.4, chunk_size=4)
    loss, metrics = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), cfg)
    ref = reference_loss(logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, cfg)
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    (g,), (g_ref,) = grads_of(loss, logits), grads_of(ref, logits)
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    for swapped in (LossConfig(variant=variant, clip_low=0.4, clip_high=0.05, chunk_size=4),
                    LossConfig(variant=variant, clip_low=0.2, clip_high=0.2, chunk_size=4)):
        other, m2 = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), swapped)
        assert abs(other.item() - loss.item()) > 1e-6  # the bounds really act (inputs reach both sides)
    assert 0 < metrics["clip_frac"] < 1


def test_registry_has_every_paper_variant():
    assert set(ALL_VARIANTS) <= set(VARIANTS)


def test_random_fkl_draw_is_seeded_and_sized():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=40)
    cfg = LossConfig(variant="random_fkl", random_fraction=0.2)
    a, ma = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), cfg)
    b, _ = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), cfg)
    c, _ = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), LossConfig(variant="random_fkl", random_seed=7))
    assert torch.equal(a, b) and not torch.equal(a, c)
    m = int(mask.sum())
    assert ma["fkl_ratio"] == pytest.approx(round(0.2 * m) / m)


def _fkl_positions(cfg, generator, n=40):
    """The random_fkl positions chosen for the inputs of make_inputs(n), through the variant."""
    from eopd_trainer.objective.variants import PositionContext, get_variant

    gate = torch.zeros(n, dtype=torch.bool)
    return get_variant("random_fkl").fkl_positions(PositionContext(gate=gate, config=cfg, generator=generator))


def test_random_fkl_without_generator_repeats_the_draw_for_equal_token_counts():
    """Documented behaviour: no generator -> a function of (random_seed, M) only."""
    cfg = LossConfig(variant="random_fkl", random_fraction=0.3)
    a, _ = compute_loss(make_inputs(n=30, seed=1)[0], LossInputs(*make_inputs(n=30, seed=1)[1:8]), cfg)
    b, _ = compute_loss(make_inputs(n=30, seed=1)[0], LossInputs(*make_inputs(n=30, seed=1)[1:8]), cfg)
    torch.testing.assert_close(a, b)
    # the loss's own draw equals randperm(M) under a generator seeded with random_seed
    logits, *args, seq = make_inputs(n=30, seed=1)
    m = int(args[-1].sum())
    explicit, _ = compute_loss(logits, LossInputs(*args), cfg, generator=torch.Generator().manual_seed(cfg.random_seed))
    torch.testing.assert_close(a, explicit)
    assert m > 10


def test_step_generator_same_keys_same_draws_different_keys_different_draws():
    cfg = LossConfig(variant="random_fkl", random_fraction=0.25)
    base = _fkl_positions(cfg, step_generator(7, 3, 1, 0, 2))
    assert int(base.sum()) == 10
    assert torch.equal(base, _fkl_positions(cfg, step_generator(7, 3, 1, 0, 2)))
    others = [(8, 3, 1, 0, 2), (7, 4, 1, 0, 2), (7, 3, 2, 0, 2), (7, 3, 1, 1, 2), (7, 3, 1, 0, 3), (7, 3, 1, 0),
              (7, 3, 1, 0, 2, 0)]
    draws = [_fkl_positions(cfg, step_generator(*keys)) for keys in others]
    for keys, d in zip(others, draws):
        assert not torch.equal(d, base), keys
    # no collisions between the seeds of nearby key tuples, including "digit-shifted" ones
    seeds = {step_seed(s0, a, b) for s0 in range(3) for a in range(12) for b in range(12)}
    assert len(seeds) == 3 * 12 * 12
    assert step_seed(1, 1, 23) != step_seed(1, 12, 3) and step_seed(0, -1) != step_seed(0, 1)
    assert all(0 <= s < 2**63 for s in seeds)


def test_step_generator_is_stable_across_processes():
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from eopd_trainer.objective.rng import step_seed; "
            "print(step_seed(123, 4, 5, 6))")
    src = str(Path(loss_module.__file__).resolve().parents[2])
    outs = {subprocess.run([sys.executable, "-c", code, src], check=True, capture_output=True, text=True,
                           env={"PYTHONHASHSEED": h, "PATH": ""}).stdout.strip() for h in ("1", "2")}
    assert outs == {str(step_seed(123, 4, 5, 6))}


def test_step_generator_in_compute_loss_changes_the_draw_per_step():
    logits, *args, _ = make_inputs(n=40)
    cfg = LossConfig(variant="random_fkl", random_fraction=0.2)
    losses = [compute_loss(logits, LossInputs(*args), cfg, generator=step_generator(0, 0, step))[0].item() for step in range(4)]
    assert len(set(losses)) == 4
    again = compute_loss(logits, LossInputs(*args), cfg, generator=step_generator(0, 0, 2))[0].item()
    assert again == losses[2]


@pytest.mark.parametrize("bad", [(1.5,), (True,), ("3",), (1, None)])
def test_step_generator_rejects_non_integer_keys(bad):
    with pytest.raises(TypeError, match="must be an int"):
        step_generator(*bad)


def test_eopd_with_alpha_zero_is_opd_exactly():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(dtype=torch.float32)
    args = (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)
    l_opd, m_opd = compute_loss(logits, LossInputs(*args), LossConfig(variant="opd"))
    l_e0, m_e0 = compute_loss(logits, LossInputs(*args), LossConfig(variant="eopd", alpha=0.0))
    assert torch.equal(l_opd, l_e0)
    (g1,), (g2,) = grads_of(l_opd, logits), grads_of(l_e0, logits)
    assert torch.equal(g1, g2)
    assert m_opd == m_e0


def test_eopd_normalises_by_all_valid_tokens_not_gated_ones():
    """Algorithm 1: the FKL sum is divided by every valid token, not by the gated ones."""
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=20)
    args = (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)
    _, m_opd = compute_loss(logits, LossInputs(*args), LossConfig(variant="opd"))
    _, m = compute_loss(logits, LossInputs(*args), LossConfig(variant="eopd", alpha=1.0))
    assert 0 < m["gate_ratio"] < 1
    assert m["fkl_loss"] == pytest.approx(m["gate_ratio"] * m["fkl_gated_mean"], rel=1e-9)
    assert m["pg_loss"] == pytest.approx(m_opd["pg_loss"], rel=1e-12)


# --------------------------------------------------------------------------------------------
# Chunked == unchunked == hidden-state path.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["eopd", "entropy_bonus", "opd_fkl"])
def test_chunk_sizes_agree(variant):
    logits, *rest, seq = make_inputs(n=17, dtype=torch.float32)
    results = []
    for chunk in (1, 3, 16, 4096):
        loss, _ = compute_loss(logits, LossInputs(*rest), LossConfig(variant=variant, chunk_size=chunk))
        (g,) = grads_of(loss, logits)
        results.append((loss, g))
    for loss, g in results[1:]:
        torch.testing.assert_close(loss, results[0][0], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(g, results[0][1], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("variant", ["eopd", "entropy_bonus", "advantage_shaping", "full_fkl"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_hidden_path_matches_logits_and_reference(variant, with_bias):
    n, d, vocab, k = 11, 6, 29, 4
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True) if with_bias else None
    _, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq = make_inputs(n=n, vocab=vocab, k=k, seed=5)
    cfg = LossConfig(variant=variant, chunk_size=3, temperature=1.3, entropy_coef=0.1)
    args = (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)
    loss_h, m_h = compute_loss_from_hidden(hidden, weight, LossInputs(*args), bias=bias, config=cfg)
    logits = hidden @ weight.t() + (bias if with_bias else 0.0)
    loss_l, m_l = compute_loss(logits, LossInputs(*args), cfg)
    ref = reference_loss(logits, *args, cfg)
    params = [p for p in (hidden, weight, bias) if p is not None]
    for loss in (loss_h, loss_l):
        torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    for a, b, c in zip(grads_of(loss_h, *params), grads_of(loss_l, *params), grads_of(ref, *params)):
        torch.testing.assert_close(a, c, atol=ATOL, rtol=0)
        torch.testing.assert_close(b, c, atol=ATOL, rtol=0)
    assert m_h == pytest.approx(m_l, abs=1e-9)


def test_hidden_path_without_weight_grad():
    n, d, vocab = 6, 4, 15
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64)  # frozen head
    _, *args, _ = make_inputs(n=n, vocab=vocab, k=3)
    loss, _ = compute_loss_from_hidden(hidden, weight, LossInputs(*args))
    loss.backward()
    assert hidden.grad is not None and weight.grad is None
    assert torch.isfinite(hidden.grad).all()


def test_batched_form_equals_flat_form_with_seq_index():
    b, t = 3, 5
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=b * t)
    seq = torch.arange(b).repeat_interleave(t)
    for agg in ("token-mean", "seq-mean-token-mean", "token-sum"):
        cfg = LossConfig(aggregation=agg, chunk_size=4)
        flat, mf = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq_index=seq), cfg)
        batched, mb = compute_loss(logits.view(b, t, -1), LossInputs(sampled.view(b, t), old.view(b, t), t_lp.view(b, t), t_ent.view(b, t), t_ids.view(b, t, -1), t_tlp.view(b, t, -1), mask.view(b, t)), cfg)
        torch.testing.assert_close(flat, batched)
        assert mf == pytest.approx(mb)


def test_hidden_batched_form():
    b, t, d, vocab = 2, 4, 5, 21
    hidden = torch.randn(b, t, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, dtype=torch.float64)
    _, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=b * t, vocab=vocab, k=3)
    args = [x.view(b, t, *x.shape[1:]) for x in (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)]
    cfg = LossConfig(aggregation="seq-mean-token-mean")
    loss, _ = compute_loss_from_hidden(hidden, weight, LossInputs(*args), config=cfg)
    ref = reference_loss(hidden.reshape(b * t, d) @ weight.t(), sampled, old, t_lp, t_ent, t_ids, t_tlp, mask,
                         cfg, seq_index=torch.arange(b).repeat_interleave(t))
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------
# gradcheck (finite differences) on small shapes.
# --------------------------------------------------------------------------------------------
def test_gradcheck_vocab_stats_logits_and_hidden():
    g = torch.Generator().manual_seed(11)
    n, vocab, d = 5, 7, 3
    rows = torch.tensor([0, 2, 3, 4])
    plan = VocabPlan(rows=rows, sampled=torch.tensor([1, 6, 0, 3]), gather_pos=torch.tensor([0, 2, 3]),
                     gather_ids=torch.tensor([[1, 2, 3], [0, 5, 6], [3, 4, 1]]), temperature=0.8,
                     chunk_size=2, entropy=True)
    logits = torch.randn(n, vocab, generator=g, dtype=torch.float64, requires_grad=True)

    def from_logits(z):
        s, h, q, _ = vocab_stats(plan, logits=z)
        return s, h, q

    assert torch.autograd.gradcheck(from_logits, (logits,))
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(vocab, d, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True)

    def from_hidden(h, w, b):
        s, e, q, _ = vocab_stats(plan, hidden=h, weight=w, bias=b)
        return s, e, q

    assert torch.autograd.gradcheck(from_hidden, (hidden, weight, bias))


# advantage_shaping is left out on purpose: its shaped advantage uses a *detached* entropy, so its
# gradient is not the finite-difference derivative (test_variant_matches_reference covers it).
@pytest.mark.parametrize("variant", ["eopd", "entropy_bonus", "opd_fkl", "random_fkl"])
def test_gradcheck_whole_loss(variant):
    logits, *rest, seq = make_inputs(n=6, vocab=9, k=3, seed=2)
    cfg = LossConfig(variant=variant, chunk_size=4, entropy_coef=0.3, vocab_metrics=False)
    assert torch.autograd.gradcheck(lambda z: compute_loss(z, LossInputs(*rest), cfg)[0], (logits.detach().requires_grad_(),))


# --------------------------------------------------------------------------------------------
# Gate boundary, edge cases.
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("logits_dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_gate_boundary_ge_vs_gt(logits_dtype):
    """The gate is decided on the teacher entropy in its own dtype: an fp64 entropy 1e-9 below tau
    is not gated even when the logits (so the compute dtype) are fp32 or bf16, where it would round
    to tau; one 1e-9 above tau is gated by "gt"."""
    logits, sampled, old, t_lp, _, t_ids, t_tlp, _, _ = make_inputs(n=5)
    logits = logits.detach().to(logits_dtype).requires_grad_(True)
    t_ent = torch.tensor([0.8, 0.8, 0.8 - 1e-9, 0.8 + 1e-9, 1.5], dtype=torch.float64)  # two exactly at tau
    assert torch.equal(t_ent[:4].float(), torch.full((4,), 0.8).float())  # all four equal after the cast
    mask = torch.ones(5, dtype=torch.bool)
    args = (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)
    atol = ATOL if logits_dtype == torch.float64 else 1e-5
    for gate, expected in (("ge", 0.8), ("gt", 0.4)):
        cfg = LossConfig(gate=gate, tau=0.8)
        loss, m = compute_loss(logits, LossInputs(*args), cfg)
        assert m["gate_ratio"] == pytest.approx(expected, abs=1e-6)  # metrics in the compute dtype
        assert m["fkl_ratio"] == pytest.approx(expected, abs=1e-6)
        ref = reference_loss(logits.detach().double(), *args, cfg)  # gate on the fp64 entropy
        torch.testing.assert_close(loss.double(), ref, atol=atol, rtol=0)


def test_gate_in_the_teacher_entropys_own_dtype_fp32():
    """An fp32 teacher entropy is compared with tau rounded to fp32: the fp32 value nearest 0.8 is at
    tau (gated by "ge" only), its neighbours below / above are not / are gated."""
    logits, sampled, old, t_lp, _, t_ids, t_tlp, _, _ = make_inputs(n=3)
    at = torch.tensor(0.8, dtype=torch.float32)
    t_ent = torch.stack([torch.nextafter(at, torch.tensor(0.0)), at, torch.nextafter(at, torch.tensor(1.0))])
    mask = torch.ones(3, dtype=torch.bool)
    args = (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)
    _, m_ge = compute_loss(logits, LossInputs(*args), LossConfig(gate="ge"))
    _, m_gt = compute_loss(logits, LossInputs(*args), LossConfig(gate="gt"))
    assert m_ge["gate_ratio"] == pytest.approx(2 / 3) and m_gt["gate_ratio"] == pytest.approx(1 / 3)


def test_all_masked_gives_zero_loss_with_gradient_and_no_nan():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, _, _ = make_inputs(n=6, dtype=torch.float32)
    mask = torch.zeros(6, dtype=torch.bool)
    t_lp = torch.full_like(t_lp, float("nan"))  # garbage at masked positions is never read
    t_tlp = torch.full_like(t_tlp, -torch.inf)
    sampled = torch.full_like(sampled, -100)
    for variant in ALL_VARIANTS:
        for agg in ("token-mean", "seq-mean-token-mean", "token-sum"):
            cfg = LossConfig(variant=variant, aggregation=agg)
            loss, m = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, seq_index=torch.zeros(6, dtype=torch.long)), cfg)
            assert loss.item() == 0.0 and loss.requires_grad
            (g,) = grads_of(loss, logits)
            assert torch.equal(g, torch.zeros_like(logits))
            assert all(math.isfinite(v) for v in m.values()) and m["n_tokens"] == 0


def test_empty_batch():
    logits = torch.zeros(0, 10, requires_grad=True)
    e = torch.zeros(0)
    loss, m = compute_loss(logits, LossInputs(e.long(), e, e, e, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), e.bool()))
    loss.backward()
    assert loss.item() == 0.0 and logits.grad.shape == (0, 10)


def test_masked_positions_do_not_matter():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=10)
    cfg = LossConfig(chunk_size=3)
    loss, m = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), cfg)
    inv = ~mask
    garbage = [x.clone() for x in (sampled, old, t_lp, t_ent, t_ids, t_tlp)]
    garbage[0][inv] = -1
    garbage[1][inv] = float("nan")
    garbage[2][inv] = -torch.inf
    garbage[3][inv] = float("nan")
    garbage[4][inv] = 10**6
    garbage[5][inv] = float("nan")
    logits2 = logits.detach().clone()
    logits2[inv] = float("nan")
    logits2.requires_grad_(True)
    loss2, m2 = compute_loss(logits2, LossInputs(*garbage, mask), cfg)
    torch.testing.assert_close(loss, loss2)
    assert m == pytest.approx(m2)
    (g,), (g2,) = grads_of(loss, logits), grads_of(loss2, logits2)
    torch.testing.assert_close(g, g2)
    assert torch.equal(g2[inv], torch.zeros_like(g2[inv]))


def test_neg_inf_teacher_topk_logprobs():
    logits, sampled, old, t_lp, _, t_ids, t_tlp, _, _ = make_inputs(n=5, k=4)
    t_ent = torch.full((5,), 2.0, dtype=torch.float64)  # all gated
    mask = torch.ones(5, dtype=torch.bool)
    t_tlp = t_tlp.clone()
    t_ids = t_ids.clone()
    t_tlp[0, 2:] = -torch.inf  # two dead entries
    t_ids[0, 3] = -1  # a dead entry may carry an invalid id
    t_tlp[1, :] = -torch.inf  # a row with no teacher mass: FKL 0
    cfg = LossConfig(variant="full_fkl")
    loss, m = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), cfg)
    ref = reference_loss(logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, cfg)
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    (g,), (g_ref,) = grads_of(loss, logits), grads_of(ref, logits)
    assert torch.isfinite(g).all()
    torch.testing.assert_close(g, g_ref, atol=ATOL, rtol=0)
    # row 0's FKL equals the FKL over its two live entries only
    only_row0 = torch.zeros(5, dtype=torch.bool)
    only_row0[0] = True
    _, m0 = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, only_row0), LossConfig(variant="opd_fkl"))
    _, m0_live = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids[:, :2], t_tlp[:, :2], only_row0), LossConfig(variant="opd_fkl"))
    assert m0["fkl_loss"] == pytest.approx(m0_live["fkl_loss"], abs=1e-12)
    assert all(math.isfinite(v) for v in m.values())


def test_k_equals_one_is_cross_entropy_on_the_teacher_argmax():
    logits, sampled, old, t_lp, _, t_ids, t_tlp, mask, _ = make_inputs(k=1)
    t_ent = torch.full_like(t_lp, 5.0)
    _, m = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), LossConfig(variant="opd_fkl"))
    logp = torch.log_softmax(logits.detach(), -1).gather(1, t_ids).squeeze(1)
    assert m["fkl_loss"] == pytest.approx((-logp[mask]).mean().item(), abs=1e-9)
    assert m["topk_overlap"] == pytest.approx(
        (logits.detach().argmax(-1) == t_ids.squeeze(1))[mask].double().mean().item())


def test_denominator_override_for_micro_batches():
    logits, *args, _ = make_inputs()
    mask = args[-1]
    loss, _ = compute_loss(logits, LossInputs(*args))
    loss2, _ = compute_loss(logits, LossInputs(*args), denominator=2 * int(mask.sum()))
    torch.testing.assert_close(loss2, loss / 2)


def test_seq_mean_needs_a_sequence_index():
    logits, *args, _ = make_inputs()
    with pytest.raises(ValueError, match="seq_index"):
        compute_loss(logits, LossInputs(*args), LossConfig(aggregation="seq-mean-token-mean"))


def test_out_of_range_ids_at_valid_positions_raise():
    logits, sampled, *rest, _ = make_inputs()
    bad = sampled.clone()
    bad[0] = logits.shape[1]
    with pytest.raises(ValueError, match="out of range"):
        compute_loss(logits, LossInputs(bad, *rest))


@pytest.mark.parametrize("name", ["old_logprobs", "teacher_logprobs", "teacher_entropies"])
@pytest.mark.parametrize("bad", [float("nan"), -math.inf, math.inf])
def test_non_finite_per_token_inputs_at_valid_positions_raise(name, bad):
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=12, dtype=torch.float32)
    inputs = {"old_logprobs": old.clone(), "teacher_logprobs": t_lp.clone(), "teacher_entropies": t_ent.clone()}
    valid = mask.nonzero().squeeze(1)
    inputs[name][valid[:2]] = bad  # two bad valid positions
    inputs[name][~mask] = bad  # and bad masked ones, which do not count
    for variant in ("eopd", "opd", "opd_fkl"):
        with pytest.raises(ValueError, match=f"{name} has 2 non-finite"):
            compute_loss(logits, LossInputs(sampled, inputs["old_logprobs"], inputs["teacher_logprobs"], inputs["teacher_entropies"], t_ids, t_tlp, mask), LossConfig(variant=variant))


def test_per_token_input_overflowing_the_compute_dtype_raises():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=6)
    t_lp = t_lp.clone()
    t_lp[0] = -1e300  # finite in fp64, -inf in the fp32 compute dtype of fp32 logits
    compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask))  # fp64 logits: fine
    with pytest.raises(ValueError, match="teacher_logprobs has 1 non-finite .* float32 range"):
        compute_loss(logits.detach().float(), LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask))


@pytest.mark.parametrize("bad", [float("nan"), math.inf])
def test_nan_or_pos_inf_teacher_topk_logprobs_raise(bad):
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=8)
    t_tlp = t_tlp.clone()
    t_tlp[0, 1] = bad
    t_tlp[0, 3] = -math.inf  # allowed
    with pytest.raises(ValueError, match="teacher_topk_logprobs has 1 NaN or \\+inf"):
        compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask))


def test_errors_are_all_reported_at_once():
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, _, _ = make_inputs(n=6)
    sampled, old = sampled.clone(), old.clone()
    sampled[1] = -3
    old[2] = float("nan")
    with pytest.raises(ValueError, match="sampled_ids has 1 id.*out of range.*old_logprobs has 1 non-finite"):
        compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp))


def test_variant_without_any_term_is_rejected_at_registration():
    with pytest.raises(ValueError, match="has no term"):
        register_variant(Variant("no_terms_at_all", "nothing", pg=False))
    assert "no_terms_at_all" not in VARIANTS


def test_variant_whose_terms_the_config_switches_off_gives_a_zero_loss():
    name = "fkl_only_alpha_weighted"
    if name not in VARIANTS:
        register_variant(Variant(name, "FKL everywhere, weight alpha, no pg", pg=False, fkl_positions=everywhere))
    logits, *args, _ = make_inputs()
    loss, m = compute_loss(logits, LossInputs(*args), LossConfig(variant=name, alpha=0.0))
    assert loss.item() == 0.0 and loss.requires_grad
    (g,) = grads_of(loss, logits)
    assert torch.equal(g, torch.zeros_like(logits))
    assert m["loss"] == 0.0 and all(math.isfinite(v) for v in m.values())
    loss1, _ = compute_loss(logits, LossInputs(*args), LossConfig(variant=name, alpha=0.5))
    ref, _ = compute_loss(logits, LossInputs(*args), LossConfig(variant="opd_fkl"))
    torch.testing.assert_close(loss1, 0.5 * ref)


def test_topk_overlap_counts_only_finite_teacher_candidates():
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0],
                           [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]], dtype=torch.float64)
    # student top-3 = {0, 1, 2}
    t_ids = torch.tensor([[0, 1, 5], [2, 4, 5], [0, 1, 2]])
    t_tlp = torch.tensor([[-0.5, -1.5, -math.inf],  # 2 candidates, both in the student's top-3: 1
                          [-0.5, -1.5, -2.0],  # 3 candidates, 1 in: 1/3
                          [-math.inf] * 3], dtype=torch.float64)  # no candidate: left out
    n = 3
    _, m = compute_loss(logits, LossInputs(torch.zeros(n, dtype=torch.long), torch.full((n,), -1.0, dtype=torch.float64), torch.full((n,), -1.0, dtype=torch.float64), torch.full((n,), 2.0, dtype=torch.float64), t_ids, t_tlp))
    assert m["topk_overlap"] == pytest.approx((1.0 + 1 / 3) / 2, abs=1e-12)


def test_bf16_logits_close_to_fp32():
    logits, *args, _ = make_inputs(dtype=torch.float32)
    l32, _ = compute_loss(logits, LossInputs(*args))
    lb = logits.detach().to(torch.bfloat16).requires_grad_(True)
    l16, _ = compute_loss(lb, LossInputs(*args))
    l16.backward()
    assert l16.dtype == torch.float32 and lb.grad.dtype == torch.bfloat16
    assert l16.item() == pytest.approx(l32.item(), abs=0.05)


# --------------------------------------------------------------------------------------------
# Memory design: FKL gathered only at gated rows; no [N, V] tensor saved by the hidden path.
# --------------------------------------------------------------------------------------------
def test_fkl_gathered_only_at_gated_rows(monkeypatch):
    seen = {}
    real = loss_module.vocab_stats

    def spy(plan, **kw):
        seen["G"] = plan.gather_ids.shape[0]
        return real(plan, **kw)

    monkeypatch.setattr(loss_module, "vocab_stats", spy)
    logits, sampled, old, t_lp, t_ent, t_ids, t_tlp, mask, _ = make_inputs(n=30)
    args = (sampled, old, t_lp, t_ent, t_ids, t_tlp, mask)
    _, m = compute_loss(logits, LossInputs(*args), LossConfig(variant="eopd"))
    assert seen["G"] == int(((t_ent >= 0.8) & mask).sum()) < int(mask.sum())
    compute_loss(logits, LossInputs(*args), LossConfig(variant="full_fkl"))
    assert seen["G"] == int(mask.sum())


def test_no_full_vocab_tensor_is_saved_for_backward():
    n, d, vocab = 64, 8, 257
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    _, *args, _ = make_inputs(n=n, vocab=vocab, k=4, dtype=torch.float32)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = compute_loss_from_hidden(hidden, weight, LossInputs(*args), config=LossConfig(chunk_size=16))
    loss.backward()
    assert saved and max(saved) < n * vocab // 4  # hidden, weight, per-token stats: never [N, V]


@pytest.mark.parametrize("variant", ["eopd", "entropy_bonus", "opd"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("vocab_metrics", [True, False])
def test_large_logit_offset_costs_no_precision(variant, temperature, vocab_metrics):
    """fp32 logits + 1e4: the same loss, entropy and gradient as without the offset (softmax is
    shift-invariant), to 1e-5 against the fp64 reference; the maths is done relative to the row max."""
    logits, *args, _ = make_inputs(n=20, vocab=50, seed=4)
    # multiples of 2^-10, the fp32 spacing at 1e4: logits + 1e4 are exact in fp32, so any difference
    # comes from the loss's arithmetic, not from rounding the inputs
    base = torch.round(logits.detach() * 1024) / 1024
    cfg = LossConfig(variant=variant, temperature=temperature, chunk_size=6, entropy_coef=0.1,
                     vocab_metrics=vocab_metrics)
    base64 = base.clone().requires_grad_(True)
    ref = reference_loss(base64, *args, cfg)
    (g_ref,) = grads_of(ref, base64)
    ent_ref = -(torch.log_softmax(base / temperature, -1).exp() * torch.log_softmax(base / temperature, -1)).sum(-1)
    mask = args[-1]
    for offset in (0.0, 1e4):
        z = (base.float() + offset).requires_grad_(True)
        loss, m = compute_loss(z, LossInputs(*args), cfg)
        (g,) = grads_of(loss, z)
        torch.testing.assert_close(loss.double(), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(g.double(), g_ref, atol=1e-5, rtol=0)
        if "student_entropy" in m:
            assert m["student_entropy"] == pytest.approx(ent_ref[mask].mean().item(), abs=1e-5)
    # the hidden path too: a bias of 1e4
    hidden = torch.eye(20, dtype=torch.float32).requires_grad_(True)  # hidden @ weight.T = base (exactly)
    weight = base.float().t().contiguous()
    loss_h, _ = compute_loss_from_hidden(hidden, weight, LossInputs(*args), bias=torch.full((50,), 1e4), config=cfg)
    torch.testing.assert_close(loss_h.double(), ref, atol=1e-5, rtol=0)


class _AllocationTracker(TorchDispatchMode):
    """Records every tensor produced by an aten op, and after each op the set of live storages of at
    least `min_bytes` (weak references: a storage is live while any tensor viewing it is)."""

    def __init__(self, min_bytes: int):
        super().__init__()
        self.min_bytes = min_bytes
        self.created: list[tuple[str, tuple[int, ...], int, int]] = []  # op, shape, numel, storage ptr
        self._live: list[tuple[weakref.ref, int]] = []
        self.live_sets: list[frozenset[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self.created.append((str(func), tuple(t.shape), t.numel(), storage.data_ptr()))
                if storage.nbytes() >= self.min_bytes:
                    self._live.append((weakref.ref(t), storage.data_ptr()))
        self._live = [(r, ptr) for r, ptr in self._live if r() is not None]
        self.live_sets.append(frozenset(ptr for _, ptr in self._live))
        return out

    def peak_live(self, exclude: set[int]) -> int:
        return max((len(s - exclude) for s in self.live_sets), default=0)


def _storages(*tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None}


@pytest.mark.parametrize("variant,extra_buffers", [("eopd", 1), ("opd", 1), ("full_fkl", 1), ("entropy_bonus", 2),
                                                    ("kd", 1), ("gkd", 1)])
@pytest.mark.parametrize("vocab_metrics", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("fused", [True, False])
def test_vocab_sized_allocations(variant, extra_buffers, vocab_metrics, temperature, fused):
    """Every tensor created in forward + backward: the hidden path never creates one of N * V
    elements or more (N = 4 chunks); the logits path creates exactly one, the logits' gradient. And
    at most `extra_buffers` chunk-sized fp32 buffers are alive at once (docs/objective.md): one,
    plus a second in backward when the student entropy is differentiated (entropy_bonus), for the
    recomputing path; two, whatever the variant, for the fused one (the shifted logits and their
    exponentials, turned into the gradient in place)."""
    hidden_buffers = 2 if fused else extra_buffers
    n, d, vocab, chunk = 64, 4, 257, 16
    chunk_bytes = chunk * vocab * 4
    logits, *args, _ = make_inputs(n=n, vocab=vocab, k=4, dtype=torch.float32)  # mask: scattered rows
    cfg = LossConfig(variant=variant, chunk_size=chunk, vocab_metrics=vocab_metrics, temperature=temperature,
                     entropy_coef=0.1, fused_backward=fused)
    inputs = _storages(*args)

    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(vocab, d, requires_grad=True)
    tracker = _AllocationTracker(chunk_bytes // 2)
    with tracker:
        loss, _ = compute_loss_from_hidden(hidden, weight, LossInputs(*args), config=cfg)
        loss.backward()
    assert hidden.grad is not None and weight.grad is not None
    assert tracker.created
    assert max(numel for _, _, numel, _ in tracker.created) < n * vocab
    assert tracker.peak_live(inputs | _storages(hidden, weight)) == hidden_buffers
    if fused:
        return  # the logits path below does not depend on fused_backward

    tracker = _AllocationTracker(chunk_bytes // 2)
    with tracker:
        loss, _ = compute_loss(logits, LossInputs(*args), cfg)
        loss.backward()
    own = _storages(logits, logits.grad)
    big = [(op, shape) for op, shape, numel, ptr in tracker.created if numel >= n * vocab and ptr not in own]
    assert big == []
    assert sum(1 for _, _, numel, ptr in tracker.created
               if numel >= n * vocab and ptr == logits.grad.untyped_storage().data_ptr()) >= 1
    assert tracker.peak_live(inputs | own) == extra_buffers


# --------------------------------------------------------------------------------------------
# Metrics on a hand-made example.
# --------------------------------------------------------------------------------------------
def test_metrics_on_hand_made_inputs():
    ln = math.log
    logits = torch.tensor([[ln(4), ln(2), 0.0, 0.0],  # p = .5 .25 .125 .125
                           [0.0, 0.0, ln(3), ln(3)],  # p = 1/8 1/8 3/8 3/8
                           [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64, requires_grad=True)  # masked
    sampled = torch.tensor([0, 2, 0])
    old = torch.tensor([ln(0.5), ln(3 / 8) - 0.5, 0.0], dtype=torch.float64)  # ratios 1 and e^0.5
    t_lp = torch.tensor([ln(0.5) + 0.3, ln(3 / 8) - 0.5 + 1.0, 0.0], dtype=torch.float64)  # A = .3, 1
    t_ent = torch.tensor([1.0, 0.5, 9.0], dtype=torch.float64)  # gate: yes, no (masked row ignored)
    t_ids = torch.tensor([[0, 1], [2, 0], [0, 1]])
    t_tlp = torch.tensor([[ln(0.3), ln(0.1)], [ln(0.4), ln(0.4)], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([True, True, False])
    loss, m = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), LossConfig())

    r1 = math.exp(0.5)
    pg0, pg1 = -0.3, max(-r1 * 1.0, -1.2 * 1.0)  # row 1 clipped
    fkl0 = 0.75 * (ln(0.75) - ln(0.5)) + 0.25 * (ln(0.25) - ln(0.25))
    h0 = 1.75 * ln(2)
    h1 = 3 * ln(2) - 0.75 * ln(3)
    expected = {
        "loss": (pg0 + pg1 + fkl0) / 2,
        "pg_loss": (pg0 + pg1) / 2,
        "fkl_loss": fkl0 / 2,
        "entropy_loss": 0.0,
        "topk_rkl_loss": 0.0,
        "divergence_loss": 0.0,
        "ce": -(ln(0.5) + ln(3 / 8)) / 2,  # mean -log pi_theta(x_t) over the valid tokens
        "clip_frac": 0.5,
        "ratio_mean": (1 + r1) / 2,
        "approx_kl": (0.0 - 0.5) / 2,
        "approx_kl_k3": (0.0 + (r1 - 1 - 0.5)) / 2,
        "advantage_mean": 0.65,
        "advantage_shaped_mean": 0.65,
        "gate_ratio": 0.5,
        "fkl_ratio": 0.5,
        "fkl_gated_mean": fkl0,
        "teacher_entropy": 0.75,
        "teacher_topk_mass": (0.4 + 0.8) / 2,
        "n_tokens": 2.0,
        "student_entropy": (h0 + h1) / 2,
        "topk_overlap": (1.0 + 0.5) / 2,
    }
    assert m == pytest.approx(expected, abs=1e-12)
    assert loss.item() == pytest.approx(expected["loss"], abs=1e-12)

    # advantage shaping: psi = min(0.1 * H_student, |A| / 2)
    _, ms = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), LossConfig(variant="advantage_shaping"))
    shaped = [0.3 + min(0.1 * h0, 0.15), 1.0 + min(0.1 * h1, 0.5)]
    assert ms["advantage_shaped_mean"] == pytest.approx(sum(shaped) / 2, abs=1e-12)
    assert ms["pg_loss"] == pytest.approx((-shaped[0] + max(-r1 * shaped[1], -1.2 * shaped[1])) / 2, abs=1e-12)

    # entropy bonus: loss = opd - coef * mean student entropy
    _, mb = compute_loss(logits, LossInputs(sampled, old, t_lp, t_ent, t_ids, t_tlp, mask), LossConfig(variant="entropy_bonus", entropy_coef=0.01))
    assert mb["entropy_loss"] == pytest.approx(-0.01 * (h0 + h1) / 2, abs=1e-12)
    assert mb["loss"] == pytest.approx((pg0 + pg1) / 2 - 0.01 * (h0 + h1) / 2, abs=1e-12)


def test_aggregation_weights_by_hand():
    w = aggregation_weights("seq-mean-token-mean", 4, torch.tensor([0, 0, 0, 5]), None,
                            device="cpu", dtype=torch.float64)
    torch.testing.assert_close(w, torch.tensor([1 / 6, 1 / 6, 1 / 6, 1 / 2], dtype=torch.float64))
    w = aggregation_weights("token-mean", 4, None, 8, device="cpu", dtype=torch.float64)
    torch.testing.assert_close(w, torch.full((4,), 1 / 8, dtype=torch.float64))
    # token-sum: a constant whatever the tokens (TRL GKDTrainer's num_items_in_batch), unless a
    # micro-batch's share of it is given
    w = aggregation_weights("token-sum", 3, None, None, device="cpu", dtype=torch.float64, sum_divisor=16.0)
    torch.testing.assert_close(w, torch.full((3,), 1 / 16, dtype=torch.float64))
    w = aggregation_weights("token-sum", 3, None, 4.0, device="cpu", dtype=torch.float64, sum_divisor=16.0)
    torch.testing.assert_close(w, torch.full((3,), 1 / 4, dtype=torch.float64))


# --------------------------------------------------------------------------------------------
# Configuration.
# --------------------------------------------------------------------------------------------
def test_config_defaults_are_the_papers():
    c = LossConfig()
    assert (c.variant, c.tau, c.alpha, c.clip_low, c.clip_high, c.temperature, c.gate, c.aggregation,
            c.random_fraction, c.shaping_alpha, c.shaping_kappa) == (
        "eopd", 0.8, 1.0, 0.2, 0.2, 1.0, "ge", "token-mean", 0.2, 0.1, 2.0)


@pytest.mark.parametrize("bad", [{"variant": "nope"}, {"tau": -1}, {"clip_low": 1.0}, {"temperature": 0},
                                 {"gate": ">="}, {"aggregation": "sum"}, {"sum_divisor": 0}, {"shaping_kappa": 1.0},
                                 {"chunk_size": 0}, {"typo_field": 1}])
def test_config_is_validated(bad):
    with pytest.raises(ValidationError):
        LossConfig(**bad)


def test_config_is_frozen():
    with pytest.raises(ValidationError):
        LossConfig().alpha = 2.0


def test_custom_variant_registration():
    name = "fkl_everywhere_half"
    if name not in VARIANTS:
        register_variant(Variant(name, "test", fkl_positions=everywhere, fkl_coef=lambda c: 0.5))
    with pytest.raises(ValueError, match="already registered"):
        register_variant(Variant(name, "again"))
    logits, *args, _ = make_inputs()
    loss_custom, _ = compute_loss(logits, LossInputs(*args), LossConfig(variant=name))
    loss_full, _ = compute_loss(logits, LossInputs(*args), LossConfig(variant="full_fkl", alpha=0.5))
    torch.testing.assert_close(loss_custom, loss_full)


@pytest.mark.parametrize("variant", ["opd", "eopd", "advantage_shaping"])
def test_diagnostics_do_not_change_the_loss_or_gradient(variant):
    logits, *args, _ = make_inputs(dtype=torch.float64)
    with_m, m1 = compute_loss(logits, LossInputs(*args), LossConfig(variant=variant, vocab_metrics=True, chunk_size=5))
    without, m2 = compute_loss(logits, LossInputs(*args), LossConfig(variant=variant, vocab_metrics=False, chunk_size=5))
    torch.testing.assert_close(with_m, without, atol=1e-12, rtol=0)
    (g1,), (g2,) = grads_of(with_m, logits), grads_of(without, logits)
    torch.testing.assert_close(g1, g2, atol=1e-12, rtol=0)
    assert "topk_overlap" in m1 and "topk_overlap" not in m2
