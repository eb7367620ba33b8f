"""Scored rollouts out (`Publisher`): a Rollout message is made of a sampled response and its
teacher scores (or, variant grpo, its reward from the task grader), and added to `<ns>:rollouts`,
waiting while the stream is over `queue.max_backlog`."""

from __future__ import annotations

import asyncio

import numpy as np

from ..config import RunConfig
from ..faults import Faults, corrupt_bytes
from ..queue.messages import Rollout, encode_rollout, now_ns
from ..queue.namespace import RunQueue
from ..queue.streams import StreamQueue
from .metrics import WorkerMetrics
from .requests import Pending, remap_ids
from .task_book import TaskBook


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
        self.inverse_remap = {v: k for k, v in cfg.teacher.token_remap.items()}
        self.published = 0

    def to_rollout(self, p: Pending, scores, teacher_model: str) -> Rollout:
        topk_ids = remap_ids(np.asarray(scores.topk_ids, dtype=np.int32), self.inverse_remap)
        ro = self.cfg.rollout
        return Rollout(
            rollout_id=p.rollout_id, task_id=p.task.task_id, prompt_index=p.task.prompt_index,
            sample_index=p.sample_index, prompt_ids=np.asarray(p.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(p.response_ids, dtype=np.int32), old_logprobs=p.old_logprobs,
            teacher_logprobs=scores.token_logprobs, teacher_entropies=scores.entropies, teacher_topk_ids=topk_ids,
            teacher_topk_logprobs=scores.topk_logprobs, policy_version=p.policy_version, truncated=p.truncated,
            sampling_temperature=ro.temperature, top_p=ro.top_p, worker_id=self.worker_id,
            sampled_unix_ns=p.sampled_unix_ns, scored_unix_ns=now_ns(), teacher_model=teacher_model,
            candidate_ids=p.old_topk_ids,  # student ids (before the remap), scored by the teacher below
            candidate_logprobs=scores.candidate_logprobs if p.old_topk_ids is not None else None,
        )

    def to_graded_rollout(self, p: Pending, reward: float) -> Rollout:
        """A student sample graded, not scored (variant grpo): the task grader's `reward`, no teacher
        call (top_k 0, empty teacher arrays)."""
        ro = self.cfg.rollout
        empty = np.zeros(0, dtype=np.float32)
        t = now_ns()
        return Rollout(
            rollout_id=p.rollout_id, task_id=p.task.task_id, prompt_index=p.task.prompt_index,
            sample_index=p.sample_index, prompt_ids=np.asarray(p.prompt_ids, dtype=np.int32),
            response_ids=np.asarray(p.response_ids, dtype=np.int32), old_logprobs=p.old_logprobs,
            teacher_logprobs=empty, teacher_entropies=empty, teacher_topk_ids=np.zeros((0, 0), dtype=np.int32),
            teacher_topk_logprobs=np.zeros((0, 0), dtype=np.float32), policy_version=p.policy_version,
            truncated=p.truncated, sampling_temperature=ro.temperature, top_p=ro.top_p, worker_id=self.worker_id,
            sampled_unix_ns=p.sampled_unix_ns, scored_unix_ns=t, reward=float(reward),
        )

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
