"""The worker's book of tasks (`TaskBook`): which tasks it holds, and the one place they are
taken (its own pending entries after a restart, entries idle on dead workers, new ones), settled
(acknowledged once every rollout is published, or dead-lettered with the reasons) and kept from
looking idle (the heartbeat)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging

from ..config import RunConfig
from ..queue.messages import PoisonMessage, PromptTask, decode_task
from ..queue.streams import Entry, StreamQueue
from .metrics import WorkerMetrics

log = logging.getLogger("eopd.rollout")


class TaskBook:
    """The tasks a worker holds, from the moment it takes them until they are settled. It alone
    acknowledges and dead-letters tasks."""

    def __init__(self, tasks: StreamQueue, cfg: RunConfig, metrics: WorkerMetrics, worker_id: str):
        self.tasks = tasks
        self.metrics = metrics
        self.worker_id = worker_id
        self.cfg = cfg
        self.max_deliveries = cfg.rollout.max_task_deliveries
        self.claim_idle_ms = cfg.rollout.claim_idle_ms
        self.block_ms = cfg.queue.block_ms
        self.resumed: collections.deque[Entry] = collections.deque()  # own pending entries, handed out first
        self._held: set[str] = set()  # entry ids taken and not yet settled
        self._remaining: dict[str, int] = {}  # entry id -> rollouts not yet accounted for
        self._data: dict[str, bytes] = {}  # entry id -> its PromptTask bytes (for a dead letter)
        self._unscored: dict[str, dict[str, list[str]]] = {}  # entry id -> reason -> rollouts not scored

    def resume_pending(self) -> None:
        """Takes back this worker id's unacknowledged tasks from before a restart, under the same
        delivery limit as tasks reclaimed from others (so a task that kills its worker, restarted
        under the same id, is not retried forever)."""
        self.resumed.extend(self._within_delivery_limit(self.tasks.read_pending(100_000)))
        if self.resumed:
            log.info("resuming %d pending tasks of %s", len(self.resumed), self.worker_id)

    def next_entries(self, count: int) -> list[Entry]:
        """Up to `count` entries: resumed ones first, then idle ones of other workers (XAUTOCLAIM),
        then new ones (blocking up to queue.block_ms). Synchronous (Redis)."""
        out: list[Entry] = []
        while self.resumed and len(out) < count:
            out.append(self.resumed.popleft())
        if not out:
            claimed = self.tasks.claim_idle(self.claim_idle_ms, count)
            out = self._within_delivery_limit([e for e in claimed if e.entry_id not in self._held])
            if out:
                log.info("reclaimed %d idle tasks", len(out))
                self.metrics.reclaimed.inc(len(out))
        if not out:
            out = self.tasks.read_new(count, self.block_ms)
        return out

    def _within_delivery_limit(self, entries: list[Entry]) -> list[Entry]:
        """Dead-letters the entries delivered more than rollout.max_task_deliveries times; returns
        the others that are still in the stream."""
        limit = self.max_deliveries
        for e in entries:
            if self.tasks.deliveries(e.entry_id) > limit:
                self.tasks.dead_letter(e, f"task delivered more than {limit} times")
        return [e for e in entries if self.tasks.contains(e.entry_id)]

    async def open(self, entries: list[Entry], num_prompts: int) -> list[tuple[str, PromptTask]]:
        """Decodes the entries into tasks and holds them; a poison entry (undecodable, naming a
        prompt beyond the `num_prompts`, asking for more samples than rollout.n_samples or for a
        policy version past the run's last iteration) is dead-lettered with the reason instead."""
        work: list[tuple[str, PromptTask]] = []
        last_version = self.cfg.total_iterations(num_prompts)  # the policy version is the iteration
        for e in entries:
            try:
                task = decode_task(e.data or b"", max_num_samples=self.cfg.rollout.n_samples,
                                   max_policy_version=last_version)
                if task.prompt_index >= num_prompts:
                    raise PoisonMessage(f"PromptTask {task.task_id}: prompt_index {task.prompt_index} "
                                        f"outside the {num_prompts} prompts")
            except PoisonMessage as exc:
                await asyncio.to_thread(self.tasks.dead_letter, e, exc.reason)
                self.metrics.dead.inc()
                continue
            work.append((e.entry_id, task))
            self._data[e.entry_id] = e.data or b""
            self._held.add(e.entry_id)
        return work

    def expect(self, entry_id: str, rollouts: int) -> None:
        """The task `entry_id` is settled once `rollouts` rollouts are accounted for."""
        self._remaining[entry_id] = rollouts

    async def settle(self, entry_id: str, rollout_id: str, reason: str | None = None) -> None:
        """One rollout of a task accounted for: published, or not scored (`reason`). Once all
        are, the task is acknowledged, or, if any was not scored, dead-lettered with the
        reasons (acknowledged and deleted: not retried; the learner replaces what is missing)."""
        eid = entry_id
        if reason is not None:
            self._unscored.setdefault(eid, {}).setdefault(reason, []).append(rollout_id)
        self._remaining[eid] -= 1
        if self._remaining[eid]:
            return
        del self._remaining[eid]
        data, reasons = self._data.pop(eid, b""), self._unscored.pop(eid, None)
        if reasons:
            why = "; ".join(f"rollouts {', '.join(ids)} not scored: {r}" for r, ids in reasons.items())
            await asyncio.to_thread(self.tasks.dead_letter, Entry(eid, data), why)
            self.metrics.dead.inc()
        else:
            await asyncio.to_thread(self.tasks.ack, [eid])
        self._held.discard(eid)

    def held(self) -> list[str]:
        """The entry ids this worker holds: taken and not settled, or resumed and not yet taken."""
        return [*self._held, *(e.entry_id for e in self.resumed)]

    async def heartbeat(self) -> None:
        """Keeps the tasks this worker holds from looking idle to other workers' XAUTOCLAIM
        while a long batch is sampled or scored (rollout.claim_idle_ms). Runs until cancelled."""
        period = self.claim_idle_ms / 3000
        while True:
            await asyncio.sleep(period)
            held = self.held()
            if held:
                with contextlib.suppress(Exception):  # a Redis hiccup: the next beat retries
                    await asyncio.to_thread(self.tasks.touch, held)
