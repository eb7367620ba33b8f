"""`compute_loss` and `compute_loss_from_hidden`: the loss of every variant, with its metrics.

The flow is the same for both entry points:

1. select the M valid tokens (mask), and the per-token teacher/behaviour inputs there (only those
   the variant reads: `LossInputs.flatten`; grpo reads no teacher scores, kd/gkd no old log-probs);
2. choose the FKL positions of the variant (entropy gate, all, random, none) *before* touching the
   vocabulary, so the student's log-probs at the teacher's top-k are gathered only where needed;
3. one chunked vocabulary pass (`vocab.vocab_stats`): log-prob of the sampled token, student
   entropy, log-probs at the teacher's top-k of the gathered tokens;
4. per-token terms (`terms`) on these small tensors, aggregated with explicit weights; kd's CE term
   is `-logp` of the sampled (teacher) token from step 3, so it costs no extra vocabulary work.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .config import LossConfig
from .inputs import LossInputs, candidates, check_valid_inputs
from .terms import aggregation_weights, clipped_pg_loss, shaped_advantages, topk_forward_kl, topk_reverse_kl
from .variants import PositionContext, get_variant
from .vocab import VocabPlan, vocab_stats

DEFAULT_CONFIG = LossConfig()

#: Keys of the metrics dict. Present for every variant that takes the inputs they are measured on:
#: clip_frac, ratio_mean, approx_kl* need old_logprobs (kd / gkd may omit them), advantage_* an
#: advantage, gate_ratio, fkl_gated_mean, teacher_* the teacher's scores (grpo has none); absent
#: otherwise. student_entropy and topk_overlap (not listed) need vocab_metrics, or for
#: student_entropy a variant that uses it. `ce` is the mean of -log pi_theta(x_t) over the valid
#: tokens, whatever the variant (kd's loss adds ce_weight times it).
METRIC_KEYS = (
    "loss",
    "pg_loss",
    "fkl_loss",
    "entropy_loss",
    "topk_rkl_loss",
    "ce",
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


def _mean(x: Tensor) -> Tensor:
    return x.mean() if x.numel() else x.new_zeros(())


def _objective(tokens: LossInputs, cfg: LossConfig, source: dict, vocab: int, dtype: torch.dtype,
               denominator: float | None, generator: torch.Generator | None) -> tuple[Tensor, dict[str, float]]:
    variant = get_variant(cfg.variant)
    valid = tokens.mask.nonzero().squeeze(1)  # [M]
    m = valid.numel()
    sampled = tokens.sampled_ids[valid].long()

    def at_valid(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[valid].detach().to(dtype)

    old = at_valid(tokens.old_logprobs)  # None only without a pg term
    given_adv = at_valid(tokens.advantages)  # advantages_from == "given"
    has_teacher = variant.needs_teacher_scores
    if has_teacher:
        t_lp = at_valid(tokens.teacher_logprobs)
        t_ent_in = tokens.teacher_entropy[valid].detach()  # its own dtype: the gate is decided on it
        t_ent = t_ent_in.to(dtype)
        t_ids = tokens.teacher_topk_ids[valid].long()
        t_tlp = at_valid(tokens.teacher_topk_logprobs)
        t_finite = torch.isfinite(t_tlp)  # [M, k]; -inf entries carry no teacher mass
    else:  # no teacher scores (grpo): nothing of the teacher is read; no gate, no top-k
        t_lp = t_ent_in = t_ent = None
        t_ids = torch.zeros(m, 0, dtype=torch.long, device=valid.device)
        t_tlp = torch.zeros(m, 0, dtype=dtype, device=valid.device)
        t_finite = torch.zeros(m, 0, dtype=torch.bool, device=valid.device)
    k = t_ids.shape[1]
    check_valid_inputs(vocab, dtype, sampled=sampled,
                       per_token={"old_logprobs": old, "teacher_logprobs": t_lp, "teacher_entropy": t_ent,
                                  "advantages": given_adv},
                       topk_ids=t_ids if has_teacher else None, topk_logprobs=t_tlp if has_teacher else None,
                       topk_finite=t_finite)
    t_ids = torch.where(t_finite, t_ids, 0)  # ids of -inf entries are never used: make them safe

    # 2. positions of the FKL, before the vocabulary pass. The gate compares the teacher entropy in
    # the dtype it was given (tau rounded to that dtype), not after the cast to the compute dtype:
    # an fp64 entropy just below tau must not round up to tau in fp32.
    if has_teacher:
        gate = t_ent_in >= cfg.tau if cfg.gate == "ge" else t_ent_in > cfg.tau
    else:
        gate = torch.zeros(m, dtype=torch.bool, device=valid.device)
    if generator is None:  # deterministic in (random_seed, M): see step_generator for training loops
        generator = torch.Generator().manual_seed(cfg.random_seed)
    fkl_pos = variant.fkl_positions(PositionContext(gate=gate, config=cfg, generator=generator))
    fkl_coef = variant.fkl_coef(cfg) if fkl_pos is not None else 0.0
    apply_fkl = fkl_pos is not None and fkl_coef != 0.0
    gathered = (gate | fkl_pos) if apply_fkl else gate  # gated rows are gathered for the metric
    cand = candidates(variant, tokens, valid, vocab, dtype, cfg.variant)
    if cand is not None:  # the student's top-k is gathered at every row: gather the teacher's there too
        gathered = torch.ones_like(gate)
    gather_pos = gathered.nonzero().squeeze(1)  # [G]
    gather_ids = t_ids[gather_pos] if cand is None else torch.cat([t_ids, cand[0]], dim=1)

    # 3. one chunked pass over the vocabulary (the CE term is -logp of the sampled token: no extra pass).
    entropy_coef = variant.entropy_coef(cfg)
    ce_coef = variant.ce_coef(cfg)
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
    adv = given_adv if variant.advantages_from == "given" else (t_lp - old if old is not None else None)
    adv_used = adv
    if variant.shape_advantage and adv is not None:
        adv_used = shaped_advantages(adv, s_ent, cfg.shaping_alpha, cfg.shaping_kappa)
    if old is not None and variant.pg:
        pg_t, ratio, clipped = clipped_pg_loss(logp, old, adv_used, cfg.clip_low, cfg.clip_high)
    elif old is not None:  # no policy-gradient term (kd, gkd given old log-probs): the ratio is a metric, nothing is clipped
        ratio = torch.exp(logp.detach() - old)
        clipped = torch.zeros_like(ratio, dtype=torch.bool)
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
    if ce_coef != 0.0:
        terms.append(ce_coef * (w * -logp).sum())
    if terms:
        loss = terms[0]
        for t in terms[1:]:
            loss = loss + t
    else:  # a variant whose terms are all switched off by the config (e.g. its FKL weight is 0):
        loss = logp[:0].sum()  # an exact 0 that is part of the graph (zero gradient), like no token

    with torch.no_grad():
        values = {
            "loss": loss,
            "pg_loss": pg_loss,
            "fkl_loss": fkl_loss,
            "entropy_loss": entropy_loss,
            "topk_rkl_loss": rkl_loss,
            "ce": _mean(-logp),
            "fkl_ratio": _mean(fkl_pos.to(dtype)) if apply_fkl else zero,
            "n_tokens": torch.tensor(float(m), dtype=dtype, device=w.device),
        }
        if old is not None:  # the behaviour policy's ratio (absent for kd / gkd without old_logprobs)
            values.update({
                "clip_frac": _mean(clipped.to(dtype)),
                "ratio_mean": _mean(ratio),
                "approx_kl": _mean(old - logp),
                "approx_kl_k3": _mean(ratio - 1.0 - (logp - old)),
            })
        if adv is not None:
            values.update({"advantage_mean": _mean(adv), "advantage_shaped_mean": _mean(adv_used)})
        if has_teacher:  # measured on the teacher's scores (absent for grpo)
            values.update({
                "gate_ratio": _mean(gate.to(dtype)),
                "fkl_gated_mean": _mean(fkl_g[gate[gather_pos]]),
                "teacher_entropy": _mean(t_ent),
                "teacher_topk_mass": _mean(torch.where(t_finite, t_tlp.exp(), 0.0).sum(dim=1)),
            })
        if need_entropy:
            values["student_entropy"] = _mean(s_ent)
        if cand is not None:
            values["student_candidate_mass"] = _mean(torch.where(cand[2], logp_cand.exp(), 0.0).sum(dim=1))
        if cfg.vocab_metrics and has_teacher:
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
    inputs: LossInputs,
    config: LossConfig = DEFAULT_CONFIG,
    *,
    denominator: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The distillation loss from student logits, chunked over tokens.

    Flat form (tokens of a mini-batch at response positions) or batched form:

    Args:
        student_logits: [N, V] or [B, T, V], any float dtype (computed in fp32, fp64 kept).
        inputs: the per-token `LossInputs`, flat [N, ...] or batched [B, T, ...] like the logits
            (see `LossInputs` for each field's shape). `old_logprobs` may be None for a variant
            without a pg term (kd, gkd: no ratio, no clip; the ratio metrics are then absent); the
            four teacher fields may be None for a variant with `needs_teacher_scores` False (grpo),
            which never reads them; `candidate_ids` / `candidate_logprobs` are read by variants
            with `topk_rkl` (eopd_topk_rkl) only; `advantages` (detached here) are required by
            variants with `advantages_from == "given"` (grpo: `group_advantages` of the rewards,
            repeated over each response's tokens) and ignored by the others, which take
            A = teacher_logprobs - old_logprobs. `seq_index` is needed by "seq-mean-token-mean" in
            the flat form (implied by the batched form).
        config: a `LossConfig`.
        denominator: overrides the normaliser of the aggregation (tokens for "token-mean",
            sequences for "seq-mean-token-mean"), e.g. the whole mini-batch's count when the loss
            is computed per micro-batch and the gradients accumulated.
        generator: a CPU torch.Generator for random_fkl's draw. Without it a fresh generator is
            seeded with config.random_seed on every call, so the draw is a deterministic function
            of (random_seed, number of valid tokens): equal token counts give the same positions.
            Training loops should pass `step_generator(seed, iteration, step, rank, micro_batch)`.

    Returns:
        `(loss, metrics)`: a 0-dim tensor (an exact, differentiable 0 when no token is valid) and
        a dict of Python floats (keys `METRIC_KEYS`, plus `student_entropy` / `topk_overlap`).
    """
    if student_logits.dim() not in (2, 3):
        raise ValueError(f"student_logits must be [N, V] or [B, T, V], got {tuple(student_logits.shape)}")
    vocab = student_logits.shape[-1]
    tokens = inputs.flatten(get_variant(config.variant), tuple(student_logits.shape[:-1]))
    logits = student_logits.reshape(-1, vocab)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return _objective(tokens, config, {"logits": logits}, vocab, dtype, denominator, generator)


def compute_loss_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    inputs: LossInputs,
    bias: Tensor | None = None,
    config: LossConfig = DEFAULT_CONFIG,
    *,
    denominator: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The same loss from final hidden states and the output projection; logits never materialised.

    Logits are `hidden @ weight.T + bias`, computed one chunk of `config.chunk_size` valid tokens
    at a time in forward and recomputed in backward, so peak memory is a few `[chunk_size, V]`
    buffers plus the `[V, D]` weight gradient. Gradients flow to `hidden`, `weight` and `bias`.

    Args:
        hidden: [N, D] or [B, T, D] final hidden states at the positions that predict each token.
        weight: [V, D] output projection (lm_head) weight.
        inputs: the per-token `LossInputs`, in the form of `hidden` ([N, ...] or [B, T, ...]).
        bias: [V] or None.
        (the rest as in `compute_loss`.)
    """
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be [N, D] or [B, T, D], got {tuple(hidden.shape)}")
    vocab = weight.shape[0]
    tokens = inputs.flatten(get_variant(config.variant), tuple(hidden.shape[:-1]))
    h = hidden.reshape(-1, hidden.shape[-1])
    dtype = torch.float64 if torch.promote_types(h.dtype, weight.dtype) == torch.float64 else torch.float32
    return _objective(tokens, config, {"hidden": h, "weight": weight, "bias": bias}, vocab, dtype,
                      denominator, generator)
