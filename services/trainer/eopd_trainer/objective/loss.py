"""`compute_loss` and `compute_loss_from_hidden`: the loss of every variant, with its metrics.

The flow is the same for both entry points:

1. select the M valid tokens (mask), and the per-token teacher/behaviour inputs there (only those
   the variant reads: `LossInputs.flatten`; grpo reads no teacher scores, kd/gkd no old log-probs);
2. choose the FKL positions of the variant (entropy gate, all, random, none) *before* touching the
   vocabulary, so the student's log-probs at the teacher's top-k are gathered only where needed;
3. one chunked vocabulary pass (`vocab.vocab_stats`): log-prob of the sampled token, student
   entropy, log-probs at the teacher's top-k of the gathered tokens;
4. the per-token quantities the terms read (`loss_terms.TermInputs`): aggregation weights,
   advantages (shaped or given), the FKL at the gathered tokens;
5. the variant's weighted terms (`Variant.weighted_terms`: `loss_terms` objects on these small
   tensors) added up in order; kd's CE term is `-logp` of the sampled (teacher) token from step 3,
   so it costs no extra vocabulary work;
6. the metrics measured beside the terms (ratio, advantages, teacher, student entropy, overlap).

From hidden states with `fused_backward` (the default), steps 3-5 run fused (`fused.py`): each
chunk's terms are evaluated right after its statistics and their gradient pushed through to the
hidden states and lm_head in the same loop; the terms' values and metrics are then evaluated once
more without grad on the detached statistics.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import LossConfig
from .inputs import LossInputs, candidates, check_valid_inputs
from .dense import full_vocab_divergence, full_vocab_divergence_from_hidden
from .loss_terms import Divergence, ForwardKL, TermInputs, mean_or_zero
from .terms import aggregation_weights, shaped_advantages, topk_forward_kl
from .variants import PositionContext, get_variant
from .fused import fused_hidden_loss
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
    "divergence_loss",
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


#: The order of the metrics dict.
_METRIC_ORDER = (
    "loss", "pg_loss", "fkl_loss", "entropy_loss", "topk_rkl_loss", "divergence_loss", "ce", "fkl_ratio", "n_tokens",
    "clip_frac", "ratio_mean", "approx_kl", "approx_kl_k3", "advantage_mean", "advantage_shaped_mean",
    "gate_ratio", "fkl_gated_mean", "teacher_entropy", "teacher_topk_mass", "student_entropy",
    "student_candidate_mass", "topk_overlap",
)


@dataclass(frozen=True)
class _Valid:
    """Step 1: the M valid tokens and the inputs the variant reads there (compute dtype, detached)."""

    rows: Tensor  # [M] indices of the valid tokens
    sampled: Tensor  # [M] long
    old: Tensor | None  # [M]; None only without a pg term
    given_adv: Tensor | None  # [M]; advantages_from == "given"
    has_teacher: bool
    teacher_lp: Tensor | None  # [M]
    teacher_ent_in: Tensor | None  # [M] in its own dtype: the gate is decided on it
    teacher_ent: Tensor | None  # [M]
    topk_ids: Tensor  # [M, k] long (k = 0 without teacher scores); -inf entries' ids made 0
    topk_lp: Tensor  # [M, k]
    topk_finite: Tensor  # [M, k] bool; -inf entries carry no teacher mass

    @property
    def m(self) -> int:
        return self.rows.numel()


def _select_valid(tokens: LossInputs, variant, vocab: int, dtype: torch.dtype) -> _Valid:
    """Step 1: select the valid tokens, cast what the variant reads, check it (one sync)."""
    valid = tokens.mask.nonzero().squeeze(1)  # [M]
    m = valid.numel()
    sampled = tokens.sampled_ids[valid].long()

    def at_valid(x: Tensor | None) -> Tensor | None:
        return None if x is None else x[valid].detach().to(dtype)

    old = at_valid(tokens.old_logprobs)
    given_adv = at_valid(tokens.advantages)
    has_teacher = variant.needs_teacher_scores
    if has_teacher:
        t_lp = at_valid(tokens.teacher_logprobs)
        t_ent_in = tokens.teacher_entropies[valid].detach()
        t_ent = t_ent_in.to(dtype)
        t_ids = tokens.teacher_topk_ids[valid].long()
        t_tlp = at_valid(tokens.teacher_topk_logprobs)
        t_finite = torch.isfinite(t_tlp)
    else:  # no teacher scores (grpo): nothing of the teacher is read; no gate, no top-k
        t_lp = t_ent_in = t_ent = None
        t_ids = torch.zeros(m, 0, dtype=torch.long, device=valid.device)
        t_tlp = torch.zeros(m, 0, dtype=dtype, device=valid.device)
        t_finite = torch.zeros(m, 0, dtype=torch.bool, device=valid.device)
    check_valid_inputs(vocab, dtype, sampled=sampled,
                       per_token={"old_logprobs": old, "teacher_logprobs": t_lp, "teacher_entropies": t_ent,
                                  "advantages": given_adv},
                       topk_ids=t_ids if has_teacher else None, topk_logprobs=t_tlp if has_teacher else None,
                       topk_finite=t_finite)
    t_ids = torch.where(t_finite, t_ids, 0)  # ids of -inf entries are never used: make them safe
    return _Valid(valid, sampled, old, given_adv, has_teacher, t_lp, t_ent_in, t_ent, t_ids, t_tlp, t_finite)


@dataclass(frozen=True)
class _Positions:
    """Step 2: where the FKL applies and which rows' teacher top-k (and candidates) are gathered."""

    gate: Tensor  # [M] bool
    fkl: Tensor | None  # [M] bool; None: the variant applies no FKL
    apply_fkl: bool  # the FKL term is part of the loss (its weight is not 0)
    gather_pos: Tensor  # [G]
    gather_ids: Tensor  # [G, k] (+ m candidate columns for a top-k RKL variant)
    cand: tuple[Tensor, Tensor, Tensor] | None  # candidates(): ids, teacher log-probs, ok


def _choose_positions(v: _Valid, tokens: LossInputs, variant, cfg: LossConfig, has_fkl_term: bool, vocab: int,
                      dtype: torch.dtype, generator: torch.Generator | None) -> _Positions:
    """Step 2: positions of the FKL, before the vocabulary pass. The gate compares the teacher
    entropy in the dtype it was given (tau rounded to that dtype), not after the cast to the compute
    dtype: an fp64 entropy just below tau must not round up to tau in fp32."""
    if v.has_teacher:
        gate = v.teacher_ent_in >= cfg.tau if cfg.gate == "ge" else v.teacher_ent_in > cfg.tau
    else:
        gate = torch.zeros(v.m, dtype=torch.bool, device=v.rows.device)
    if generator is None:  # deterministic in (random_seed, M): see step_generator for training loops
        generator = torch.Generator().manual_seed(cfg.random_seed)
    fkl = variant.fkl_positions(PositionContext(gate=gate, config=cfg, generator=generator))
    apply_fkl = fkl is not None and has_fkl_term
    gathered = (gate | fkl) if apply_fkl else gate  # gated rows are gathered for the metric
    cand = candidates(variant, tokens, v.rows, vocab, dtype, cfg)
    if cand is not None or variant.support(cfg) == "teacher_topk":
        # a divergence over a top-k support reads it at every row: gather the teacher's top-k there too
        gathered = torch.ones_like(gate)
    gather_pos = gathered.nonzero().squeeze(1)  # [G]
    gather_ids = v.topk_ids[gather_pos] if cand is None else torch.cat([v.topk_ids, cand[0]], dim=1)
    return _Positions(gate, fkl, apply_fkl, gather_pos, gather_ids, cand)


def _plan(v: _Valid, p: _Positions, cfg: LossConfig, need_entropy: bool, vocab: int) -> VocabPlan:
    """Step 3's plan: the rows, sampled ids and gathered ids of the vocabulary pass."""
    return VocabPlan(
        rows=v.rows,
        sampled=v.sampled,
        gather_pos=p.gather_pos,
        gather_ids=p.gather_ids,
        temperature=cfg.temperature,
        chunk_size=cfg.chunk_size,
        entropy=need_entropy,
        student_topk=min(v.topk_ids.shape[1], vocab) if cfg.vocab_metrics else 0,
    )


def _split_gathered(v: _Valid, p: _Positions, logp_gathered: Tensor) -> tuple[Tensor, Tensor | None]:
    """The gathered log-probs split into the teacher's top-k columns and the candidates' (if any)."""
    if p.cand is None:
        return logp_gathered, None
    k = v.topk_ids.shape[1]
    return logp_gathered[:, :k], logp_gathered[:, k:]


def _advantages(v: _Valid, variant) -> Tensor | None:
    """The unshaped advantage: given (grpo) or teacher - old (None without old log-probs)."""
    if variant.advantages_from == "given":
        return v.given_adv
    return v.teacher_lp - v.old if v.old is not None else None


def _support(v: _Valid, p: _Positions, variant, cfg: LossConfig, gather_pos: Tensor, logp_topk: Tensor,
             logp_cand: Tensor | None, cut) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The student's and teacher's log-probs at the divergence's top-k support and which entries are
    real: the candidates (student_topk) or the teacher's top-k (teacher_topk, gathered at every row)."""
    support = variant.support(cfg)
    if support == "student_topk":
        return logp_cand, cut(p.cand[1]), cut(p.cand[2])
    if support == "teacher_topk":
        return logp_topk, v.topk_lp[gather_pos], v.topk_finite[gather_pos]
    return None, None, None


def _term_inputs(v: _Valid, p: _Positions, variant, cfg: LossConfig, w: Tensor, adv: Tensor | None,
                 logp: Tensor, s_ent: Tensor, logp_topk: Tensor, logp_cand: Tensor | None,
                 rows: tuple[int, int, int, int] | None = None) -> TermInputs:
    """Step 4: the per-token quantities the terms read (the advantage shaped or not, the FKL at the
    gathered rows), for all M valid tokens, or for valid tokens m0..m1 and gathered rows g0..g1
    when `rows = (m0, m1, g0, g1)` (a chunk of the fused hidden-state pass: the loss is a sum of
    per-token terms whose weights `w` are fixed beforehand, so a chunk's rows make its loss)."""
    m0, m1, g0, g1 = rows if rows is not None else (0, v.m, 0, p.gather_pos.numel())
    cut = (lambda t: None if t is None else t[m0:m1]) if rows is not None else (lambda t: t)
    gather_pos = p.gather_pos[g0:g1]
    adv_used = cut(adv)
    if variant.shape_advantage and adv_used is not None:
        adv_used = shaped_advantages(adv_used, s_ent, cfg.shaping_alpha, cfg.shaping_kappa)
    s_student, s_teacher, s_ok = _support(v, p, variant, cfg, gather_pos, logp_topk, logp_cand, cut)
    return TermInputs(
        weights=cut(w), logp=logp, student_entropy=s_ent, old_logprobs=cut(v.old), advantages=adv_used,
        fkl_positions=cut(p.fkl), gather_pos=gather_pos - m0,
        fkl_gathered=topk_forward_kl(logp_topk, v.topk_lp[gather_pos]),  # [G]
        support_student=s_student, support_teacher=s_teacher, support_ok=s_ok,
    )


def _add_terms(weighted_terms, x: TermInputs, cfg: LossConfig) -> tuple[Tensor, dict[str, Tensor]]:
    """Step 5: `sum weight * term` in the variant's order; each term's weighted value and metrics."""
    zero = x.weights.new_zeros(())
    values = {"pg_loss": zero, "fkl_loss": zero, "entropy_loss": zero, "topk_rkl_loss": zero, "divergence_loss": zero}
    loss = None
    for weight, term in weighted_terms:
        total, metrics = term(x, cfg)
        part = weight * total
        loss = part if loss is None else loss + part
        if term.key is not None:
            values[term.key] = part
        values.update(metrics)
    if loss is None:  # a variant whose terms are all switched off by the config (e.g. its FKL weight is 0):
        loss = x.logp[:0].sum()  # an exact 0 that is part of the graph (zero gradient), like no token
    return loss, values


def _diagnostics(v: _Valid, p: _Positions, x: TermInputs, adv: Tensor | None, s_topk: Tensor,
                 need_entropy: bool, cfg: LossConfig, dtype: torch.dtype) -> dict[str, Tensor]:
    """Step 6: the metrics measured beside the terms (no grad)."""
    logp, old = x.logp, v.old
    out = {"ce": mean_or_zero(-logp), "fkl_ratio": x.weights.new_zeros(()),
           "n_tokens": torch.tensor(float(v.m), dtype=dtype, device=x.weights.device)}
    if old is not None:  # the behaviour policy's ratio (absent for kd / gkd without old_logprobs)
        ratio = torch.exp(logp - old)
        out.update({
            "clip_frac": mean_or_zero(torch.zeros_like(ratio)),  # the pg term's, when there is one
            "ratio_mean": mean_or_zero(ratio),
            "approx_kl": mean_or_zero(old - logp),
            "approx_kl_k3": mean_or_zero(ratio - 1.0 - (logp - old)),
        })
    if adv is not None:
        out.update({"advantage_mean": mean_or_zero(adv), "advantage_shaped_mean": mean_or_zero(x.advantages)})
    if v.has_teacher:  # measured on the teacher's scores (absent for grpo)
        gated_rows = p.gate[p.gather_pos]
        out.update({
            "gate_ratio": mean_or_zero(p.gate.to(dtype)),
            "fkl_gated_mean": mean_or_zero(x.fkl_gathered[gated_rows]),
            "teacher_entropy": mean_or_zero(v.teacher_ent),
            "teacher_topk_mass": mean_or_zero(torch.where(v.topk_finite, v.topk_lp.exp(), 0.0).sum(dim=1)),
        })
    if need_entropy:
        out["student_entropy"] = mean_or_zero(x.student_entropy)
    if cfg.vocab_metrics and v.has_teacher:
        # share of the teacher's candidates (its finite top-k entries) in the student's top-k;
        # rows with no finite teacher entry have no candidate and are left out of the mean
        hit = (s_topk[:, :, None] == v.topk_ids[:, None, :]) & v.topk_finite[:, None, :]  # [M, s, k]
        n_cand = v.topk_finite.sum(dim=1)
        has = n_cand > 0
        out["topk_overlap"] = mean_or_zero(hit.any(dim=1).sum(dim=1)[has].to(dtype) / n_cand[has].to(dtype))
    return out


def _dense(v: _Valid, tokens: LossInputs, source: dict, cfg: LossConfig, beta: float) -> Tensor:
    """`[M]` divergence over the full vocabulary at the valid tokens (`dense.full_vocab_divergence`):
    the student's rows from its logits or from `hidden @ weight.T + bias`, the teacher's from
    `tokens.teacher_logits` (a tensor, detached, or a function of the rows), one chunk at a time."""
    rows = v.rows
    t = tokens.teacher_logits
    if "logits" in source and v.m == source["logits"].shape[0]:
        # Every token valid (rows = 0..N-1): the logits themselves, a view per chunk, and the teacher's
        # rows by position; `full_vocab_divergence` then keeps no copy of either for backward.
        return full_vocab_divergence(source["logits"], t.detach() if isinstance(t, Tensor) else t, beta, num_rows=v.m,
                                     chunk_size=cfg.chunk_size, temperature=cfg.temperature, teacher_requires_grad=False)

    def teacher(a: int, b: int) -> Tensor:
        return t[rows[a:b]].detach() if isinstance(t, Tensor) else t(rows[a:b]).detach()

    if "logits" in source:
        logits = source["logits"]

        def student(a: int, b: int) -> Tensor:
            return logits[rows[a:b]]
    else:
        hidden, weight, bias = source["hidden"], source["weight"], source["bias"]
        if beta in (0.0, 1.0):  # the learner's fused path: the projection inside, [M, d] rows kept
            return full_vocab_divergence_from_hidden(hidden[rows], weight, bias, teacher, beta,
                                                     chunk_size=cfg.chunk_size, temperature=cfg.temperature)

        def student(a: int, b: int) -> Tensor:
            z = hidden[rows[a:b]] @ weight.T
            return z if bias is None else z + bias

    return full_vocab_divergence(student, teacher, beta, num_rows=v.m, chunk_size=cfg.chunk_size,
                                 temperature=cfg.temperature)


def _objective(tokens: LossInputs, cfg: LossConfig, source: dict, vocab: int, dtype: torch.dtype,
               denominator: float | None, generator: torch.Generator | None) -> tuple[Tensor, dict[str, float]]:
    """The loss core, the same for both sources: the steps of the module docstring."""
    variant = get_variant(cfg.variant)
    weighted_terms = variant.weighted_terms(cfg)
    v = _select_valid(tokens, variant, vocab, dtype)  # 1
    has_fkl_term = any(isinstance(t, ForwardKL) for _, t in weighted_terms)
    p = _choose_positions(v, tokens, variant, cfg, has_fkl_term, vocab, dtype, generator)  # 2
    if not p.apply_fkl:
        weighted_terms = tuple((w, t) for w, t in weighted_terms if not isinstance(t, ForwardKL))
    need_entropy = (any("student_entropy" in t.reads for _, t in weighted_terms) or variant.shape_advantage
                    or cfg.vocab_metrics)
    plan = _plan(v, p, cfg, need_entropy, vocab)
    w = aggregation_weights(
        cfg.aggregation, v.m, None if tokens.seq_index is None else tokens.seq_index[v.rows],
        denominator, device=v.rows.device, dtype=dtype, sum_divisor=cfg.sum_divisor,
    )
    adv = _advantages(v, variant)
    # a divergence over the full vocabulary is its own chunked pass (dense.py), outside the fused loop
    dense_terms = tuple((wt, t) for wt, t in weighted_terms if isinstance(t, Divergence) and t.support == "full")
    weighted_terms = tuple((wt, t) for wt, t in weighted_terms if (wt, t) not in dense_terms)
    if "hidden" in source and cfg.fused_backward:  # 3-5 fused: gradients in the forward chunk loop
        def chunk_loss(m0, m1, g0, g1, ls, ent, lg):
            lg_topk, lg_cand = _split_gathered(v, p, lg)
            x = _term_inputs(v, p, variant, cfg, w, adv, ls, ent, lg_topk, lg_cand, rows=(m0, m1, g0, g1))
            return _add_terms(weighted_terms, x, cfg)[0]

        loss, logp, s_ent, logp_g, s_topk = fused_hidden_loss(plan, chunk_loss, **source)
        with torch.no_grad():  # the terms' values and metrics, from the (detached) statistics
            x = _term_inputs(v, p, variant, cfg, w, adv, logp, s_ent, *_split_gathered(v, p, logp_g))
            term_values = _add_terms(weighted_terms, x, cfg)[1]
    else:
        logp, s_ent, logp_g, s_topk = vocab_stats(plan, **source)  # 3
        x = _term_inputs(v, p, variant, cfg, w, adv, logp, s_ent, *_split_gathered(v, p, logp_g))  # 4
        loss, term_values = _add_terms(weighted_terms, x, cfg)  # 5
    for weight, term in dense_terms:  # after the vocabulary pass: its own chunked pass, plain autograd
        part = weight * term(dataclasses.replace(x, dense_divergence=_dense(v, tokens, source, cfg, term.beta)),
                             cfg)[0]
        loss = loss + part
        term_values[term.key] = part
    with torch.no_grad():  # 6
        values = {"loss": loss, **_diagnostics(v, p, x, adv, s_topk, need_entropy, cfg, dtype), **term_values}
        values = {key: values[key] for key in _METRIC_ORDER if key in values}
        floats = torch.stack([t.detach().to(torch.float64).reshape(()) for t in values.values()]).tolist()
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
            sequences for "seq-mean-token-mean", `sum_divisor` for "token-sum"), e.g. the whole
            mini-batch's count when the loss is computed per micro-batch and the gradients accumulated.
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
    tokens = inputs.flatten(get_variant(config.variant), tuple(student_logits.shape[:-1]), config)
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
    tokens = inputs.flatten(get_variant(config.variant), tuple(hidden.shape[:-1]), config)
    h = hidden.reshape(-1, hidden.shape[-1])
    dtype = torch.float64 if torch.promote_types(h.dtype, weight.dtype) == torch.float64 else torch.float32
    return _objective(tokens, config, {"hidden": h, "weight": weight, "bias": bias}, vocab, dtype,
                      denominator, generator)
