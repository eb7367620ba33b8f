"""The loss's terms as small objects: each declares the per-token quantities it reads and returns
its weighted token sum with its own metrics. A variant is its FKL positions plus weighted terms
(`Variant.weighted_terms`); the loss core (`loss.py`) adds up `weight * term` in the variant's order.

Every term reads `TermInputs`, the per-token quantities the core computes once (after the vocabulary
pass): all `[M]` (valid tokens) or `[G]` (tokens whose teacher top-k was gathered), nothing of
vocabulary size. A term returns `sum_t w_t * term_t` (unweighted by its coefficient) and a dict of
metric tensors (detached); the maths per token is in `terms.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from .params import LossParams
from .terms import clipped_pg_loss, topk_reverse_kl



def mean_or_zero(x: Tensor) -> Tensor:
    """The mean, or an exact 0 for an empty tensor."""
    return x.mean() if x.numel() else x.new_zeros(())


@dataclass(frozen=True)
class TermInputs:
    """Per-token quantities the terms may read (None where the variant does not compute them).

    weights            [M]     aggregation weights w_t (`terms.aggregation_weights`)
    logp               [M]     log pi_theta(x_t), the student's log-prob of the sampled token (grad)
    student_entropy    [M]     H_student,t (grad); zeros unless a term, the shaping or the metrics need it
    old_logprobs       [M]     log pi_old(x_t), detached; None without them (kd, gkd)
    advantages         [M]     the advantage the policy gradient uses (shaped for advantage_shaping), detached
    fkl_positions      [M]     bool, where the variant applies the forward KL; None: nowhere
    gather_pos         [G]     the rows whose teacher top-k was gathered (FKL positions and gated rows)
    fkl_gathered       [G]     FKL_t at those rows (grad): `terms.topk_forward_kl`
    candidate_logp     [M, m]  the student's log-probs at the per-position candidates (grad; eopd_topk_rkl)
    candidate_teacher  [M, m]  the teacher's log-probs there
    candidate_ok       [M, m]  bool, real candidates with a finite teacher log-prob
    """

    weights: Tensor
    logp: Tensor
    student_entropy: Tensor
    old_logprobs: Tensor | None
    advantages: Tensor | None
    fkl_positions: Tensor | None
    gather_pos: Tensor
    fkl_gathered: Tensor
    candidate_logp: Tensor | None = None
    candidate_teacher: Tensor | None = None
    candidate_ok: Tensor | None = None


@dataclass(frozen=True)
class PolicyGradient:
    """max(-r A, -clip(r) A) (paper eq. 7), r = exp(logp - old_logprobs)."""

    key: ClassVar[str] = "pg_loss"
    reads: ClassVar[tuple[str, ...]] = ("weights", "logp", "old_logprobs", "advantages")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        pg_t, _, clipped = clipped_pg_loss(x.logp, x.old_logprobs, x.advantages, cfg.clip_low, cfg.clip_high)
        return (x.weights * pg_t).sum(), {"clip_frac": mean_or_zero(clipped.to(x.weights.dtype))}


@dataclass(frozen=True)
class TopkReverseKL:
    """The reverse KL summed exactly over the student's top-k candidates (eopd_topk_rkl)."""

    key: ClassVar[str] = "topk_rkl_loss"
    reads: ClassVar[tuple[str, ...]] = ("weights", "candidate_logp", "candidate_teacher", "candidate_ok")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        rkl_t = topk_reverse_kl(x.candidate_logp, x.candidate_teacher, x.candidate_ok)  # [M]
        with torch.no_grad():
            mass = mean_or_zero(torch.where(x.candidate_ok, x.candidate_logp.exp(), 0.0).sum(dim=1))
        return (x.weights * rkl_t).sum(), {"student_candidate_mass": mass}


@dataclass(frozen=True)
class ForwardKL:
    """FKL over the teacher's renormalised top-k (paper eq. 11) at the variant's positions."""

    key: ClassVar[str] = "fkl_loss"
    reads: ClassVar[tuple[str, ...]] = ("weights", "fkl_positions", "gather_pos", "fkl_gathered")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        dtype = x.weights.dtype
        w_fkl = x.weights[x.gather_pos] * x.fkl_positions[x.gather_pos].to(dtype)
        return (w_fkl * x.fkl_gathered).sum(), {"fkl_ratio": mean_or_zero(x.fkl_positions.to(dtype))}


@dataclass(frozen=True)
class StudentEntropy:
    """H_student,t (entropy_bonus weighs it by -entropy_coef)."""

    key: ClassVar[str] = "entropy_loss"
    reads: ClassVar[tuple[str, ...]] = ("weights", "student_entropy")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        return (x.weights * x.student_entropy).sum(), {}


@dataclass(frozen=True)
class CrossEntropy:
    """-log pi_theta(x_t) of the sampled token (kd on the teacher's tokens); not reported on its
    own: the `ce` metric is its mean over the valid tokens, whatever the variant."""

    key: ClassVar[str | None] = None
    reads: ClassVar[tuple[str, ...]] = ("weights", "logp")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        return (x.weights * -x.logp).sum(), {}


LossTerm = PolicyGradient | TopkReverseKL | ForwardKL | StudentEntropy | CrossEntropy
