"""What the learner requires of a decoded rollout beyond its own consistency (`decode_rollout`)
and the decode-time bounds (`RolloutLimits`): the run's sampling temperature, ids of published
tasks and asked-for samples, candidates and what the iteration's loss variant needs."""

from __future__ import annotations

import math

from .messages import TASK_ID, PoisonMessage, Rollout, rollout_id


def check_rollout_metadata(r: Rollout, *, temperature: float, num_candidates: int = 0, n_samples: int | None = None,
                           published_tasks: int | None = None, variant: str = "", needs_teacher_scores: bool = True,
                           accepts_teacher_origin: bool = True, needs_reward: bool = False) -> None:
    """What the learner requires of a decoded rollout beyond its own consistency and the bounds
    `RolloutLimits` checks while decoding (prompt and response lengths, top-k = teacher.top_k or 0);
    raises PoisonMessage with the reason (the rollout is dead-lettered, not trained):

    - sampled at `temperature` (loss.temperature: the old log-probs and the ratio must be taken
      at the same temperature; a float32 field, so compared to a relative 1e-6);
    - `rollout_id` equal to `t{seq}-s{sample_index}` with `task_id` `t{seq}` (the exactly-once
      accounting is by these ids), of a published task (`seq < published_tasks`, the learner's
      `<ns>:tasks:next`) and a sample the task asked for (`sample_index < n_samples`);
    - at least `num_candidates` per-position candidates (loss.candidate_k when the loss variant
      needs them, e.g. eopd_topk_rkl; 0 otherwise);
    - what the iteration's loss `variant` needs: teacher scores (`needs_teacher_scores`; a graded-only
      rollout has none), no teacher-generated response in a variant with a policy-gradient term
      (`accepts_teacher_origin` False: the ratio needs the sampling policy's log-probs), a reward
      (`needs_reward`: grpo's advantages)."""
    rid = r.rollout_id
    what = f"loss variant {variant}" if variant else "the loss variant"
    if r.off_policy and not accepts_teacher_origin:
        raise PoisonMessage(f"rollout {rid}: teacher-generated (origin teacher, off-policy), {what} has a "
                            "policy-gradient term that needs the sampling policy's log-probs")
    if needs_reward and r.reward is None:
        raise PoisonMessage(f"rollout {rid}: no reward, {what} needs the task grader's reward")
    if not r.has_teacher_scores:
        if needs_teacher_scores:
            raise PoisonMessage(f"rollout {rid}: no teacher scores (top_k 0), {what} needs them")
    if not math.isclose(r.sampling_temperature, temperature, rel_tol=1e-6, abs_tol=1e-9):
        raise PoisonMessage(f"rollout {rid}: sampling_temperature {r.sampling_temperature:g} differs from loss.temperature "
                            f"{temperature:g}")
    m = TASK_ID.fullmatch(r.task_id)
    if m is None:
        raise PoisonMessage(f"rollout {rid}: task_id {r.task_id!r} is not of the form t<seq>")
    expected = rollout_id(int(m.group(1)), r.sample_index)
    if rid != expected:
        raise PoisonMessage(f"rollout {rid}: rollout_id does not match task_id {r.task_id!r} and sample_index "
                            f"{r.sample_index} (expected {expected!r})")
    if published_tasks is not None and int(m.group(1)) >= published_tasks:
        raise PoisonMessage(f"rollout {rid}: task {r.task_id} was never published (the learner published "
                            f"{published_tasks} tasks)")
    if n_samples is not None and r.sample_index >= n_samples:
        raise PoisonMessage(f"rollout {rid}: sample_index {r.sample_index} is not below rollout.n_samples {n_samples}")
    if r.num_candidates < num_candidates:
        raise PoisonMessage(f"rollout {rid}: {r.num_candidates} per-position candidates, the loss variant needs "
                            f"loss.candidate_k {num_candidates}")
