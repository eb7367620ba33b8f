"""`loss.support: full` on the learner's path: rollouts carrying the teacher's hidden states (scored by
the real transformers engine, in process) are packed as the learner packs a micro-batch, the
teacher's logits are attached on demand (`FullVocabTeacher.attach`: its output head, temperature
and token remap), and the loss equals the same loss given the teacher model's own `[N, V]` logits
(fp32 hidden states: 1e-4). The learner refuses the configurations it cannot serve by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eopd_common.models import load_causal_lm
from eopd_teacher.engines.transformers_engine import TransformersEngine
from eopd_teacher.settings import TeacherSettings
from eopd_teacher.types import ScoreItem
from eopd_trainer.batching import pack_rollouts
from eopd_trainer.config.base import ConfigError
from eopd_trainer.config.load import load_config
from eopd_trainer.learner.teacher_head import FullVocabTeacher
from eopd_trainer.objective import compute_loss
from eopd_trainer.queue.messages import PromptTask, decode_rollout, encode_rollout
from eopd_trainer.rollout.publisher import make_rollout
from eopd_trainer.rollout.requests import TokenRemap

FULL = ["teacher.hidden_states=float32", "loss.variant=gkd", "loss.gkd_beta=1.0", "loss.support=full",
        "teacher.temperature=0.8"]


def test_support_full_reads_the_teachers_logits_from_its_hidden_states():
    cfg = load_config("configs/tiny.yaml", FULL)
    assert FullVocabTeacher.needed(cfg)
    engine = TransformersEngine(TeacherSettings(model="tiny-random", compile_statistics=False, dtype="float32").engine_settings())
    engine.load()
    rng = np.random.default_rng(0)
    rollouts, logits = [], []
    teacher = load_causal_lm("tiny-random").model
    for i in range(3):
        prompt, response = rng.integers(3, 49152, 6).tolist(), rng.integers(3, 49152, int(rng.integers(2, 9))).tolist()
        (s,) = engine.score([ScoreItem(f"t{i}-s0", np.array(prompt + response), len(prompt), cfg.teacher.top_k,
                                       cfg.teacher.temperature, hidden_dtype="float32")])
        r = make_rollout(PromptTask(i, i, 1, 0), 0, prompt, response, np.full(len(response), -1.0, np.float32), s,
                         remap=TokenRemap(), rollout_cfg=cfg.rollout, worker_id="w", policy_version=0, truncated=False,
                         sampled_unix_ns=0, scored_unix_ns=0)
        rollouts.append(decode_rollout(encode_rollout(r)))  # as the learner receives it
        with torch.no_grad():
            z = teacher(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
        logits.append(z / cfg.teacher.temperature)
    full = FullVocabTeacher(cfg)
    full.head = engine.output_head()  # what load() fetches over gRPC (tests/trainer/test_hidden_states_queue.py)
    packed = pack_rollouts(rollouts, 2)
    student = torch.randn(packed.num_tokens, 49152, generator=torch.Generator().manual_seed(1))
    on_demand = full.attach(packed.loss_inputs, rollouts, "cpu")
    loss, m = compute_loss(student, on_demand, cfg.loss)
    ref, m_ref = compute_loss(student, packed.loss_inputs.replace(teacher_logits=torch.cat(logits)), cfg.loss)
    assert torch.isfinite(loss) and loss > 0
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)


def test_support_full_asks_for_hidden_states_and_is_refused_before_start_where_it_cannot_have_them():
    # Left unset: bfloat16, the field then written into run.yaml as set (the workers read it from there).
    cfg = load_config("configs/tiny.yaml", FULL[1:])
    assert cfg.teacher.hidden_states == "bfloat16" and FullVocabTeacher(cfg).teacher.hidden_states == "bfloat16"
    assert load_config("configs/tiny.yaml", FULL).teacher.hidden_states == "float32"  # set: kept
    assert load_config("configs/tiny.yaml", []).teacher.hidden_states == "none"  # top-k losses: nothing extra
    # Set to none explicitly: refused when the config is read, naming both fields.
    with pytest.raises(ConfigError, match=r"teacher.hidden_states: none, but loss.support: full \(loss.variant gkd\)"):
        load_config("configs/tiny.yaml", ["teacher.hidden_states=none", *FULL[1:]])
    with pytest.raises(ConfigError, match=r"teachers / route.mixture: loss.support: full"):
        load_config("configs/tiny.yaml", [*FULL, "teachers=[{name: other, model: tiny-random}]", "route.field=kind",
                                             "route.routes={x: other}"])
    assert not FullVocabTeacher.needed(load_config("configs/tiny.yaml", ["teacher.hidden_states=float32"]))


def test_the_head_is_converted_to_float32_on_the_device_once():
    from eopd_common.output_head import HeadInfo, OutputHead
    from eopd_trainer.learner.teacher_head import head_on

    w = torch.randn(32, 8).to(torch.bfloat16)
    head = OutputHead.of(HeadInfo(model="m@r", vocab_size=32, hidden_size=8, dtype="bfloat16", has_bias=False), w, None)
    on = head_on(head, "cpu")
    assert on.weight.dtype == torch.float32 and torch.equal(on.weight, w.float()) and on.fingerprint == head.fingerprint
    assert head_on(on, "cpu") is on  # kept: nothing converted or copied again
