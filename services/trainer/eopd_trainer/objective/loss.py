"""`compute_loss` and `compute_loss_from_hidden`: the loss of every variant, with its metrics.

The flow is the same for both entry points:

1. select the M valid tokens (mask), and the per-token teacher/behaviour inputs there;
2. choose the FKL positions of the variant (entropy gate, all, random, none) *before* touching the
   vocabulary, so the student's log-probs at the teacher's top-k are gathered only where needed;
3. one chunked vocabulary pass (`vocab.vocab_stats`): log-prob of the sampled token, student
   entropy, log-probs at the teacher's top-k of the gathered tokens;
4. per-token terms (`terms`) on these small tensors, aggregated with explicit weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import LossConfig
from .terms import aggregation_weights, clipped_pg_loss, shaped_advantages, topk_forward_kl, topk_reverse_kl
from .variants import PositionContext, get_variant
from .vocab import VocabPlan, vocab_stats

DEFAULT_CONFIG = LossConfig()

#: Keys of the metrics dict, always present (student_entropy and topk_overlap need vocab_metrics,
#: or for student_entropy a variant that uses it; they are absent otherwise).
METRIC_KEYS = (
    "loss",
    "pg_loss",
    "fkl_loss",
    "entropy_loss",
    "topk_rkl_loss",
    "clip_frac",
    "ratio_mean",
    "approx_kl",
    "approx_kl_k3",
    "advantage_mean",
    "advantage_shaped_mean",
    "gate_ratio",
    "fkl_ratio",
    "fkl_gated_mean",
    "teacher_entropy",
    "teacher_topk_mass",
    "n_tokens",
)


@dataclass(frozen=True)
class _Tokens:
    """Per-token inputs, flattened to N tokens."""

    sampled_ids: Tensor  # [N] long
    old_logprobs: Tensor  # [N]
    teacher_logprobs: Tensor  # [N]
    teacher_entropy: Tensor  # [N]
    topk_ids: Tensor  # [N, k] long
    topk_logprobs: Tensor  # [N, k]
    mask: Tensor  # [N] bool
    seq_index: Tensor | None  # [N] long
    cand_ids: Tensor | None = None  # [N, m] long, -1 filler (eopd_topk_rkl)
    cand_logprobs: Tensor | None = None  # [N, m] teacher log-probs at cand_ids (NaN at filler)


def _flatten_candidates(lead: tuple[int, ...], cand_ids, cand_logprobs) -> tuple[Tensor | None, Tensor | None]:
    if cand_ids is None and cand_logprobs is None:
        return None, None
    if cand_ids is None or cand_logprobs is None:
        raise ValueError("candidate_ids and candidate_logprobs go together")
    for name, t in (("candidate_ids", cand_ids), ("candidate_logprobs", cand_logprobs)):
        if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead:
            raise ValueError(f"{name} must have shape {lead + ('m',)}, got {tuple(t.shape)}")
    if cand_ids.shape != cand_logprobs.shape:
        raise ValueError("candidate_ids and candidate_logprobs must have the same shape")
    m = cand_ids.shape[-1]
    return cand_ids.reshape(-1, m), cand_logprobs.reshape(-1, m)


def _flatten_tokens(lead: tuple[int, ...], sampled_ids, old_logprobs, teacher_logprobs, teacher_entropy,
                    topk_ids, topk_logprobs, mask, seq_index, cand_ids=None, cand_logprobs=None) -> _Tokens:
    """Checks shapes against the leading shape `lead` ([N] or [B, T]) and flattens to [N]."""
    if len(lead) not in (1, 2):
        raise ValueError(f"expected [N, ...] or [B, T, ...] inputs, got leading shape {lead}")
    device = sampled_ids.device
    if mask is None:
        mask = torch.ones(lead, dtype=torch.bool, device=device)
    for name, t in (("sampled_ids", sampled_ids), ("old_logprobs", old_logprobs),
                    ("teacher_logprobs", teacher_logprobs), ("teacher_entropy", teacher_entropy),
                    ("mask", mask)):
        if tuple(t.shape) != lead:
            raise ValueError(f"{name} must have shape {lead}, got {tuple(t.shape)}")
    for name, t in (("teacher_topk_ids", topk_ids), ("teacher_topk_logprobs", topk_logprobs)):
        if t.dim() != len(lead) + 1 or tuple(t.shape[:-1]) != lead or t.shape[-1] < 1:
            raise ValueError(f"{name} must have shape {lead + ('k',)} with k >= 1, got {tuple(t.shape)}")
    if topk_ids.shape != topk_logprobs.shape:
        raise ValueError("teacher_topk_ids and teacher_topk_logprobs must have the same shape")
    if len(lead) == 2:
        if seq_index is not None:
            raise ValueError("seq_index is implied by batched [B, T] inputs; pass it only with flat [N] inputs")
        b, t = lead
        seq_index = torch.arange(b, device=device).repeat_interleave(t)
    elif seq_index is not None and tuple(seq_index.shape) != lead:
        raise ValueError(f"seq_index must have shape {lead}, got {tuple(seq_index.shape)}")
    k = topk_ids.shape[-1]
    cand_ids, cand_logprobs = _flatten_candidates(lead, cand_ids, cand_logprobs)
    return _Tokens(
        sampled_ids=sampled_ids.reshape(-1),
        old_logprobs=old_logprobs.reshape(-1),
        teacher_logprobs=teacher_logprobs.reshape(-1),
        teacher_entropy=teacher_entropy.reshape(-1),
        topk_ids=topk_ids.reshape(-1, k),
        topk_logprobs=topk_logprobs.reshape(-1, k),
        mask=mask.reshape(-1) != 0,
        seq_index=None if seq_index is None else seq_index.reshape(-1),
        cand_ids=cand_ids,
        cand_logprobs=cand_logprobs,
    )


def _check_valid_inputs(vocab: int, dtype: torch.dtype, *, sampled: Tensor, old_logprobs: Tensor,
                        teacher_logprobs: Tensor, teacher_entropy: Tensor, topk_ids: Tensor,
                        topk_logprobs: Tensor, topk_finite: Tensor) -> None:
    """Raises ValueError, naming the tensor and its number of bad valid positions, on out-of-range
    ids, non-finite per-token inputs, or NaN / +inf teacher top-k log-probs (-inf is allowed there:
    an absent candidate). The per-token tensors are checked in the compute dtype, so values that
    overflow it count as non-finite. One device-to-host sync for all checks."""
    counts = torch.stack([
        ((sampled < 0) | (sampled >= vocab)).sum(),
        (topk_finite & ((topk_ids < 0) | (topk_ids >= vocab))).sum(),
        (~torch.isfinite(old_logprobs)).sum(),
        (~torch.isfinite(teacher_logprobs)).sum(),
        (~torch.isfinite(teacher_entropy)).sum(),
        (torch.isnan(topk_logprobs) | (topk_logprobs == torch.inf)).sum(),
    ]).tolist()
    if not any(counts):
        return
    kind = {torch.float32: "float32", torch.float64: "float64"}.get(dtype, str(dtype))
    messages = []
    for name, n in zip(("sampled_ids", "teacher_topk_ids"), counts[:2]):
        if n:
            messages.append(f"{name} has {n} id(s) out of range [0, {vocab}) at valid positions")
    for name, n in zip(("old_logprobs", "teacher_logprobs", "teacher_entropy"), counts[2:5]):
        if n:
            messages.append(f"{name} has {n} non-finite value(s) (NaN, +-inf, or beyond the {kind} range) "
                            "at valid positions")
    if counts[5]:
        messages.append(f"teacher_topk_logprobs has {counts[5]} NaN or +inf value(s) at valid positions "
                        "(-inf, an absent candidate, is allowed)")
    raise ValueError("; ".join(messages))


def _candidates(variant, tokens: _Tokens, valid: Tensor, vocab: int, dtype: torch.dtype,
                name: str) -> tuple[Tensor, Tensor, Tensor] | None:
    """For a `topk_rkl` variant: the valid tokens' candidate ids `[M, m]` (filler made 0), the
    teacher's log-probs there `[M, m]` and which candidates count `[M, m]` (an id, not -1 filler,
    with a finite teacher log-prob); None for other variants."""
    if not variant.topk_rkl:
        return None
    if tokens.cand_ids is None:
        raise ValueError(f"loss variant {name!r} needs candidate_ids and candidate_logprobs (the student's top-k "
                         "ids at each position and the teacher's log-probs there)")
    ids = tokens.cand_ids[valid].long()
    t_lp = tokens.cand_logprobs[valid].detach().to(dtype)
    out_of_range = int(((ids < -1) | (ids >= vocab)).sum())
    if out_of_range:
        raise ValueError(f"candidate_ids has {out_of_range} id(s) out of range [0, {vocab}) (-1 is filler) at valid positions")
    ok = (ids >= 0) & torch.isfinite(t_lp)
    return torch.where(ok, ids, 0), t_lp, ok


def _mean(x: Tensor) -> Tensor:
    return x.mean() if x.numel() else x.new_zeros(())


def _objective(tokens: _Tokens, cfg: LossConfig, source: dict, vocab: int, dtype: torch.dtype,
               denominator: float | None, generator: torch.Generator | None) -> tuple[Tensor, dict[str, float]]:
    variant = get_variant(cfg.variant)
    valid = tokens.mask.nonzero().squeeze(1)  # [M]
    m = valid.numel()
    sampled = tokens.sampled_ids[valid].long()
    old = tokens.old_logprobs[valid].detach().to(dtype)
    t_lp = tokens.teacher_logprobs[valid].detach().to(dtype)
    t_ent_in = tokens.teacher_entropy[valid].detach()  # its own dtype: the gate is decided on it
    t_ent = t_ent_in.to(dtype)
    t_ids = tokens.topk_ids[valid].long()
    t_tlp = tokens.topk_logprobs[valid].detach().to(dtype)
    k = t_ids.shape[1]
    t_finite = torch.isfinite(t_tlp)  # [M, k]; -inf entries carry no teacher mass
    _check_valid_inputs(vocab, dtype, sampled=sampled, old_logprobs=old, teacher_logprobs=t_lp,
                        teacher_entropy=t_ent, topk_ids=t_ids, topk_logprobs=t_tlp, topk_finite=t_finite)
    t_ids = torch.where(t_finite, t_ids, 0)  # ids of -inf entries are never used: make them safe

    # 2. positions of the FKL, before the vocabulary pass. The gate compares the teacher entropy in
    # the dtype it was given (tau rounded to that dtype), not after the cast to the compute dtype:
    # an fp64 entropy just below tau must not round up to tau in fp32.
    gate = t_ent_in >= cfg.tau if cfg.gate == "ge" else t_ent_in > cfg.tau
    if generator is None:  # deterministic in (random_seed, M): see step_generator for training loops
        generator = torch.Generator().manual_seed(cfg.random_seed)
    fkl_pos = variant.fkl_positions(PositionContext(gate=gate, config=cfg, generator=generator))
    fkl_coef = variant.fkl_coef(cfg) if fkl_pos is not None else 0.0
    apply_fkl = fkl_pos is not None and fkl_coef != 0.0
    gathered = (gate | fkl_pos) if apply_fkl else gate  # gated rows are gathered for the metric
    cand = _candidates(variant, tokens, valid, vocab, dtype, cfg.variant)
    if cand is not None:  # the student's top-k is gathered at every row: gather the teacher's there too
        gathered = torch.ones_like(gate)
    gather_pos = gathered.nonzero().squeeze(1)  # [G]
    gather_ids = t_ids[gather_pos] if cand is None else torch.cat([t_ids, cand[0]], dim=1)

    # 3. one chunked pass over the vocabulary.
    entropy_coef = variant.entropy_coef(cfg)
    need_entropy = entropy_coef != 0.0 or variant.shape_advantage or cfg.vocab_metrics
    plan = VocabPlan(
        rows=valid,
        sampled=sampled,
        gather_pos=gather_pos,
        gather_ids=gather_ids,
        temperature=cfg.temperature,
        chunk_size=cfg.chunk_size,
        entropy=need_entropy,
        student_topk=min(k, vocab) if cfg.vocab_metrics else 0,
    )
    logp, s_ent, logp_topk, s_topk = vocab_stats(plan, **source)
    logp_cand = None
    if cand is not None:
        logp_topk, logp_cand = logp_topk[:, :k], logp_topk[:, k:]

    # 4. per-token terms, aggregated.
    w = aggregation_weights(
        cfg.aggregation, m, None if tokens.seq_index is None else tokens.seq_index[valid],
        denominator, device=valid.device, dtype=dtype,
    )
    adv = t_lp - old
    adv_used = shaped_advantages(adv, s_ent, cfg.shaping_alpha, cfg.shaping_kappa) if variant.shape_advantage else adv
    pg_t, ratio, clipped = clipped_pg_loss(
        logp if variant.pg else logp.detach(), old, adv_used, cfg.clip_low, cfg.clip_high
    )
    fkl_g = topk_forward_kl(logp_topk, t_tlp[gather_pos])  # [G]

    zero = w.new_zeros(())
    terms = []
    pg_loss = fkl_loss = entropy_loss = rkl_loss = zero
    if variant.pg:
        pg_loss = (w * pg_t).sum()
        terms.append(pg_loss)
    if cand is not None:
        rkl_t = topk_reverse_kl(logp_cand, cand[1], cand[2])  # [M]
        rkl_loss = (w * rkl_t).sum()
        terms.append(rkl_loss)
    if apply_fkl:
        w_fkl = w[gather_pos] * fkl_pos[gather_pos].to(dtype)
        fkl_loss = fkl_coef * (w_fkl * fkl_g).sum()
        terms.append(fkl_loss)
    if entropy_coef != 0.0:
        entropy_loss = -entropy_coef * (w * s_ent).sum()
        terms.append(entropy_loss)
    if terms:
        loss = terms[0]
        for t in terms[1:]:
            loss = loss + t
    else:  # a variant whose terms are all switched off by the config (e.g. its FKL weight is 0):
        loss = logp[:0].sum()  # an exact 0 that is part of the graph (zero gradient), like no token

    with torch.no_grad():
        gated_in_gather = gate[gather_pos]
        values = {
            "loss": loss,
            "pg_loss": pg_loss,
            "fkl_loss": fkl_loss,
            "entropy_loss": entropy_loss,
            "topk_rkl_loss": rkl_loss,
            "clip_frac": _mean(clipped.to(dtype)),
            "ratio_mean": _mean(ratio),
            "approx_kl": _mean(old - logp),
            "approx_kl_k3": _mean(ratio - 1.0 - (logp - old)),
            "advantage_mean": _mean(adv),
            "advantage_shaped_mean": _mean(adv_used),
            "gate_ratio": _mean(gate.to(dtype)),
            "fkl_ratio": _mean(fkl_pos.to(dtype)) if apply_fkl else zero,
            "fkl_gated_mean": _mean(fkl_g[gated_in_gather]),
            "teacher_entropy": _mean(t_ent),
            "teacher_topk_mass": _mean(torch.where(t_finite, t_tlp.exp(), 0.0).sum(dim=1)),
            "n_tokens": torch.tensor(float(m), dtype=dtype, device=w.device),
        }
        if need_entropy:
            values["student_entropy"] = _mean(s_ent)
        if cand is not None:
            values["student_candidate_mass"] = _mean(torch.where(cand[2], logp_cand.exp(), 0.0).sum(dim=1))
        if cfg.vocab_metrics:
            # share of the teacher's candidates (its finite top-k entries) in the student's top-k;
            # rows with no finite teacher entry have no candidate and are left out of the mean
            hit = (s_topk[:, :, None] == t_ids[:, None, :]) & t_finite[:, None, :]  # [M, s, k]
            n_cand = t_finite.sum(dim=1)
            has = n_cand > 0
            values["topk_overlap"] = _mean(hit.any(dim=1).sum(dim=1)[has].to(dtype) / n_cand[has].to(dtype))
        floats = torch.stack([v.detach().to(torch.float64).reshape(()) for v in values.values()]).tolist()
    return loss, dict(zip(values.keys(), floats))


def compute_loss(
    student_logits: Tensor,
    sampled_ids: Tensor,
    old_logprobs: Tensor,
    teacher_logprobs: Tensor,
    teacher_entropy: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    mask: Tensor | None = None,
    config: LossConfig = DEFAULT_CONFIG,
    *,
    seq_index: Tensor | None = None,
    denominator: float | None = None,
    generator: torch.Generator | None = None,
    candidate_ids: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The distillation loss from student logits, chunked over tokens.

    Flat form (tokens of a mini-batch at response positions) or batched form:

    Args:
        student_logits: [N, V] or [B, T, V], any float dtype (computed in fp32, fp64 kept).
        sampled_ids: [N] / [B, T] long, the token sampled by the behaviour policy.
        old_logprobs: [N] / [B, T], its log-prob under the behaviour policy (at the temperature).
        teacher_logprobs: [N] / [B, T], its log-prob under the teacher.
        teacher_entropy: [N] / [B, T], the teacher's full-vocabulary entropy (nats).
        teacher_topk_ids: [N, k] / [B, T, k] long, the teacher's top-k ids.
        teacher_topk_logprobs: [N, k] / [B, T, k], their teacher log-probs (-inf allowed).
        mask: [N] / [B, T], bool or 0/1; None means every token is valid. Inputs at masked
            positions are never read (they may hold padding ids, NaN, -inf...).
        config: a `LossConfig`.
        seq_index: [N] long, the sequence of each token; needed by "seq-mean-token-mean" in the
            flat form (implied by the batched form).
        denominator: overrides the normaliser of the aggregation (tokens for "token-mean",
            sequences for "seq-mean-token-mean"), e.g. the whole mini-batch's count when the loss
            is computed per micro-batch and the gradients accumulated.
        generator: a CPU torch.Generator for random_fkl's draw. Without it a fresh generator is
            seeded with config.random_seed on every call, so the draw is a deterministic function
            of (random_seed, number of valid tokens): equal token counts give the same positions.
            Training loops should pass `step_generator(seed, iteration, step, rank, micro_batch)`.
        candidate_ids: [N, m] / [B, T, m] long, the student's top-k ids per token (-1 filler), for
            variants with `topk_rkl` (eopd_topk_rkl); ignored by the others.
        candidate_logprobs: the same shape, the teacher's log-probs at those ids (NaN at filler).

    Returns:
        `(loss, metrics)`: a 0-dim tensor (an exact, differentiable 0 when no token is valid) and
        a dict of Python floats (keys `METRIC_KEYS`, plus `student_entropy` / `topk_overlap`).
    """
    if student_logits.dim() not in (2, 3):
        raise ValueError(f"student_logits must be [N, V] or [B, T, V], got {tuple(student_logits.shape)}")
    vocab = student_logits.shape[-1]
    tokens = _flatten_tokens(tuple(student_logits.shape[:-1]), sampled_ids, old_logprobs, teacher_logprobs,
                             teacher_entropy, teacher_topk_ids, teacher_topk_logprobs, mask, seq_index,
                             candidate_ids, candidate_logprobs)
    logits = student_logits.reshape(-1, vocab)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return _objective(tokens, config, {"logits": logits}, vocab, dtype, denominator, generator)


def compute_loss_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    sampled_ids: Tensor,
    old_logprobs: Tensor,
    teacher_logprobs: Tensor,
    teacher_entropy: Tensor,
    teacher_topk_ids: Tensor,
    teacher_topk_logprobs: Tensor,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    config: LossConfig = DEFAULT_CONFIG,
    *,
    seq_index: Tensor | None = None,
    denominator: float | None = None,
    generator: torch.Generator | None = None,
    candidate_ids: Tensor | None = None,
    candidate_logprobs: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The same loss from final hidden states and the output projection; logits never materialised.

    Logits are `hidden @ weight.T + bias`, computed one chunk of `config.chunk_size` valid tokens
    at a time in forward and recomputed in backward, so peak memory is a few `[chunk_size, V]`
    buffers plus the `[V, D]` weight gradient. Gradients flow to `hidden`, `weight` and `bias`.

    Args:
        hidden: [N, D] or [B, T, D] final hidden states at the positions that predict each token.
        weight: [V, D] output projection (lm_head) weight.
        bias: [V] or None.
        (the rest as in `compute_loss`.)
    """
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, D] or [B, T, D], got {tuple(hidden.shape)}")
    vocab = weight.shape[0]
    tokens = _flatten_tokens(tuple(hidden.shape[:-1]), sampled_ids, old_logprobs, teacher_logprobs,
                             teacher_entropy, teacher_topk_ids, teacher_topk_logprobs, mask, seq_index,
                             candidate_ids, candidate_logprobs)
    h = hidden.reshape(-1, hidden.shape[-1])
    dtype = torch.float64 if torch.promote_types(h.dtype, weight.dtype) == torch.float64 else torch.float32
    return _objective(tokens, config, {"hidden": h, "weight": weight, "bias": bias}, vocab, dtype,
                      denominator, generator)
