"""Which loss trains which iteration, and who generates a task's responses (pure functions).

A run is one or two stages: `train.warmup_kd_iterations` iterations of KD first (the teacher
generates every response, the student trains on prompt + teacher response: prune-then-distill's
warm-up), then `loss.variant` for the rest. Iteration i (1-based) trains with `iteration_variant`
and its rollouts come from tasks whose `num_teacher_samples` (`teacher_samples`) follow the same
variant's `teacher_share`:

| variant (or warm-up) | num_teacher_samples of a task of n samples                        |
|----------------------|-------------------------------------------------------------------|
| kd, kd-warmup        | n: every response teacher-generated                               |
| gkd                  | each sample teacher-generated with probability 1 - gkd_lambda,     |
|                      | drawn from step_seed(seed, task_seq, sample_index), then counted   |
| others (grpo too)    | 0: every response sampled by the student                         |

The draw depends only on (seed, task_seq, sample_index), so a task republished after a crash or a
rebuild asks for the same split.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..objective import LossConfig, step_seed

WARMUP_STAGE = "kd-warmup"
WARMUP_VARIANT = "kd"


def in_warmup(warmup_iterations: int, iteration: int) -> bool:
    """Iteration `iteration` (1-based) is one of the KD warm-up's."""
    return 1 <= iteration <= warmup_iterations


def iteration_variant(loss: LossConfig, warmup_iterations: int, iteration: int) -> str:
    """The loss variant iteration `iteration` trains with: "kd" during the warm-up, else loss.variant."""
    return WARMUP_VARIANT if in_warmup(warmup_iterations, iteration) else loss.variant


def stage_name(loss: LossConfig, warmup_iterations: int, iteration: int) -> str:
    """The stage shown in the progress line, the metrics and the report: "kd-warmup" or the variant."""
    return WARMUP_STAGE if in_warmup(warmup_iterations, iteration) else loss.variant


def iteration_loss(loss: LossConfig, warmup_iterations: int, iteration: int) -> LossConfig:
    """The LossConfig of iteration `iteration`: `loss` itself, or a validated copy with variant "kd"
    during the warm-up (every other hyper-parameter kept: ce_weight, kl_weight, temperature, ...)."""
    variant = iteration_variant(loss, warmup_iterations, iteration)
    if variant == loss.variant:
        return loss
    return LossConfig(**{**loss.model_dump(), "variant": variant})


def uniform(seed: int, task_seq: int, sample_index: int) -> float:
    """A number in [0, 1) that depends only on (seed, task_seq, sample_index) (`step_seed`'s hash)."""
    return step_seed(seed, task_seq, sample_index) / float(1 << 63)


def teacher_samples(share: float, *, seed: int, task_seq: int, num_samples: int) -> int:
    """How many of a task's `num_samples` responses the teacher generates when the expected share
    is `share` (the variant's teacher_share): all at 1, none at 0, else each sample with
    probability `share` (`uniform(seed, task_seq, j) < share`), counted."""
    if share >= 1.0:
        return num_samples
    if share <= 0.0:
        return 0
    return sum(uniform(seed, task_seq, j) < share for j in range(num_samples))


def task_iteration(task_seq: int, *, iteration: int, prompts_per_iteration: int, max_staleness: int) -> int:
    """The iteration a task published while collecting `iteration` is meant for: `iteration` in sync
    mode (max_staleness 0); in async mode the one its number falls in (`task_seq // prompts per
    iteration + 1`), kept within [iteration, iteration + max_staleness] (replacement tasks push the
    numbering ahead; an async rollout may still be trained by a neighbouring iteration)."""
    ahead = task_seq // prompts_per_iteration + 1
    return min(iteration + max_staleness, max(iteration, ahead))


@dataclass(frozen=True)
class IterationPlan:
    """What an iteration's rollouts must be, for the learner's admission checks, and its loss. The
    plan is the one reader of the variant's flags outside objective/ (through `LossConfig`'s
    properties; tests/test_layout.py checks it): the feed and the trainer ask it."""

    iteration: int
    stage: str
    loss: LossConfig
    needs_teacher_scores: bool  # the loss reads teacher log-probs / top-k (grpo: no)
    accepts_teacher_origin: bool  # no policy-gradient term: a teacher-generated response can be trained
    needs_reward: bool  # the pg term's advantages come from rewards (grpo)
    teacher_share: float  # expected share of teacher-generated responses


def plan_iteration(loss: LossConfig, warmup_iterations: int, iteration: int) -> IterationPlan:
    """The plan of iteration `iteration`: its stage, LossConfig and what its rollouts need."""
    cfg = iteration_loss(loss, warmup_iterations, iteration)
    return IterationPlan(iteration=iteration, stage=stage_name(loss, warmup_iterations, iteration), loss=cfg,
                         needs_teacher_scores=cfg.needs_teacher_scores,
                         accepts_teacher_origin=not cfg.reads_old_logprobs, needs_reward=cfg.advantages_given,
                         teacher_share=cfg.teacher_share)


def task_teacher_samples(loss: LossConfig, warmup_iterations: int, *, seed: int, task_seq: int, num_samples: int,
                         iteration: int) -> int:
    """num_teacher_samples of task `task_seq` meant for iteration `iteration` (see the module's table)."""
    plan = plan_iteration(loss, warmup_iterations, iteration)
    return teacher_samples(plan.teacher_share, seed=seed, task_seq=task_seq, num_samples=num_samples)


def run_needs_teacher_generation(loss: LossConfig, warmup_iterations: int) -> bool:
    """Some task of the run asks the teacher to generate (KD warm-up, kd, gkd with lambda < 1)."""
    return warmup_iterations > 0 or loss.teacher_share > 0


def run_needs_teacher(loss: LossConfig, warmup_iterations: int) -> bool:
    """The workers need the teacher at all: to generate, or to score (every variant but grpo)."""
    return run_needs_teacher_generation(loss, warmup_iterations) or loss.needs_teacher_scores
