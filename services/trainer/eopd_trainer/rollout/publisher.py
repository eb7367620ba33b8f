"""Rollouts out: `make_rollout`, the one builder of a Rollout (a student sample scored by the
teacher, a student sample graded (variant grpo: its reward from the task grader, no teacher scores),
or a teacher-generated response), and `Publisher`, which adds them to `<ns>:rollouts`, waiting while
the stream is over `queue.max_backlog`."""

from __future__ import annotations

import asyncio

import numpy as np

from ..config import RolloutConfig, RunConfig
from ..faults import Faults, corrupt_bytes
from ..queue.messages import ORIGIN_STUDENT, PromptTask, Rollout, encode_rollout, now_ns, rollout_id
from ..queue.namespace import RunQueue
from ..queue.streams import StreamQueue
from .metrics import WorkerMetrics
from .requests import Pending, TeacherSource, TokenRemap
from .task_book import TaskBook


def make_rollout(task: PromptTask, sample_index: int, prompt_ids, response_ids, old_logprobs: np.ndarray, scores,
                 *, remap: TokenRemap, rollout_cfg: RolloutConfig, worker_id: str, policy_version: int, truncated: bool,
                 sampled_unix_ns: int, scored_unix_ns: int, teacher_model: str = "", teacher: str = "",
                 origin: str = ORIGIN_STUDENT, reward: float | None = None, candidate_ids: np.ndarray | None = None,
                 mixture: tuple = ()) -> Rollout:
    """A Rollout of `task`'s sample `sample_index`: `response_ids` in the student's ids, the
    teacher's `scores` (a SequenceScores: per-token log-probs, entropies, top-k, and the
    candidates' log-probs when `candidate_ids` were sent; its top-k ids mapped back through
    `remap`), or None for a graded-only sample (empty teacher arrays, top_k 0). The teacher's packed
    hidden states, when its answer carries them (teacher.hidden_states), go into the rollout as sent."""
    hidden = getattr(scores, "hidden_states", None)
    if scores is None:
        t_lp = t_ent = np.zeros(0, dtype=np.float32)
        t_ids, t_tlp = np.zeros((0, 0), dtype=np.int32), np.zeros((0, 0), dtype=np.float32)
    else:
        t_lp = np.asarray(scores.token_logprobs, dtype=np.float32)
        t_ent = np.asarray(scores.entropies, dtype=np.float32)
        t_ids = remap.student_ids(np.asarray(scores.topk_ids, dtype=np.int32))
        t_tlp = np.asarray(scores.topk_logprobs, dtype=np.float32)
    return Rollout(
        rollout_id=rollout_id(task.task_seq, sample_index), task_id=task.task_id, prompt_index=task.prompt_index,
        sample_index=sample_index, prompt_ids=np.asarray(prompt_ids, dtype=np.int32),
        response_ids=np.asarray(response_ids, dtype=np.int32), old_logprobs=old_logprobs,
        teacher_logprobs=t_lp, teacher_entropies=t_ent, teacher_topk_ids=t_ids, teacher_topk_logprobs=t_tlp,
        policy_version=policy_version, truncated=truncated, sampling_temperature=rollout_cfg.temperature,
        top_p=rollout_cfg.top_p, worker_id=worker_id, sampled_unix_ns=sampled_unix_ns, scored_unix_ns=scored_unix_ns,
        teacher_model=teacher_model, teacher=teacher, origin=origin, reward=reward, mixture=mixture,
        candidate_ids=candidate_ids,  # student ids (before the remap), scored by the teacher
        candidate_logprobs=scores.candidate_logprobs if candidate_ids is not None else None,
        teacher_hidden=hidden,
        teacher_hidden_dtype=scores.hidden_dtype if hidden is not None else "",
        teacher_hidden_size=scores.hidden_size if hidden is not None else 0,
        teacher_head_fingerprint=scores.output_head_fingerprint if hidden is not None else "",
    )


class Publisher:
    """Publishes a worker's rollouts on the rollouts stream (with backpressure and the
    `rollout.publish` / `rollout.after_publish` fault points) and counts them (`published`)."""

    def __init__(self, rollouts: StreamQueue, queue: RunQueue, cfg: RunConfig, faults: Faults,
                 metrics: WorkerMetrics, worker_id: str, stop: asyncio.Event):
        self.rollouts = rollouts
        self.queue = queue  # backpressure and the done flag
        self.cfg = cfg
        self.faults = faults
        self.metrics = metrics
        self.worker_id = worker_id
        self.stop = stop
        self.published = 0

    def to_rollout(self, p: Pending, scores, source: TeacherSource, mixture: tuple = ()) -> Rollout:
        """A student sample scored by the teacher `source` (`scores`: its SequenceScores; `mixture`:
        the other teachers' statistics, route.mixture)."""
        return self._student_rollout(p, scores, remap=source.remap, teacher_model=source.model, teacher=source.name,
                                     candidate_ids=p.old_topk_ids, mixture=mixture)

    def to_graded_rollout(self, p: Pending, reward: float) -> Rollout:
        """A student sample graded, not scored (variant grpo): the task grader's `reward`, no teacher
        call (top_k 0, empty teacher arrays)."""
        return self._student_rollout(p, None, remap=TokenRemap(), reward=float(reward))

    def _student_rollout(self, p: Pending, scores, **kw) -> Rollout:
        return make_rollout(p.task, p.sample_index, p.prompt_ids, p.response_ids, p.old_logprobs, scores,
                            rollout_cfg=self.cfg.rollout, worker_id=self.worker_id,
                            policy_version=p.policy_version, truncated=p.truncated,
                            sampled_unix_ns=p.sampled_unix_ns, scored_unix_ns=now_ns(), **kw)

    async def publish(self, rollout: Rollout) -> bool:
        """Adds the rollout once the stream has room and counts it; False when the worker is
        stopping or the run is done first (nothing added: its task stays pending)."""
        if not await asyncio.to_thread(self._add, rollout):
            return False
        self.published += 1
        self.metrics.published.inc()
        self.metrics.tokens.inc(rollout.num_response_tokens)
        self.faults.hit("rollout.after_publish", count=self.published)
        return True

    async def publish_and_settle(self, rollout: Rollout, book: TaskBook, entry_id: str) -> bool:
        """Publishes the rollout of task `entry_id`, then settles it in the task book (the task is
        acknowledged once all its rollouts are). False when the worker is stopping or the run is
        done first: nothing published, nothing settled, the task stays pending and is reclaimed later."""
        if not await self.publish(rollout):
            return False
        await book.settle(entry_id, rollout.rollout_id)
        return True

    def _add(self, rollout: Rollout) -> bool:
        ok = self.queue.wait_for_room(self.cfg.queue.max_backlog, should_stop=self._should_stop, on_wait=self._on_wait)
        if ok:
            data = encode_rollout(rollout)
            if self.faults.hit("rollout.publish", count=self.published + 1):
                data = corrupt_bytes(data)
            self.rollouts.add(data)
        return ok

    def _should_stop(self) -> bool:
        return self.stop.is_set() or self.queue.is_done()

    def _on_wait(self, _backlog: int) -> None:
        self.metrics.backpressure_waits.inc()
