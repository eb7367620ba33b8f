"""Loss variants, registered by name (the paper's method and its baselines, sec. 5.3-5.6, app. A).

A variant is declarative: which terms it adds up and where the forward KL applies; its
`weighted_terms(cfg)` are the term objects of `loss_terms` with their weights. The positions
must be known before the vocabulary pass, so that the FKL's student log-probs are gathered only
where they are used (for `eopd`, only at gated tokens):

    loss_t = [pg]  max(-r A', -clip(r) A')          A' = A, or A + psi(H_student) if shaped
           + fkl_coef * 1[t in fkl_positions] * FKL_t
           - entropy_coef * H_student,t
           + ce_coef * (-log pi_theta(x_t))

A is `teacher_logprobs - old_logprobs` (advantages_from "teacher") or the caller's per-token
`advantages` (advantages_from "given", e.g. GRPO's group-normalised rewards, `group_advantages`).

| name              | pg  | A       | FKL at                          | fkl_coef  | entropy_coef | ce_coef   | shaped A | teacher share   |
|-------------------|-----|---------|---------------------------------|-----------|--------------|-----------|----------|-----------------|
| opd               | yes | teacher | nowhere                         | -         | 0            | 0         | no       | 0               |
| eopd              | yes | teacher | teacher entropy >= tau (or >)   | alpha     | 0            | 0         | no       | 0               |
| opd_fkl           | no  | -       | every valid token               | 1         | 0            | 0         | no       | 0               |
| full_fkl          | yes | teacher | every valid token               | alpha     | 0            | 0         | no       | 0               |
| random_fkl        | yes | teacher | random `random_fraction` share  | alpha     | 0            | 0         | no       | 0               |
| entropy_bonus     | yes | teacher | nowhere                         | -         | entropy_coef | 0         | no       | 0               |
| advantage_shaping | yes | teacher | nowhere                         | -         | 0            | 0         | yes      | 0               |
| kd                | no  | -       | every valid token               | kl_weight | 0            | ce_weight | no       | 1               |
| gkd               | no  | -       | every valid token (default)     | 1         | 0            | 0         | no       | 1 - gkd_lambda  |
| grpo              | yes | given   | nowhere (no teacher scores)     | -         | 0            | 0         | no       | 0               |

Divergences over a named support (issue 48, `dense.py`; `divergence(cfg) -> (beta, support)`):
gkd with `gkd_beta > 0` or `support` other than teacher_topk replaces its FKL by TRL's generalized
JSD(gkd_beta) over `support` (a tail bucket for a top-k support); eopd_rkl (no pg) is the exact
reverse KL over `support` plus alpha * FKL at gated tokens; eopd_topk_rkl is eopd_rkl fixed to the
student's top-k candidates. "teacher share" is the expected share of a batch's responses
that the teacher generates instead of the student (`Variant.teacher_share`): kd trains only on
teacher responses (off-policy, app. A), gkd mixes them with on-policy samples (Agarwal et al.,
sec. 5.5). For those responses `sampled_ids` are the teacher's tokens; the loss itself does not
depend on who generated a response (kd and gkd have no ratio, no old log-probs, no clip). grpo
needs no teacher scores at all (`needs_teacher_scores` False): its teacher inputs may be None.

Add one with `register_variant(Variant(name=..., ...))`; `LossConfig(variant=name)` then accepts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Literal

from .params import LossParams

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from .loss_terms import LossTerm

# The registry imports without torch: `LossConfig` validates a variant's name and asks it what it
# needs (teacher scores, candidates, logits, teacher-generated responses), and the run's config is
# loaded by processes that never compute a loss (`eopd run`'s supervisor, `eopd report`, `eopd
# --help`: 1.5 s of torch import each, and ~300 MB resident). The tensor code below imports torch and
# the loss terms when it runs.

Support = Literal["teacher_topk", "student_topk", "full"]
SUPPORTS: tuple[str, ...] = ("teacher_topk", "student_topk", "full")



@dataclass(frozen=True)
class PositionContext:
    """What a variant may look at to choose its FKL positions.

    gate: [M] bool, teacher entropy >= tau (or > tau with gate="gt"), per valid token.
    config: the loss configuration.
    generator: a torch.Generator (CPU) for random choices: the caller's, or else a fresh one seeded
        with config.random_seed (then the draw depends only on the seed and M).
    """

    gate: Tensor
    config: LossParams
    generator: torch.Generator


def nowhere(ctx: PositionContext) -> Tensor | None:
    """No FKL term."""
    return None


def gated(ctx: PositionContext) -> Tensor:
    """FKL where the teacher is uncertain: the entropy gate (paper eq. 9)."""
    return ctx.gate


def everywhere(ctx: PositionContext) -> Tensor:
    """FKL at every valid token."""
    import torch

    return torch.ones_like(ctx.gate)


def random_share(ctx: PositionContext) -> Tensor:
    """FKL at `round(random_fraction * M)` valid tokens drawn uniformly without replacement
    (`torch.randperm(M, generator=ctx.generator)[:n]`). The draw is a deterministic function of the
    generator's state and M: without a caller generator (a fresh one seeded with random_seed per
    call) every call with the same M picks the same positions; pass `step_generator(...)`."""
    import torch

    m = ctx.gate.numel()
    n = int(math.floor(ctx.config.random_fraction * m + 0.5))
    picked = torch.randperm(m, generator=ctx.generator)[:n].to(ctx.gate.device)
    out = torch.zeros_like(ctx.gate)
    out[picked] = True
    return out


def _alpha(cfg: LossParams) -> float:
    return cfg.alpha


def _no_entropy(cfg: LossParams) -> float:
    return 0.0


def _no_ce(cfg: LossParams) -> float:
    return 0.0


def _no_teacher_share(cfg: LossParams) -> float:
    return 0.0


def _no_divergence(cfg: LossParams) -> tuple[float, str] | None:
    return None


def _reverse_kl_over_support(cfg: LossParams) -> tuple[float, str]:
    """eopd_rkl: the exact reverse KL (beta 1) over `loss.support`."""
    return 1.0, cfg.support


def _reverse_kl_over_candidates(cfg: LossParams) -> tuple[float, str]:
    """eopd_topk_rkl: the exact reverse KL over the student's top-k, whatever `loss.support` says."""
    return 1.0, "student_topk"


def _gkd_divergence(cfg: LossParams) -> tuple[float, str] | None:
    """gkd: TRL's generalized JSD (gkd_beta) over `loss.support`; None at the default (beta 0 over the
    teacher's top-k), where gkd keeps the paper's forward KL against the teacher's renormalised top-k
    (`ForwardKL`, the same as before issue 48)."""
    if cfg.support == "teacher_topk" and cfg.gkd_beta == 0.0:
        return None
    return cfg.gkd_beta, cfg.support


def _gkd_fkl_coef(cfg: LossParams) -> float:
    return 1.0 if _gkd_divergence(cfg) is None else 0.0


@dataclass(frozen=True)
class Variant:
    """A named loss variant; see the module docstring for the formula."""

    name: str
    description: str
    pg: bool = True
    fkl_positions: Callable[[PositionContext], Tensor | None] = nowhere
    fkl_coef: Callable[[LossParams], float] = _alpha
    entropy_coef: Callable[[LossParams], float] = _no_entropy
    shape_advantage: bool = False
    # A divergence over a named support (dense.py): `(beta, support)` under a config, or None. beta 0
    # forward KL, 1 reverse KL, between TRL's generalized JSD; support "teacher_topk", "student_topk"
    # (the per-position candidates) or "full" (the teacher's full-vocabulary logits).
    divergence: Callable[[LossParams], tuple[float, str] | None] = _no_divergence
    # The metric key of that term's aggregated value.
    divergence_key: str = "divergence_loss"
    # Weight of the cross-entropy -log pi_theta(x_t) on the response tokens (kd: ce_weight).
    ce_coef: Callable[[LossParams], float] = _no_ce
    # "teacher": A = teacher_logprobs - old_logprobs; "given": the `advantages` argument (grpo).
    advantages_from: Literal["teacher", "given"] = "teacher"
    # Expected share of a batch's responses generated by the teacher (kd 1, gkd 1 - gkd_lambda).
    teacher_share: Callable[[LossParams], float] = _no_teacher_share
    # Whether the loss reads the teacher's per-token scores (teacher_logprobs, entropy, top-k).
    needs_teacher_scores: bool = True

    def needs_student_entropy_grad(self, cfg: LossParams) -> bool:
        return self.entropy_coef(cfg) != 0.0

    def support(self, cfg: LossParams) -> str | None:
        """The support of the variant's divergence term under `cfg`, or None without one."""
        d = self.divergence(cfg)
        return None if d is None else d[1]

    def needs_candidates(self, cfg: LossParams) -> bool:
        """Whether the loss reads per-position candidates (the student's top-k, teacher-scored)."""
        return self.support(cfg) == "student_topk"

    def needs_teacher_logits(self, cfg: LossParams) -> bool:
        """Whether the loss reads the teacher's full-vocabulary logits (`LossInputs.teacher_logits`)."""
        return self.support(cfg) == "full"

    def weighted_terms(self, cfg: LossParams) -> tuple[tuple[float, LossTerm], ...]:
        """The variant's loss under `cfg`: `(weight, term)` pairs, in the order they are added up
        (pg, divergence over a support, FKL, entropy, CE). A term whose weight `cfg` makes 0 is left
        out (e.g. eopd with alpha = 0 is exactly opd)."""
        from .loss_terms import CrossEntropy, Divergence, ForwardKL, PolicyGradient, StudentEntropy

        d = self.divergence(cfg)
        pairs = (
            (1.0 if self.pg else 0.0, PolicyGradient()),
            (0.0, None) if d is None else (1.0, Divergence(beta=d[0], support=d[1], key=self.divergence_key)),
            (self.fkl_coef(cfg) if self.fkl_positions is not nowhere else 0.0, ForwardKL()),
            (-self.entropy_coef(cfg), StudentEntropy()),
            (self.ce_coef(cfg), CrossEntropy()),
        )
        return tuple((w, term) for w, term in pairs if w != 0.0)


VARIANTS: dict[str, Variant] = {}


def register_variant(variant: Variant, *, replace: bool = False) -> Variant:
    """Adds `variant` to the registry under `variant.name` (refuses to overwrite unless `replace`).

    A variant with no term at all (no reverse-KL term, no FKL positions, the default zero entropy
    coefficient) is rejected. A variant whose terms a given config switches off (e.g. an FKL-only
    variant with alpha = 0) yields an exact, graph-attached zero loss.
    """
    if not isinstance(variant, Variant):
        raise TypeError(f"register_variant expects a Variant, got {type(variant).__name__}")
    if (not variant.pg and variant.divergence is _no_divergence and variant.fkl_positions is nowhere
            and variant.entropy_coef is _no_entropy and variant.ce_coef is _no_ce):
        raise ValueError(
            f"loss variant {variant.name!r} has no term: set pg=True, fkl_positions, entropy_coef or ce_coef"
        )
    if variant.advantages_from not in ("teacher", "given"):
        raise ValueError(f"loss variant {variant.name!r}: advantages_from must be 'teacher' or 'given', "
                         f"got {variant.advantages_from!r}")
    if not variant.needs_teacher_scores:
        uses = [name for name, used in (
            ("fkl_positions", variant.fkl_positions is not nowhere),
            ("divergence", variant.divergence is not _no_divergence),
            ("pg with advantages_from='teacher'", variant.pg and variant.advantages_from == "teacher"),
        ) if used]
        if uses:
            raise ValueError(f"loss variant {variant.name!r} has needs_teacher_scores=False but uses them: "
                             + ", ".join(uses))
    if variant.name in VARIANTS and not replace:
        raise ValueError(f"loss variant {variant.name!r} is already registered")
    VARIANTS[variant.name] = variant
    return variant


def get_variant(name: str) -> Variant:
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(f"unknown loss variant {name!r}; registered: {sorted(VARIANTS)}") from None


register_variant(Variant("opd", "On-policy distillation: clipped reverse-KL surrogate only (eq. 7)."))
register_variant(
    Variant("eopd", "EOPD: opd + alpha * FKL at tokens with teacher entropy >= tau (eq. 9).", fkl_positions=gated)
)
register_variant(
    Variant(
        "opd_fkl",
        "On-policy forward KL only (sec. 5.5): FKL at every token, no reverse-KL term.",
        pg=False,
        fkl_positions=everywhere,
        fkl_coef=lambda cfg: 1.0,
    )
)
register_variant(Variant("full_fkl", "opd + alpha * FKL at every token (sec. 5.6).", fkl_positions=everywhere))
register_variant(
    Variant(
        "random_fkl",
        "opd + alpha * FKL at a random random_fraction of tokens (sec. 5.6).",
        fkl_positions=random_share,
    )
)
register_variant(
    Variant(
        "entropy_bonus",
        "opd - entropy_coef * student entropy (sec. 5.3, app. A).",
        entropy_coef=lambda cfg: cfg.entropy_coef,
    )
)
register_variant(
    Variant(
        "advantage_shaping",
        "opd with A + min(shaping_alpha * H_student, |A| / shaping_kappa) (Cheng et al.; app. A).",
        shape_advantage=True,
    )
)
register_variant(
    Variant(
        "eopd_topk_rkl",
        "Reverse KL exactly over the student's top-k (teacher log-probs from candidates) plus the mass outside "
        "them as one outcome (tail bucket) + alpha * FKL at tokens with teacher entropy >= tau.",
        pg=False,
        fkl_positions=gated,
        divergence=_reverse_kl_over_candidates,
        divergence_key="topk_rkl_loss",
    )
)
register_variant(
    Variant(
        "eopd_rkl",
        "EOPD with an exact reverse KL instead of the one-sample estimate: KL(student || teacher) over "
        "loss.support (tail bucket for a top-k support) + alpha * FKL at tokens with teacher entropy >= tau.",
        pg=False,
        fkl_positions=gated,
        divergence=_reverse_kl_over_support,
    )
)
register_variant(
    Variant(
        "kd",
        "Off-policy KD (app. A, DistillKit): on teacher-generated responses, ce_weight * CE(teacher tokens) "
        "+ kl_weight * FKL over the teacher's renormalised top-k at every token.",
        pg=False,
        fkl_positions=everywhere,
        fkl_coef=lambda cfg: cfg.kl_weight,
        ce_coef=lambda cfg: cfg.ce_weight,
        teacher_share=lambda cfg: 1.0,
    )
)
register_variant(
    Variant(
        "gkd",
        "GKD (Agarwal et al.; sec. 5.5): TRL's generalized JSD (gkd_beta) over loss.support at every token, on a "
        "mix of on-policy student samples (share gkd_lambda) and teacher-generated responses; at the default "
        "(beta 0, teacher_topk) the FKL over the teacher's renormalised top-k.",
        pg=False,
        fkl_positions=everywhere,
        fkl_coef=_gkd_fkl_coef,
        divergence=_gkd_divergence,
        teacher_share=lambda cfg: 1.0 - cfg.gkd_lambda,
    )
)
register_variant(
    Variant(
        "grpo",
        "GRPO (Shao et al.; sec. 5.1, app. A): the clipped surrogate with the caller's group-normalised "
        "reward advantages (group_advantages); no teacher scores.",
        advantages_from="given",
        needs_teacher_scores=False,
    )
)
