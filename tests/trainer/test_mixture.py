"""A mixture of teachers (`route.mixture`, issue 32 ask 2): the rollout's parts through the codec,
the worker's join of the teachers' answers, the packing, and the loss as the weighted sum of each
teacher's loss (values and gradients against computing each teacher's loss directly)."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest
import torch

from eopd_trainer.batching import pack_rollouts
from eopd_trainer.objective import LossConfig, compute_loss
from eopd_trainer.objective.mixture import mixture_loss
from eopd_trainer.queue.messages import PoisonMessage, PromptTask, RolloutLimits, decode_rollout, encode_rollout
from eopd_trainer.queue.mixture import TeacherPart
from eopd_trainer.rollout.mixture_join import MixtureJoin
from eopd_trainer.rollout.requests import Pending, TeacherSource, TokenRemap
from tests.trainer.test_pipeline_units import make_rollout


def part(name: str, n: int, k: int, seed: int) -> TeacherPart:
    other = make_rollout(n=n, k=k, seed=seed)
    return TeacherPart(name, other.teacher_logprobs, other.teacher_entropies, other.teacher_topk_ids,
                       other.teacher_topk_logprobs)


def mixed(rid: str = "t0-s0", n: int = 3, seed: int = 0):
    r = make_rollout(rid, n=n, k=4, seed=seed)
    return dataclasses.replace(r, teacher="teacher", mixture=(part("minus", n, 2, seed + 100),))


def test_parts_round_trip_and_are_checked():
    r = mixed()
    back = decode_rollout(encode_rollout(r), vocab_size=100, limits=RolloutLimits(16, 16, 4, (2, 4), parts=1))
    (p,) = back.mixture
    assert p.teacher == "minus" and p.top_k == 2
    for name in ("logprobs", "entropies", "topk_ids", "topk_logprobs"):
        np.testing.assert_array_equal(getattr(p, name), getattr(r.mixture[0], name))
    bad = dataclasses.replace(r, mixture=(dataclasses.replace(r.mixture[0], logprobs=r.mixture[0].logprobs[:2]),))
    with pytest.raises(PoisonMessage, match=r"mixture\[0\] \('minus'\): logprobs has 2 values, expected 3"):
        decode_rollout(encode_rollout(bad))
    same = dataclasses.replace(r, mixture=(dataclasses.replace(r.mixture[0], teacher="teacher"),))
    with pytest.raises(PoisonMessage, match="not empty and not given twice"):
        decode_rollout(encode_rollout(same))
    with pytest.raises(PoisonMessage, match=r"top_k 2 is not one of the teachers' \[4\]"):
        decode_rollout(encode_rollout(r), limits=RolloutLimits(16, 16, 4, parts=1))
    assert RolloutLimits(16, 16, 4, parts=1).max_bytes > RolloutLimits(16, 16, 4).max_bytes


class Book:
    def __init__(self):
        self.settled = []

    async def settle(self, entry_id, rollout_id, reason=None):
        self.settled.append((rollout_id, reason))


class Publisher:
    def __init__(self):
        self.published = []

    def to_rollout(self, p, scores, source, mixture=()):
        return (p.rollout_id, source.name, scores, mixture)

    async def publish_and_settle(self, rollout, book, entry_id):
        self.published.append(rollout)
        await book.settle(entry_id, rollout[0])
        return True


def test_the_join_publishes_once_every_teacher_answered_and_fails_once():
    """Pure logic of the worker's join (a recording publisher and task book)."""
    from eopd_teacher.types import SequenceScores

    def scores(seed):
        r = make_rollout(n=2, k=3, seed=seed)
        return SequenceScores("x", r.teacher_logprobs, r.teacher_entropies, r.teacher_topk_ids, r.teacher_topk_logprobs)

    book, pub = Book(), Publisher()
    join = MixtureJoin(["teacher", "minus"], pub, book)
    task = PromptTask(task_seq=0, prompt_index=0, num_samples=2, min_policy_version=0)
    a, b = (Pending("e", task, j, [1], [2, 3], False, np.zeros(2, np.float32), 0, 0) for j in range(2))
    src = {n: TeacherSource(n, f"{n}@1", TokenRemap.of({9: 7} if n == "minus" else {})) for n in ("teacher", "minus")}

    async def go():
        await join.offer(a, scores(1), src["minus"])  # the second teacher first: nothing yet
        assert pub.published == [] and len(join) == 1
        await join.offer(a, scores(0), src["teacher"])
        await join.fail(b, "teacher", "teacher rejected request r1 (INVALID_ARGUMENT): too long")
        await join.offer(b, scores(2), src["minus"])

    asyncio.run(go())
    ((rid, main, main_scores, parts),) = pub.published
    assert rid == a.rollout_id and main == "teacher" and [p.teacher for p in parts] == ["minus"]
    np.testing.assert_array_equal(main_scores.token_logprobs, scores(0).token_logprobs)
    want_ids = scores(1).topk_ids.copy()
    want_ids[want_ids == 7] = 9  # minus's top-k mapped back through its own remap
    np.testing.assert_array_equal(parts[0].topk_ids, want_ids)
    assert book.settled == [(a.rollout_id, None),
                            (b.rollout_id, "mixture: teacher: teacher rejected request r1 (INVALID_ARGUMENT): too long")]
    assert len(join) == 0


def test_packing_and_the_loss_as_the_weighted_sum_of_each_teachers_loss():
    torch.manual_seed(0)
    rollouts = [mixed("t0-s0", n=3, seed=0), mixed("t1-s0", n=2, seed=1)]
    packed = pack_rollouts(rollouts, pad_id=0)
    ((name, fields),) = packed.mixture
    assert name == "minus" and fields["teacher_topk_ids"].shape == (5, 2)
    np.testing.assert_array_equal(fields["teacher_logprobs"].numpy(),
                                  np.concatenate([r.mixture[0].logprobs for r in rollouts]))
    cfg = LossConfig(tau=0.5)
    logits = torch.randn(packed.num_tokens, 100, dtype=torch.float64, requires_grad=True)
    inputs = packed.loss_inputs

    def loss_of(x):
        return compute_loss(logits, x, cfg, denominator=float(packed.num_tokens))

    loss, metrics = mixture_loss(loss_of, inputs, packed.mixture, {"teacher": 0.3, "minus": 0.7})
    (g,) = torch.autograd.grad(loss, logits)
    l0, m0 = loss_of(inputs)
    l1, m1 = loss_of(inputs.replace(**fields))
    (g_direct,) = torch.autograd.grad(0.3 * l0 + 0.7 * l1, logits)
    assert loss.item() == pytest.approx((0.3 * l0 + 0.7 * l1).item(), abs=1e-12)
    torch.testing.assert_close(g, g_direct)
    assert metrics["fkl_loss"] == pytest.approx(0.3 * m0["fkl_loss"] + 0.7 * m1["fkl_loss"])
    assert metrics["by_teacher/minus/fkl_gated_mean"] == m1["fkl_gated_mean"] != m0["fkl_gated_mean"]
    with pytest.raises(ValueError, match="differ from route.mixture's teachers"):
        mixture_loss(loss_of, inputs, packed.mixture, {"teacher": 0.5, "plus": 0.5})
    with pytest.raises(ValueError, match="different mixture teachers"):
        pack_rollouts([rollouts[0], make_rollout("t2-s0")], pad_id=0)
