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

from .dense import support_divergence
from .params import LossParams
from .terms import clipped_pg_loss



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
    support_student    [M, s]  the student's log-probs at the divergence's support ids (grad): the
                               per-position candidates (student_topk) or the teacher's top-k (teacher_topk)
    support_teacher    [M, s]  the teacher's log-probs there
    support_ok         [M, s]  bool, real support entries (not filler) with a finite teacher log-prob
    dense_divergence   [M]     the divergence over the full vocabulary (grad; support "full")
    """

    weights: Tensor
    logp: Tensor
    student_entropy: Tensor
    old_logprobs: Tensor | None
    advantages: Tensor | None
    fkl_positions: Tensor | None
    gather_pos: Tensor
    fkl_gathered: Tensor
    support_student: Tensor | None = None
    support_teacher: Tensor | None = None
    support_ok: Tensor | None = None
    dense_divergence: Tensor | None = None


@dataclass(frozen=True)
class PolicyGradient:
    """max(-r A, -clip(r) A) (paper eq. 7), r = exp(logp - old_logprobs)."""

    key: ClassVar[str] = "pg_loss"
    reads: ClassVar[tuple[str, ...]] = ("weights", "logp", "old_logprobs", "advantages")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        pg_t, _, clipped = clipped_pg_loss(x.logp, x.old_logprobs, x.advantages, cfg.clip_low, cfg.clip_high)
        return (x.weights * pg_t).sum(), {"clip_frac": mean_or_zero(clipped.to(x.weights.dtype))}


@dataclass(frozen=True)
class Divergence:
    """TRL's generalized JSD (beta 0 forward KL, 1 reverse KL) between student and teacher over a
    named support (`dense.py`): over a top-k support the k ids plus the mass outside them as one
    outcome (the tail bucket), so the term is >= 0 and 0 only where the two agree; over the full
    vocabulary the exact divergence, computed before the terms (`dense_divergence`)."""

    beta: float
    support: str
    key: str = "divergence_loss"

    @property
    def reads(self) -> tuple[str, ...]:
        if self.support == "full":
            return ("weights", "dense_divergence")
        return ("weights", "support_student", "support_teacher", "support_ok")

    def __call__(self, x: TermInputs, cfg: LossParams) -> tuple[Tensor, dict[str, Tensor]]:
        if self.support == "full":
            return (x.weights * x.dense_divergence).sum(), {}
        d_t = support_divergence(x.support_student, x.support_teacher, x.support_ok, self.beta)  # [M]
        metrics = {}
        if self.support == "student_topk":
            with torch.no_grad():
                mass = torch.where(x.support_ok, x.support_student.exp(), 0.0).sum(dim=1)
                metrics["student_candidate_mass"] = mean_or_zero(mass)
        return (x.weights * d_t).sum(), metrics


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


LossTerm = PolicyGradient | Divergence | ForwardKL | StudentEntropy | CrossEntropy
