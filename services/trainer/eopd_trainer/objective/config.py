"""`LossConfig`: the one validated, frozen object that selects and parameterises the loss."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .variants import VARIANTS, Support  # the registry dict itself: variants registered later are seen too

Gate = Literal["ge", "gt"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "token-sum"]


class LossConfig(BaseModel):
    """Hyper-parameters of the distillation loss (defaults are the paper's, sec. 4 and app. A).

    Frozen after construction, unknown keys rejected, bounds checked. Derive a changed copy with
    the constructor, which validates: `LossConfig(**{**cfg.model_dump(), "tau": 1.0})`.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    variant: str = Field(
        "eopd",
        description="Loss variant, by registered name: opd, eopd, opd_fkl, full_fkl, random_fkl, "
        "entropy_bonus, advantage_shaping, eopd_topk_rkl, eopd_rkl, kd, gkd, grpo (see eopd_trainer.objective.variants).",
    )
    tau: float = Field(0.8, ge=0.0, description="Teacher-entropy threshold (nats) of the FKL gate.")
    alpha: float = Field(
        1.0, ge=0.0, description="Weight of the forward-KL term (eopd, full_fkl, random_fkl)."
    )
    clip_low: float = Field(0.2, ge=0.0, lt=1.0, description="PPO clip: ratio lower bound 1 - clip_low.")
    clip_high: float = Field(0.2, ge=0.0, description="PPO clip: ratio upper bound 1 + clip_high.")
    temperature: float = Field(
        1.0, gt=0.0, description="Student logits are divided by it before the log-softmax."
    )
    gate: Gate = Field("ge", description='FKL gate: "ge" is H >= tau, "gt" is H > tau.')
    aggregation: Aggregation = Field(
        "token-mean",
        description='"token-mean": sum over all valid tokens / their number (Algorithm 1); '
        '"seq-mean-token-mean": mean over each sequence\'s valid tokens, then over sequences; '
        '"token-sum": sum over all valid tokens / loss.sum_divisor, a constant (TRL GKDTrainer\'s scale: '
        'its summed per-token divergence over num_items_in_batch, which transformers counts from the '
        'dataset\'s labels before the completions exist).',
    )
    sum_divisor: float = Field(
        1.0, gt=0.0, description='"token-sum": the constant the summed loss is divided by (1: the plain sum).',
    )
    random_fraction: float = Field(
        0.2, ge=0.0, le=1.0, description="random_fkl: share of valid tokens that receive the FKL."
    )
    random_seed: int = Field(
        0, description="random_fkl: seed of the position draw when no torch.Generator is passed."
    )
    entropy_coef: float = Field(
        1e-3,
        ge=0.0,
        description="entropy_bonus: loss = opd - entropy_coef * student entropy. The paper does not "
        "give it; 1e-3 is the customary PPO/verl value.",
    )
    shaping_alpha: float = Field(
        0.1, ge=0.0, description="advantage_shaping: alpha of psi(H) = min(alpha * H, |A| / kappa)."
    )
    shaping_kappa: float = Field(
        2.0, gt=1.0, description="advantage_shaping: kappa (> 1) of psi(H) = min(alpha * H, |A| / kappa)."
    )
    ce_weight: float = Field(
        0.5,
        ge=0.0,
        description="kd: weight of the cross-entropy on the teacher's tokens, -log pi_theta(x_t) "
        "(app. A, DistillKit: 0.5).",
    )
    kl_weight: float = Field(
        0.5,
        ge=0.0,
        description="kd: weight of the forward KL over the teacher's renormalised top-k (app. A, DistillKit: 0.5).",
    )
    gkd_lambda: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="gkd: share of on-policy student samples in a batch (Agarwal et al.'s lambda; the "
        "rest are teacher-generated). The paper runs 0.5, 0.8 and 1.0 (sec. 5.5).",
    )
    gkd_beta: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="gkd: TRL's beta of the generalized JSD (0 forward KL, 1 reverse KL, between the JSD of the "
        "beta-mixture; GKDTrainer.generalized_jsd_loss). At 0 over support teacher_topk gkd is the paper's "
        "forward KL against the teacher's renormalised top-k.",
    )
    support: Support = Field(
        "teacher_topk",
        description="Support of the divergence of gkd and eopd_rkl: teacher_topk (the teacher's top-k ids), "
        "student_topk (the student's top-candidate_k ids, scored by the teacher as candidates) or full (the whole "
        "vocabulary: needs the teacher's full-vocabulary logits, from its hidden states). A top-k support keeps the "
        "mass outside it as one more outcome (tail bucket). Other variants ignore it.",
    )
    grpo_eps: float = Field(
        1e-4,
        gt=0.0,
        description="grpo: added to each group's reward std before dividing, (r - mean) / (std + eps) "
        "(TRL GRPOTrainer's 1e-4).",
    )
    candidate_k: int = Field(
        16,
        ge=1,
        le=256,
        description="Support student_topk (eopd_topk_rkl; gkd / eopd_rkl with support=student_topk): the student's "
        "top-k ids per response position that the rollout worker takes from its old-log-prob pass and has the "
        "teacher score (per-position candidates).",
    )
    chunk_size: int = Field(
        1024,
        gt=0,
        description="Tokens per chunk of the vocabulary reductions: one [chunk_size, V] fp32 work "
        "buffer is alive at a time (two in backward when the student entropy is differentiated).",
    )
    fused_backward: bool = Field(
        True,
        description="Hidden-state path (`compute_loss_from_hidden`): compute the gradients w.r.t. the hidden "
        "states and the output projection inside the forward chunk loop (three matmuls per chunk, as many as a "
        "naive full-vocabulary loss) instead of recomputing each chunk's logits in backward (four). Same loss "
        "and gradients; it needs one more [chunk_size, V] fp32 buffer and the gradients are held from the "
        "forward to the backward. No double backward.",
    )
    vocab_metrics: bool = Field(
        True,
        description="Also compute the vocabulary-wide diagnostics (student entropy, student/teacher "
        "top-k overlap); they cost about two extra passes over each chunk.",
    )

    @property
    def num_candidates(self) -> int:
        """Per-position candidates the variant needs in each rollout: `candidate_k` for a divergence
        over the student's top-k (eopd_topk_rkl; gkd / eopd_rkl with support=student_topk), else 0."""
        return self.candidate_k if VARIANTS[self.variant].needs_candidates(self) else 0

    @property
    def needs_teacher_logits(self) -> bool:
        """Whether the loss reads the teacher's full-vocabulary logits (support=full for gkd /
        eopd_rkl): the teacher must send its final hidden states (`LossInputs.teacher_logits`)."""
        return VARIANTS[self.variant].needs_teacher_logits(self)

    @property
    def teacher_share(self) -> float:
        """Expected share of a batch's responses that the teacher generates for this variant
        (kd 1, gkd 1 - gkd_lambda, the others 0); see `Variant.teacher_share`."""
        return float(VARIANTS[self.variant].teacher_share(self))

    @property
    def needs_teacher_scores(self) -> bool:
        """Whether the variant's loss reads the teacher's per-token scores (False for grpo)."""
        return VARIANTS[self.variant].needs_teacher_scores

    @property
    def reads_old_logprobs(self) -> bool:
        """Whether the variant's loss has a policy-gradient term, the ratio against the behaviour
        policy's old log-probs (kd, gkd: no; they take None, teacher-generated responses have none)."""
        return VARIANTS[self.variant].pg

    @property
    def advantages_given(self) -> bool:
        """Whether the variant's advantages are given per rollout (grpo: group-normalised rewards,
        `batching.rollout_advantages`) rather than taken from the teacher's scores."""
        return VARIANTS[self.variant].advantages_from == "given"

    @field_validator("variant")
    @classmethod
    def _known_variant(cls, v: str) -> str:
        if v not in VARIANTS:
            raise ValueError(f"unknown loss variant {v!r}; registered: {sorted(VARIANTS)}")
        return v
