"""Per-teacher statistics of an iteration's rollouts (issue 32), against a direct computation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from eopd_trainer.learner.teacher_stats import per_teacher_stats
from eopd_trainer.queue.messages import ORIGIN_TEACHER
from tests.trainer.test_pipeline_units import make_rollout


def rollout(rid: str, teacher: str, ent, old, tlp, origin=None):
    r = make_rollout(rid, n=len(ent), k=2)
    r = dataclasses.replace(r, teacher=teacher, teacher_entropies=np.asarray(ent, np.float32),
                            old_logprobs=np.asarray(old, np.float32), teacher_logprobs=np.asarray(tlp, np.float32))
    return dataclasses.replace(r, origin=origin) if origin else r


def test_share_gate_entropy_and_reverse_kl_per_teacher():
    rs = [rollout("t0-s0", "a", [0.5, 1.0, 2.0], [-1.0, -2.0, -1.0], [-1.5, -1.0, -1.0]),
          rollout("t1-s0", "b", [0.8, 0.1], [-0.5, -0.5], [-0.5, -2.5]),
          rollout("t2-s0", "b", [0.9], [0.0], [-1.0], origin=ORIGIN_TEACHER)]  # no old log-probs: not in the KL
    out = per_teacher_stats(rs, tau=0.8)
    assert out["by_teacher/a/token_share"] == pytest.approx(3 / 6) and out["by_teacher/b/token_share"] == pytest.approx(3 / 6)
    assert out["by_teacher/a/gate_ratio"] == pytest.approx(2 / 3) and out["by_teacher/b/gate_ratio"] == pytest.approx(2 / 3)
    assert out["by_teacher/a/teacher_entropy"] == pytest.approx(3.5 / 3)
    assert out["by_teacher/a/reverse_kl"] == pytest.approx((0.5 - 1.0 + 0.0) / 3)
    assert out["by_teacher/b/reverse_kl"] == pytest.approx((0.0 + 2.0) / 2)
    assert per_teacher_stats(rs, tau=0.5)["by_teacher/a/gate_ratio"] == 1.0
    assert per_teacher_stats(rs, tau=0.5, gate="gt")["by_teacher/a/gate_ratio"] == pytest.approx(2 / 3)
    assert per_teacher_stats([dataclasses.replace(r, teacher="") for r in rs], tau=0.8) == {}
