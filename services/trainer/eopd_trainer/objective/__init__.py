r"""The EOPD objective and its baselines as pure tensor functions (paper sec. 2.3, 4, 5.3-5.6, app. A).

    from eopd_trainer.objective import LossConfig, LossInputs, compute_loss
    inputs = LossInputs(sampled_ids, old_logprobs, teacher_logprobs, teacher_entropies,
                        teacher_topk_ids, teacher_topk_logprobs, mask)
    loss, metrics = compute_loss(student_logits, inputs, config=LossConfig(variant="eopd"))

Shapes (flat form; a batched [B, T, ...] form with a [B, T] mask is accepted too). The per-token
fields are those of `LossInputs` (`inputs.py`), the one type `batching.pack_rollouts` builds:

    student_logits          [N, V]  student logits at the N response positions of a mini-batch
    sampled_ids             [N]     token x_t sampled by the behaviour policy pi_old (kd/gkd: or the teacher)
    old_logprobs            [N]     log pi_old(x_t)
    teacher_logprobs        [N]     log pi_te(x_t)
    teacher_entropies       [N]     H_te,t = -sum_v pi_te(v) log pi_te(v)   (full vocabulary)
    teacher_topk_ids        [N, k]  S_t^k, the teacher's top-k ids
    teacher_topk_logprobs   [N, k]  log pi_te(v), v in S_t^k (full-vocabulary normalisation)
    mask                    [N]     valid (response, non-padding) tokens
    seq_index               [N]     the sequence of each token (flat form, "seq-mean-token-mean")
    candidate_ids           [N, m]  the student's top-m ids (eopd_topk_rkl), candidate_logprobs the teacher's there
    advantages              [N]     per-token advantages, for variants with advantages_from "given" (grpo)

Maths, per valid token t (log pi_theta is the student's full-vocabulary log-softmax of logits / T):

    A_t    = log pi_te(x_t) - log pi_old(x_t)                              (detached)
    r_t    = exp(log pi_theta(x_t) - log pi_old(x_t))
    OPD_t  = max(-r_t A_t, -clip(r_t, 1 - clip_low, 1 + clip_high) A_t)   (eq. 7)
    p~_t   = softmax over S_t^k of the teacher's top-k log-probs           (renormalised)
    FKL_t  = sum_{v in S_t^k} p~_t(v) (log p~_t(v) - log pi_theta(v))       (eq. 11; not renormalised
                                                                             on the student side)
    EOPD_t = OPD_t + alpha * 1[H_te,t >= tau] * FKL_t                       (eq. 9; gate="gt": >)

Aggregation ("token-mean", Algorithm 1): `L = sum_t w_t EOPD_t` with `w_t = 1 / #valid tokens`,
the same weight for both terms (the FKL is *not* averaged over the gated tokens only).
"seq-mean-token-mean" averages within each sequence, then over sequences. The baselines (opd,
opd_fkl, full_fkl, random_fkl, entropy_bonus, advantage_shaping, kd, gkd, grpo) are registered by
name in `variants`; see its table. The paper's other baselines (app. A, sec. 5.5):

    KD_t   = ce_weight * (-log pi_theta(x_t)) + kl_weight * FKL_t   on teacher-generated responses
    GKD_t  = FKL_t    on a mix: share gkd_lambda student samples, the rest teacher-generated
    GRPO_t = max(-r_t A_t, -clip(r_t) A_t) with A_t the caller's `advantages` (no teacher scores):
             group_advantages(rewards, group_ids, grpo_eps) = (R - mean_g) / (std_g + eps),
             std_g Bessel-corrected as in TRL's GRPOTrainer, repeated over each response's tokens.

kd and gkd take no old log-probs (`old_logprobs=None` is accepted: no ratio, no clip); grpo's four
teacher inputs may be None and are never read; the variant's `teacher_share` says which share of
responses the data path has the teacher generate. `eopd_rkl` (beyond the paper, issue 48) replaces
OPD_t by the exact reverse KL over `support` (the teacher's top-k or the student's top-k, each with
the mass outside as one more outcome, or the full vocabulary from `LossInputs.teacher_logits`);
`eopd_topk_rkl` is it over the student's top-k ids (`LossInputs.candidate_ids` /
`candidate_logprobs [N, m]`: the teacher's log-probs at them, from per-position candidate scoring).
gkd takes TRL's generalized JSD with `gkd_beta` over `support` (`dense.py`).

Randomness: `random_fkl` draws its positions from the `generator` argument. Without one the draw
is a deterministic function of (config.random_seed, number of valid tokens), i.e. the same
positions on every call with the same token count; a training loop should pass
`step_generator(seed, iteration, step, rank, micro_batch)` (stable hash of the keys).

Memory: all vocabulary-sized work is done chunk by chunk over tokens (`config.chunk_size`), with
an analytic backward that recomputes each chunk (`vocab`), so nothing of size [N, V] is created
beyond the gradient of the logits themselves, and one [chunk_size, V] fp32 work buffer is alive at
a time (two in backward when the student entropy is differentiated); `compute_loss_from_hidden` takes final hidden states
[N, D] and the output projection [V, D] and never builds [N, V] logits at all; by default
(`fused_backward`) it computes the gradients w.r.t. hidden and lm_head inside the forward chunk loop
(`fused`: three matmuls per chunk, no recomputation in backward, two [chunk_size, V] buffers). The student's
log-probs at the teacher's top-k are gathered only at the tokens where the FKL is applied (and at
gated tokens for the `fkl_gated_mean` metric): [G, k] values, G the number of those tokens.

Edge cases: masked inputs are never read; no valid token gives an exact 0 loss that still has a
gradient (of zeros); -inf teacher top-k log-probs get zero mass (a row of only -inf has FKL 0);
k = 1 makes p~ one-hot; `eopd` with alpha = 0 builds exactly the `opd` graph.
"""

import importlib

from .config import LossConfig
from .variants import VARIANTS, PositionContext, Variant, get_variant, register_variant

# The tensor functions are imported on first use (PEP 562): the configuration and the variants'
# registry above import without torch, so a process that only loads a run's config (`eopd run`'s
# supervisor, `eopd report`) does not pay torch's import. `from eopd_trainer.objective import
# compute_loss` works as before.
_LAZY = {
    "LossInputs": "inputs",
    "compute_loss": "loss",
    "compute_loss_from_hidden": "loss",
    "METRIC_KEYS": "loss",
    "full_vocab_divergence": "dense",
    "generalized_jsd": "dense",
    "support_divergence": "dense",
    "step_generator": "rng",
    "step_seed": "rng",
    "aggregation_weights": "terms",
    "clipped_pg_loss": "terms",
    "group_advantages": "terms",
    "shaped_advantages": "terms",
    "topk_forward_kl": "terms",
    "VocabPlan": "vocab",
    "vocab_stats": "vocab",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LossConfig",
    "LossInputs",
    "compute_loss",
    "compute_loss_from_hidden",
    "METRIC_KEYS",
    "VARIANTS",
    "Variant",
    "PositionContext",
    "register_variant",
    "get_variant",
    "clipped_pg_loss",
    "topk_forward_kl",
    "full_vocab_divergence",
    "generalized_jsd",
    "support_divergence",
    "shaped_advantages",
    "group_advantages",
    "aggregation_weights",
    "VocabPlan",
    "vocab_stats",
    "step_generator",
    "step_seed",
]
