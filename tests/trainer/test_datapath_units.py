"""The KD / GKD / GRPO data path's pure parts: the per-iteration stage and variant, gkd's
per-sample teacher draw, the task an async iteration is meant for, advantages broadcast to tokens,
origin / reward / empty teacher arrays through the codec and the learner's checks, the staleness
exemption of teacher-generated rollouts, the task grader."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from eopd_trainer.batching import pack_rollouts
from eopd_trainer.config import ConfigError, load_config
from eopd_trainer.config.stages import (
    WARMUP_STAGE,
    in_warmup,
    stage_name,
    task_iteration,
    teacher_samples,
    uniform,
)
from eopd_trainer.learner.ledger import Admit, Ledger, admit
from eopd_trainer.objective import VARIANTS, LossConfig
from eopd_trainer.queue.rollout_checks import check_rollout_metadata
from eopd_trainer.queue.messages import (
    ORIGIN_TEACHER,
    PoisonMessage,
    PromptTask,
    RolloutLimits,
    decode_rollout,
    decode_task,
    encode_rollout,
    encode_task,
)
from eopd_trainer.rollout.grader import TaskGrader, load_answers

from tests.trainer.test_pipeline_units import TINY, make_rollout

needs_new_variants = pytest.mark.skipif(not {"kd", "gkd", "grpo"} <= set(VARIANTS),
                                        reason="the kd/gkd/grpo losses (branch losses) are not merged yet")


# Stages and the teacher draw -------------------------------------------------------------------

def test_stage_per_iteration():
    loss = LossConfig(variant="eopd")
    assert [in_warmup(2, i) for i in range(1, 5)] == [True, True, False, False]
    assert [stage_name(loss, 2, i) for i in range(1, 5)] == [WARMUP_STAGE, WARMUP_STAGE, "eopd", "eopd"]
    assert [stage_name(loss, 0, i) for i in range(1, 3)] == ["eopd", "eopd"]


def test_teacher_samples_extremes_and_the_naive_count():
    for n in (1, 2, 8):
        assert teacher_samples(1.0, seed=3, task_seq=5, num_samples=n) == n
        assert teacher_samples(0.0, seed=3, task_seq=5, num_samples=n) == 0
    for share in (0.2, 0.5, 0.8):
        for seq in range(50):
            naive = 0
            for j in range(8):  # each sample on its own: teacher when its uniform draw is below the share
                naive += 1 if uniform(7, seq, j) < share else 0
            assert teacher_samples(share, seed=7, task_seq=seq, num_samples=8) == naive


def test_teacher_samples_are_deterministic_and_have_the_expected_share():
    draws = [teacher_samples(0.5, seed=0, task_seq=s, num_samples=4) for s in range(2000)]
    assert draws == [teacher_samples(0.5, seed=0, task_seq=s, num_samples=4) for s in range(2000)]
    assert abs(sum(draws) / (4 * 2000) - 0.5) < 0.03  # 8000 Bernoulli(0.5): sd 0.0056
    assert draws != [teacher_samples(0.5, seed=1, task_seq=s, num_samples=4) for s in range(2000)]
    assert 0.0 <= min(uniform(0, s, 0) for s in range(100)) and max(uniform(0, s, 0) for s in range(100)) < 1.0


def test_task_iteration_sync_and_async():
    # sync: every task published while collecting iteration i is i's
    assert [task_iteration(s, iteration=3, prompts_per_iteration=4, max_staleness=0) for s in (0, 8, 20)] == [3, 3, 3]
    # async: by its number, within [iteration, iteration + max_staleness]
    assert [task_iteration(s, iteration=1, prompts_per_iteration=4, max_staleness=1) for s in (0, 3, 4, 7, 12)] == \
        [1, 1, 2, 2, 2]


@needs_new_variants
def test_iteration_plans():
    from eopd_trainer.config.stages import plan_iteration, run_needs_teacher, run_needs_teacher_generation

    loss = LossConfig(variant="eopd", ce_weight=0.3)
    warm, after = plan_iteration(loss, 1, 1), plan_iteration(loss, 1, 2)
    assert (warm.stage, warm.loss.variant, warm.loss.ce_weight, warm.teacher_share) == (WARMUP_STAGE, "kd", 0.3, 1.0)
    assert warm.accepts_teacher_origin and warm.needs_teacher_scores and not warm.needs_reward
    assert (after.stage, after.loss.variant, after.teacher_share, after.accepts_teacher_origin) == ("eopd", "eopd", 0.0, False)
    grpo = plan_iteration(LossConfig(variant="grpo"), 0, 1)
    assert grpo.needs_reward and not grpo.needs_teacher_scores and not grpo.accepts_teacher_origin
    gkd = plan_iteration(LossConfig(variant="gkd", gkd_lambda=0.8), 0, 1)
    assert gkd.teacher_share == pytest.approx(0.2) and gkd.accepts_teacher_origin
    assert not run_needs_teacher(LossConfig(variant="grpo"), 0)
    assert run_needs_teacher(LossConfig(variant="grpo"), 1) and run_needs_teacher_generation(LossConfig(variant="grpo"), 1)
    assert not run_needs_teacher_generation(LossConfig(variant="gkd", gkd_lambda=1.0), 0)
    assert run_needs_teacher_generation(LossConfig(variant="kd"), 0)


def test_config_warmup_and_grpo_samples():
    cfg = load_config(TINY, ["train.iterations=3", "train.warmup_kd_iterations=1"])
    assert cfg.train.warmup_kd_iterations == 1
    with pytest.raises(ConfigError, match="train.warmup_kd_iterations"):
        load_config(TINY, ["train.iterations=3", "train.warmup_kd_iterations=4"])
    with pytest.raises(ConfigError, match="train.warmup_kd_iterations"):
        load_config(TINY, ["train.warmup_kd_iterations=-1"])


@needs_new_variants
def test_config_grpo_needs_a_group():
    with pytest.raises(ConfigError, match="rollout.n_samples"):
        load_config(TINY, ["loss.variant=grpo", "rollout.n_samples=1"])


# Advantages broadcast to tokens ------------------------------------------------------------------

def test_pack_broadcasts_each_rollouts_advantage_to_its_tokens():
    rs = [make_rollout(f"t{i // 2}-s{i % 2}", n=n, seed=i) for i, n in enumerate((3, 1, 4, 2))]
    adv = {r.rollout_id: a for r, a in zip(rs, (0.5, -1.0, 2.0, 0.0), strict=True)}
    packed = pack_rollouts(rs, pad_id=0, advantages=adv)
    naive = []
    for r in rs:  # token by token, in packing order
        for _ in range(r.num_response_tokens):
            naive.append(adv[r.rollout_id])
    x = packed.loss_inputs
    assert x.advantages.dtype == torch.float32 and x.advantages.shape == (packed.num_tokens,)
    assert x.advantages.tolist() == naive
    # every token of sequence b carries b's advantage
    for b, r in enumerate(rs):
        assert torch.all(x.advantages[x.seq_index == b] == adv[r.rollout_id])
    assert pack_rollouts(rs, pad_id=0).loss_inputs.advantages is None
    with pytest.raises(ValueError, match="t1-s1"):
        pack_rollouts(rs, pad_id=0, advantages={k: v for k, v in adv.items() if k != "t1-s1"})


def graded(rid: str = "t0-s0", n: int = 3, reward: float | None = 1.0, seed: int = 0):
    r = make_rollout(rid, n=n, seed=seed)
    return dataclasses.replace(r, teacher_logprobs=np.zeros(0, np.float32), teacher_entropies=np.zeros(0, np.float32),
                               teacher_topk_ids=np.zeros((0, 0), np.int32),
                               teacher_topk_logprobs=np.zeros((0, 0), np.float32), reward=reward)


def test_pack_without_teacher_scores_and_no_mixing():
    rs = [graded("t0-s0", seed=1), graded("t0-s1", seed=2, reward=0.0)]
    packed = pack_rollouts(rs, pad_id=0, advantages={"t0-s0": 1.0, "t0-s1": -1.0})
    x = packed.loss_inputs
    assert x.teacher_logprobs is None and x.teacher_topk_ids is None and x.teacher_topk_logprobs is None
    assert x.old_logprobs.shape == (packed.num_tokens,)
    with pytest.raises(ValueError, match="no teacher scores"):
        pack_rollouts([rs[0], make_rollout("t1-s0")], pad_id=0)


@needs_new_variants
def test_rollout_advantages_group_by_task():
    from eopd_trainer.batching import rollout_advantages
    from eopd_trainer.objective import group_advantages

    rewards = {"t0-s0": 1.0, "t0-s1": 0.0, "t1-s0": 1.0, "t1-s1": 1.0, "t2-s0": 0.0, "t2-s1": 1.0}
    rs = [graded(rid, reward=r, seed=i) for i, (rid, r) in enumerate(rewards.items())]
    adv = rollout_advantages(rs[::-1], eps=1e-4)  # order does not matter: grouped by task_id
    ref = group_advantages(torch.tensor(list(rewards.values()), dtype=torch.float64),
                           torch.tensor([0, 0, 1, 1, 2, 2]), 1e-4)
    assert adv == pytest.approx(dict(zip(rewards, ref.tolist(), strict=True)))
    assert adv["t1-s0"] == 0.0 and adv["t0-s0"] > 0 > adv["t0-s1"]
    with pytest.raises(ValueError, match="no reward"):
        rollout_advantages([graded(reward=None)], eps=1e-4)


# Origin, reward, empty teacher arrays: codec and checks -------------------------------------------

def test_teacher_origin_roundtrip_with_and_without_old_logprobs():
    r = dataclasses.replace(make_rollout("t2-s1"), origin=ORIGIN_TEACHER, old_logprobs=np.zeros(3, np.float32))
    back = decode_rollout(encode_rollout(r), vocab_size=100)
    assert back.origin == ORIGIN_TEACHER and back.off_policy and back.reward is None
    assert np.array_equal(back.old_logprobs, np.zeros(3, np.float32))
    from eopd.v1 import rollout_pb2 as pb

    msg = pb.ScoredRollout.FromString(encode_rollout(r))
    del msg.old_logprobs[:]  # a teacher-generated response may omit them
    back = decode_rollout(msg.SerializeToString(), vocab_size=100)
    assert np.array_equal(back.old_logprobs, np.zeros(3, np.float32))
    msg.origin = pb.ORIGIN_STUDENT  # a student sample must carry them
    with pytest.raises(PoisonMessage, match="old_logprobs has 0 values"):
        decode_rollout(msg.SerializeToString(), vocab_size=100)


def test_graded_rollout_roundtrip_and_its_limits():
    r = graded("t1-s0", reward=1.0)
    back = decode_rollout(encode_rollout(r), vocab_size=100, limits=RolloutLimits(16, 16, 4))
    assert back.reward == 1.0 and back.top_k == 0 and not back.has_teacher_scores
    assert back.teacher_logprobs.shape == (0,) and back.teacher_topk_ids.shape == (0, 0)
    assert decode_rollout(encode_rollout(make_rollout())).reward is None  # unset stays unset
    with pytest.raises(PoisonMessage, match="top_k must be >= 1"):  # no scores and no reward
        decode_rollout(encode_rollout(graded(reward=None)))
    from eopd.v1 import rollout_pb2 as pb

    msg = pb.ScoredRollout.FromString(encode_rollout(r))
    msg.teacher_entropies.extend([0.5, 0.5, 0.5])  # half a set of teacher arrays
    with pytest.raises(PoisonMessage, match="teacher_entropies is set"):
        decode_rollout(msg.SerializeToString())
    msg = pb.ScoredRollout.FromString(encode_rollout(r))
    msg.reward = float("nan")
    with pytest.raises(PoisonMessage, match="reward nan is not finite"):
        decode_rollout(msg.SerializeToString())


def _check(r, **kw):
    args = dict(temperature=1.0, n_samples=2, published_tasks=10)
    check_rollout_metadata(r, **{**args, **kw})


def test_learner_checks_of_origin_reward_and_scores():
    teacher = dataclasses.replace(make_rollout("t0-s0"), origin=ORIGIN_TEACHER)
    _check(teacher, variant="kd")  # kd / gkd / the warm-up accept it
    with pytest.raises(PoisonMessage, match="origin teacher.*loss variant eopd has a policy-gradient term"):
        _check(teacher, variant="eopd", accepts_teacher_origin=False)
    with pytest.raises(PoisonMessage, match="no teacher scores.*loss variant eopd needs them"):
        _check(graded(), variant="eopd")
    _check(graded(), variant="grpo", needs_teacher_scores=False, accepts_teacher_origin=False, needs_reward=True)
    with pytest.raises(PoisonMessage, match="no reward, loss variant grpo needs"):
        _check(make_rollout(), variant="grpo", needs_teacher_scores=False, needs_reward=True)
    with pytest.raises(PoisonMessage, match="top_k 4 differs from teacher.top_k 2"):  # scores present: still checked
        decode_rollout(encode_rollout(make_rollout()), limits=RolloutLimits(16, 16, 2))  # (RolloutLimits' bound)


def test_task_num_teacher_samples_roundtrip_and_bound():
    t = PromptTask(4, 2, 4, 1, num_teacher_samples=3)
    assert decode_task(encode_task(t)).num_teacher_samples == 3
    assert decode_task(encode_task(PromptTask(4, 2, 4, 1))).num_teacher_samples == 0
    with pytest.raises(PoisonMessage, match="num_teacher_samples 5 is more than num_samples 4"):
        decode_task(encode_task(PromptTask(4, 2, 4, 1, num_teacher_samples=5)))


def test_teacher_rollouts_are_never_stale_but_still_exactly_once():
    led = Ledger()
    assert admit("t0-s0", 0, current_version=5, max_staleness=1, trained=led, in_batch=set()).kind is Admit.STALE
    d = admit("t0-s0", 0, current_version=5, max_staleness=1, trained=led, in_batch=set(), off_policy=True)
    assert (d.kind, d.staleness) == (Admit.TRAIN, 0)
    assert admit("t0-s0", 9, current_version=5, max_staleness=0, trained=led, in_batch=set(),
                 off_policy=True).kind is Admit.TRAIN  # not "future" either
    led.record(1, ["t0-s0"])
    assert admit("t0-s0", 5, current_version=5, max_staleness=1, trained=led, in_batch=set(),
                 off_policy=True).kind is Admit.DUPLICATE
    assert admit("t0-s1", 5, current_version=5, max_staleness=1, trained=led, in_batch={"t0-s1"},
                 off_policy=True).kind is Admit.DUPLICATE


# The task grader -----------------------------------------------------------------------------------

class _Chars:
    """A tokenizer of one id per character (ord), enough to test the grader's decoding."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_grader_rewards_with_evals_extraction(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {a} + {a}?", "answer": str(2 * a)}) + "\n" for a in (3, 5)))
    assert load_answers([path]) == ["6", "10"]
    g = TaskGrader.from_files([path], _Chars(), "strict")
    ids = lambda s: [ord(c) for c in s]  # noqa: E731
    assert g.reward(0, ids("so \\boxed{6}")) == 1.0
    assert g.reward(1, ids("so \\boxed{6}")) == 0.0
    assert g.reward(1, ids("the answer is 10")) == 0.0  # strict: no box, wrong
    assert TaskGrader.from_files([path], _Chars(), "flexible").reward(1, ids("the answer is 10")) == 1.0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x"}) + "\n")
    with pytest.raises(ValueError, match="no field 'answer'"):
        load_answers([bad])


# The report's warm-up marks ------------------------------------------------------------------------

def test_report_names_and_shades_the_warmup(tmp_path):
    from eopd_trainer.eval.report_stages import mark_warmup, stages_line, warmup_iterations

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.yaml").write_text("loss:\n  variant: eopd\n")
    rows = [{"kind": "iteration", "iteration": i, "stage": "kd-warmup" if i <= 2 else "eopd", "iter/loss": 1.0 / i}
            for i in range(1, 5)]
    (run / "train_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert warmup_iterations(rows) == [1, 2]
    assert "run: kd-warmup (iterations 1-2, shaded in the training curves), then eopd" in stages_line([run])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    mark_warmup(ax, {run: rows})
    spans = [p for p in ax.patches]
    assert len(spans) == 1 and spans[0].get_label() == "kd-warmup"
    x0, x1 = spans[0].get_x(), spans[0].get_x() + spans[0].get_width()
    assert (x0, x1) == (0.5, 2.5)
    plt.close(fig)
    (run / "train_metrics.jsonl").write_text("".join(json.dumps({**r, "stage": "eopd"}) + "\n" for r in rows))
    assert stages_line([run]) == ""  # no warm-up: nothing to name
