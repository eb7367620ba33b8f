"""The teacher's hidden states from a real teacher (a server over TCP) through the real queue (a
redis-server) to the learner, which computes the teacher's exact full-vocabulary distribution from
them: the rollout worker's request shaping asks for them (teacher.hidden_states), `make_rollout`
carries them in the ScoredRollout, the learner fetches the output head (GetOutputHead) and projects
them (`learner.teacher_head`). The entropy, sampled-token log-prob and top-k computed this way
equal what the teacher sent in the same rollout (bf16 hidden states: 0.1 nats, as
tests/teacher/engines/test_hidden_states.py; fp32: 1e-4). Bytes per rollout are measured here
(docs/teacher.md states them per token)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eopd_common.hidden_wire import hidden_bytes_per_token
from eopd_common.output_head import head_statistics
from eopd_teacher.client import TeacherClient
from eopd_trainer.config import TeacherConfig
from eopd_trainer.config.load import load_config
from eopd_trainer.learner.teacher_head import fetch_teacher_head, rollouts_hidden, teacher_logit_rows
from eopd_trainer.queue.messages import PoisonMessage, PromptTask, RolloutLimits, decode_rollout, encode_rollout
from eopd_trainer.queue.streams import Keys, StreamQueue, connect
from eopd_trainer.rollout.publisher import make_rollout
from eopd_trainer.rollout.requests import Pending, RequestShaper, TokenRemap
from eopd_trainer.teacher_context import TeacherPrompts
from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


def _pending(task_seq: int, rng) -> Pending:
    prompt = rng.integers(0, 49152, int(rng.integers(4, 12))).tolist()
    response = rng.integers(0, 49152, int(rng.integers(3, 17))).tolist()  # <= rollout.max_response_length 16
    task = PromptTask(task_seq, task_seq, 1, 0)
    return Pending(f"e{task_seq}", task, 0, prompt, response, False, np.full(len(response), -1.0, np.float32), 0, 0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_hidden_states_travel_the_queue_and_give_the_teachers_statistics(tiny_teacher, dtype):
    cfg = load_config("configs/tiny.yaml", [f"teacher.target={tiny_teacher.target}", f"teacher.hidden_states={dtype}",
                                            "teacher.temperature=0.9"])
    t = cfg.teacher
    rng = np.random.default_rng(0)
    pending = [_pending(i, rng) for i in range(3)]
    shaper = RequestShaper("w0", t, None, TeacherPrompts())
    batches, refused = shaper.shape(pending)
    assert not refused and all(b.hidden_states == dtype for b in batches)
    with TeacherClient(t.target) as client:
        answers = dict(client.score_stream(iter(batches)))
    rollouts = []
    for rid, scores in answers.items():
        for p, s in zip(shaper.take(rid), scores, strict=True):
            rollouts.append(make_rollout(p.task, p.sample_index, p.prompt_ids, p.response_ids, p.old_logprobs, s,
                                         remap=TokenRemap(), rollout_cfg=cfg.rollout, worker_id="w0", policy_version=0,
                                         truncated=False, sampled_unix_ns=0, scored_unix_ns=0, teacher_model="tiny"))
    head = fetch_teacher_head(t)
    limits = RolloutLimits.from_config(cfg, hidden_size=head.info.hidden_size)
    with running_redis() as server:
        keys = Keys("hidden")
        q = StreamQueue(connect(server.url), keys.rollouts, "learner", "c", keys.dead)
        q.ensure_group()
        for r in rollouts:
            q.add(encode_rollout(r))
        got = [decode_rollout(e.data, vocab_size=49152, limits=limits) for e in q.read_new(10, None)]
    assert [r.rollout_id for r in got] == [r.rollout_id for r in rollouts]
    for r in got:  # bytes: the hidden states are n x d x (2 or 4) on top of the top-k rollout
        assert len(r.teacher_hidden) == r.num_response_tokens * hidden_bytes_per_token(64, dtype)
    # The learner's view: flat rows in rollout order, the teacher's temperature applied.
    rows = teacher_logit_rows(got, head, t)
    targets = torch.cat([torch.from_numpy(r.response_ids.astype(np.int64)) for r in got])
    st = head_statistics(head, torch.cat(rollouts_hidden(got, head)), targets, rows.inv_temperature, t.top_k, chunk_size=8)
    sent = {name: np.concatenate([getattr(r, name) for r in got]) for name in
            ("teacher_entropies", "teacher_logprobs", "teacher_topk_logprobs")}
    np.testing.assert_allclose(st.entropies.numpy(), sent["teacher_entropies"], atol=TOLERANCE[dtype], rtol=0)
    np.testing.assert_allclose(st.token_logprobs.numpy(), sent["teacher_logprobs"], atol=TOLERANCE[dtype], rtol=0)
    np.testing.assert_allclose(st.topk_logprobs.numpy(), sent["teacher_topk_logprobs"], atol=TOLERANCE[dtype], rtol=0)
    # The on-demand rows (what a full-vocabulary loss reads) are the same logits, by index or by span.
    logp = rows(torch.tensor([0, 2, 5])).log_softmax(-1)
    np.testing.assert_allclose(logp.gather(-1, targets[[0, 2, 5], None]).squeeze(-1).numpy(),
                               sent["teacher_logprobs"][[0, 2, 5]], atol=TOLERANCE[dtype], rtol=0)
    assert torch.equal(rows(1, 3), rows(torch.tensor([1, 2])))
    # Batched [B, T] layout: rollout b's token i at row b * T + i.
    width = max(r.num_response_tokens for r in got)
    batched = teacher_logit_rows(got, head, t, lead=(len(got), width))
    assert torch.equal(batched(torch.tensor([width])), rows(torch.tensor([got[0].num_response_tokens])))


def test_a_rollout_naming_another_head_or_malformed_hidden_states_is_refused(tiny_teacher):
    t = TeacherConfig(target=tiny_teacher.target, hidden_states="bfloat16")
    with TeacherClient(t.target) as client:
        (s,) = client.score([("a", list(range(1, 12)), 6)], hidden_states="bfloat16")
    cfg = load_config("configs/tiny.yaml", [f"teacher.target={t.target}", "teacher.hidden_states=bfloat16"])
    p = _pending(0, np.random.default_rng(1))
    r = make_rollout(p.task, 0, list(range(1, 7)), list(range(7, 12)), np.zeros(5, np.float32), s, remap=TokenRemap(),
                     rollout_cfg=cfg.rollout, worker_id="w", policy_version=0, truncated=False, sampled_unix_ns=0,
                     scored_unix_ns=0)
    head = fetch_teacher_head(t)
    data = encode_rollout(r)
    assert decode_rollout(data).teacher_hidden == r.teacher_hidden
    # The learner's size bound grows by what the hidden states add: max_response_length x d x 2 bytes.
    grown = RolloutLimits.from_config(cfg, hidden_size=64).max_bytes - RolloutLimits.from_config(cfg).max_bytes
    assert grown == cfg.rollout.max_response_length * 64 * 2
    from dataclasses import replace
    with pytest.raises(PoisonMessage, match=r"teacher_hidden_states has 638 bytes, expected 640"):
        decode_rollout(encode_rollout(replace(r, teacher_hidden=r.teacher_hidden[:-2])))
    with pytest.raises(ValueError, match="belong to output head 0+, the learner holds"):
        rollouts_hidden([replace(r, teacher_head_fingerprint="0" * 64)], head)
