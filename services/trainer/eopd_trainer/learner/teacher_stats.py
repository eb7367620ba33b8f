"""Per-teacher statistics of an iteration's rollouts (issue 32: a run with several teachers), from
the rollouts themselves (numpy, no student forward): for each teacher name (the rollout's
`teacher`), its share of the response tokens, its gate ratio (share of its tokens with teacher
entropy at or over tau: `gate` "ge", over it: "gt"), its mean entropy, and the reverse KL to it
estimated on the sampled tokens of the student's own rollouts (mean of old log-prob - teacher
log-prob: the negative of the advantage; teacher-generated rollouts have no old log-probs and are
left out). Keys `by_teacher/<name>/<statistic>`; the learner records them as `iter/...`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..queue.messages import Rollout


def per_teacher_stats(rollouts: Sequence[Rollout], tau: float, gate: str = "ge") -> dict[str, float]:
    """{} when the rollouts carry no teacher statistics (grpo)."""
    scored = [r for r in rollouts if r.teacher and r.has_teacher_scores]
    total = sum(r.num_response_tokens for r in scored)
    out: dict[str, float] = {}
    for name in sorted({r.teacher for r in scored}):
        mine = [r for r in scored if r.teacher == name]
        ent = np.concatenate([np.asarray(r.teacher_entropies, dtype=np.float64) for r in mine])
        gated = ent >= tau if gate == "ge" else ent > tau
        key = f"by_teacher/{name}"
        out[f"{key}/token_share"] = float(ent.size / total) if total else 0.0
        out[f"{key}/gate_ratio"] = float(gated.mean()) if ent.size else 0.0
        out[f"{key}/teacher_entropy"] = float(ent.mean()) if ent.size else 0.0
        student = [r for r in mine if not r.off_policy]
        if student:
            diff = np.concatenate([np.asarray(r.old_logprobs, dtype=np.float64) - np.asarray(r.teacher_logprobs, dtype=np.float64)
                                   for r in student])
            out[f"{key}/reverse_kl"] = float(diff.mean()) if diff.size else 0.0
    return out
