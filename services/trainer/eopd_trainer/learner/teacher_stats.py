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
    """{} when the rollouts carry no teacher statistics (grpo). A mixture rollout counts for each of
    its teachers (token shares then sum to the number of teachers)."""
    scored = [r for r in rollouts if r.teacher and r.has_teacher_scores]
    total = sum(r.num_response_tokens for r in scored)
    # (teacher, entropies, teacher log-probs, the rollout) of every teacher's statistics of a rollout
    views = [(r.teacher, r.teacher_entropies, r.teacher_logprobs, r) for r in scored]
    views += [(part.teacher, part.entropies, part.logprobs, r) for r in scored for part in r.mixture]
    out: dict[str, float] = {}
    for name in sorted({v[0] for v in views}):
        mine = [v for v in views if v[0] == name]
        ent = np.concatenate([np.asarray(v[1], dtype=np.float64) for v in mine])
        gated = ent >= tau if gate == "ge" else ent > tau
        key = f"by_teacher/{name}"
        out[f"{key}/token_share"] = float(ent.size / total) if total else 0.0
        out[f"{key}/gate_ratio"] = float(gated.mean()) if ent.size else 0.0
        out[f"{key}/teacher_entropy"] = float(ent.mean()) if ent.size else 0.0
        student = [v for v in mine if not v[3].off_policy]
        if student:
            diff = np.concatenate([np.asarray(v[3].old_logprobs, dtype=np.float64) - np.asarray(v[2], dtype=np.float64)
                                   for v in student])
            out[f"{key}/reverse_kl"] = float(diff.mean()) if diff.size else 0.0
    return out
