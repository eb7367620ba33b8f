"""The learner's Redis side (rank 0 only, never torch): the namespace lease, the task and rollout
streams, the policy announcement and the exit codes they cause.

`RolloutFeed` writes only `state.feed` (`FeedState`: counters, settled, tasks published) of the
`LearnerState` the loop hands it in `setup_queues`; it reads `policy_version`, `iteration` and the
ledger; the loop owns the rest. The queue is the run's `RunQueue` (`queue/namespace.py`), never a
Redis client. Every rollout is decoded once, here: `Collected` carries the decoded rollouts (rank 0
trains on them) and their bytes (broadcast to the other ranks, which decode them there).
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..config import RunConfig
from ..config.stages import IterationPlan, plan_iteration, task_iteration, task_teacher_samples
from ..data import prompt_index
from ..queue.lease import LeaseLost
from ..queue.messages import (
    PoisonMessage,
    PolicyVersion,
    PromptTask,
    Rollout,
    RolloutLimits,
    decode_rollout,
)
from ..queue.namespace import RunQueue
from ..queue.rollout_checks import check_rollout_metadata
from ..queue.signing import signer_for
from ..queue.weights_buffer import FORMAT as BUFFER_FORMAT
from ..queue.weights_buffer import buffer_holds
from .ledger import (
    Admit,
    Ledger,
    RejectStreak,
    admit,
    learner_starts_holding,
    replacement_tasks_needed,
    tasks_to_publish,
)
from .rebuild import rebuild_if_lost
from .state import LearnerState
from .teacher_stats import per_teacher_stats

log = logging.getLogger("eopd.learner")

# Exit statuses of eopd-train: 0 done (or stopped by a signal), 2 configuration error or another
# learner holds the namespace's lease, 4 checkpoint write failed, 5 systematic rejection of
# rollouts, 6 the lease was lost (another learner took the namespace over).
EXIT_REJECTED = 5
EXIT_LEASE_LOST = 6


class LearnerAbort(RuntimeError):
    """Training cannot go on; `code` is the exit status (every rank raises it)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


@dataclass
class Collected:
    """One iteration's B admissible rollouts, decoded once; their bytes (for the broadcast to the
    other ranks), their stream entry ids and the collection statistics."""

    rollouts: list[Rollout]
    blobs: list[bytes]
    entry_ids: list[str]
    stats: dict[str, float]


@dataclass
class _Batch:
    """The batch being collected: admitted rollouts by id (entry id, bytes, decoded), their staleness,
    the seconds blocked on the rollouts stream (the learner's idle time), the last progress note."""

    need: int
    version: int
    plan: IterationPlan  # the iteration's loss variant and what it needs of a rollout
    rollouts: dict[str, tuple[str, bytes, Rollout]] = field(default_factory=dict)
    staleness: list[int] = field(default_factory=list)
    queue_wait: float = 0.0
    last_note: float = field(default_factory=time.monotonic)

    @property
    def missing(self) -> int:
        return self.need - len(self.rollouts)


class RolloutFeed:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.stop_requested = False  # set by the loop on SIGTERM/SIGINT: collect returns None
        self.lease = None  # the namespace's Lease (`RunQueue.lease`) once acquired
        limit = cfg.queue.max_rejected_in_a_row or 4 * cfg.train.batch_size
        self.rejects = RejectStreak(limit)
        self.signer = signer_for(cfg.queue.auth_key_file)
        if not self.signer.enabled:
            log.warning("queue.auth_key_file is not set: queue messages are not authenticated (anyone who can write "
                        "to the Redis can forge rollouts, tasks and policy announcements)")
        self.limits = RolloutLimits.from_config(cfg)  # bounds on every decoded rollout's fields
        self.published_tasks = 0  # <ns>:tasks:next as this learner last read or wrote it

    def admit_teacher_hidden(self, hidden_size: int) -> None:
        """Admits rollouts that carry the teacher's hidden states (teacher.hidden_states) of width
        `hidden_size` (the teacher's output head's): the size limits grow by what they add."""
        self.limits = RolloutLimits.from_config(self.cfg, hidden_size=hidden_size)

    # Set-up ----------------------------------------------------------------------------------
    def acquire_lease(self) -> None:
        """One learner per namespace (rank 0 holds `<ns>:lease`); raises LeaseHeld -> exit 2."""
        cfg = self.cfg
        self.queue = RunQueue.connect(cfg.queue.redis_url, cfg.queue.namespace, signer=self.signer,
                                      dead_maxlen=cfg.queue.dead_letter_maxlen)
        self.lease = self.queue.lease(ttl_ms=int(cfg.queue.lease_ttl_s * 1000),
                                      description=f"eopd-train run_dir={cfg.run_dir}")
        self.lease.acquire(wait_s=cfg.queue.lease_wait_s)

    def setup_queues(self, state: LearnerState, num_prompts: int, vocab_size: int) -> None:
        cfg = self.cfg
        self.state, self.num_prompts, self.vocab_size = state, num_prompts, vocab_size
        self.ledger: Ledger = state.ledger  # read here (admission), written by the loop
        consumer = "learner"
        self.rollouts = self.queue.rollouts(consumer, record_drops=True)
        # Unauthenticated entries are dead-lettered inside StreamQueue's reads: never decoded here and
        # never counted by `self.rejects` (a stranger's junk cannot stop the run; see docs/reliability.md).
        self.tasks = self.queue.tasks(consumer)
        self.rollouts.ensure_group()
        self.tasks.ensure_group()
        self.queue.clear_done()
        rebuilt = rebuild_if_lost(self.queue, self.state, n_samples=cfg.rollout.n_samples,
                                  prompt_of=lambda seq: prompt_index(seq, self.num_prompts, seed=cfg.seed,
                                                                     shuffle=cfg.data.shuffle),
                                  teacher_of=lambda seq: self.teacher_samples(seq, self.state.iteration + 1))
        if rebuilt:
            log.warning("%s", rebuilt)
        # Entries delivered to any learner consumer before a crash: take them over, re-read them first.
        self.rollouts.claim_idle(0, 1_000_000)
        self._pending = collections.deque(self._within_delivery_cap(self.rollouts.read_pending(1_000_000)))
        self.published_tasks = self.queue.task_counter() or 0
        if self._pending:
            log.info("found %d unacknowledged rollouts from before a restart", len(self._pending))

    def _within_delivery_cap(self, entries: list) -> list:
        """Dead-letters the pending rollouts that more than rollout.max_rollout_deliveries learner
        starts have found pending (see `learner_starts_holding`; one committed already is kept: it
        is dropped as a duplicate); returns the others."""
        cap = self.cfg.rollout.max_rollout_deliveries
        delivered = self.rollouts.delivery_counts(len(entries) + 1000)
        keep = []
        for e in entries:
            starts = learner_starts_holding(delivered.get(e.entry_id, 1))
            if starts > cap and not self._committed(e):
                self.rollouts.dead_letter(e, f"rollout held across {starts} learner starts without being committed "
                                             f"(rollout.max_rollout_deliveries {cap}): it may crash the learner")
                continue
            keep.append(e)
        return keep

    def _committed(self, e) -> bool:
        try:
            return decode_rollout(e.data or b"").rollout_id in self.ledger
        except PoisonMessage:
            return False

    # Policy announcement ----------------------------------------------------------------------
    def announce(self, pv: PolicyVersion) -> None:
        self.queue.announce(pv)

    def announced_version(self) -> int:
        pv = self.queue.announcement()
        if pv is not None and pv.format == BUFFER_FORMAT:  # the buffer may hold newer, unannounced bytes
            return pv.version if buffer_holds(pv) else -1
        return -1 if pv is None or not Path(pv.uri).is_file() else pv.version

    # Tasks -----------------------------------------------------------------------------------
    def publish_tasks(self, iteration: int, replacements: int = 0) -> int:
        """Publishes the tasks `iteration` needs (and `replacements` more), atomically with the
        task counter: a restarted learner never publishes the same task twice."""
        cfg = self.cfg
        published = self.queue.task_counter() or 0
        counters = self.state.feed.counters
        counters.replacement_tasks += replacements
        n_new = tasks_to_publish(iteration=iteration, batch_size=cfg.train.batch_size, n_samples=cfg.rollout.n_samples,
                                 max_staleness=cfg.effective_max_staleness, published_tasks=published,
                                 replacement_tasks=counters.replacement_tasks)
        self.published_tasks = published
        if n_new <= 0:
            return 0
        tasks = []
        for seq in range(published, published + n_new):
            meant_for = task_iteration(seq, iteration=iteration, prompts_per_iteration=cfg.prompts_per_iteration,
                                       max_staleness=cfg.effective_max_staleness)
            tasks.append(PromptTask(seq, prompt_index(seq, self.num_prompts, seed=cfg.seed, shuffle=cfg.data.shuffle),
                                    cfg.rollout.n_samples, self.state.policy_version,
                                    num_teacher_samples=self.teacher_samples(seq, meant_for)))
        self.queue.publish_tasks(tasks, counter=published + n_new)
        self.published_tasks = published + n_new
        return n_new

    def teacher_samples(self, seq: int, iteration: int) -> int:
        """num_teacher_samples of task `seq` meant for `iteration` (config/stages.py: all during the
        KD warm-up and for kd, drawn per sample for gkd, else 0)."""
        cfg = self.cfg
        return task_teacher_samples(cfg.loss, cfg.train.warmup_kd_iterations, seed=cfg.seed, task_seq=seq,
                                    num_samples=cfg.rollout.n_samples, iteration=iteration)

    def record_tasks_published(self) -> None:
        """The task counter into the state at a commit (what a rebuild of a lost queue starts from)."""
        self.state.feed.tasks_published = self.queue.task_counter() or 0

    # Rollouts --------------------------------------------------------------------------------
    def collect(self, iteration: int, plan: IterationPlan | None = None) -> Collected | None:
        """B admissible rollouts for `plan` (default: the iteration's own), decoded once, with their
        bytes, entry ids and collection statistics; None when a stop was requested (SIGTERM/SIGINT)
        while waiting."""
        self.publish_tasks(iteration)
        plan = plan or plan_iteration(self.cfg.loss, self.cfg.train.warmup_kd_iterations, iteration)
        batch = _Batch(need=self.cfg.train.batch_size, version=self.state.policy_version, plan=plan)
        while batch.missing > 0:
            if self.stop_requested:
                return None
            entries = self._next_entries(batch)
            if not entries:
                self._when_idle(iteration, batch)
                continue
            for e in entries:
                self._admit(e, batch)
        self._sync_counters()
        values = list(batch.rollouts.values())
        return Collected(rollouts=[v[2] for v in values], blobs=[v[1] for v in values],
                         entry_ids=[v[0] for v in values], stats=self._stats(batch))

    def _next_entries(self, batch: _Batch) -> list:
        """Pending entries from before a restart first, then new ones (blocking up to block_ms)."""
        entries = []
        while self._pending and len(entries) < batch.missing:
            entries.append(self._pending.popleft())
        if not entries:
            t_wait = time.monotonic()
            entries = self.rollouts.read_new(batch.missing, self.cfg.queue.block_ms)
            batch.queue_wait += time.monotonic() - t_wait
        return entries

    def _when_idle(self, iteration: int, batch: _Batch) -> None:
        """Nothing read: replacement tasks once every task is done, and a note every 30 s."""
        cfg = self.cfg
        # Waiting = not yet read by the learner: XLEN also counts the entries it holds (this
        # batch, and with checkpoint.every > 1 the iterations trained since the last commit).
        extra = replacement_tasks_needed(
            missing_rollouts=batch.missing, n_samples=cfg.rollout.n_samples,
            tasks_outstanding=self.tasks.length(), rollouts_waiting=self.rollouts.undelivered())
        if extra:
            log.info("iteration %d short of %d rollouts with every task done: %d replacement tasks",
                     iteration, batch.missing, extra)
            self.publish_tasks(iteration, replacements=extra)
        if time.monotonic() - batch.last_note > 30:
            log.info("iteration %d waiting for rollouts: %d/%d (unread backlog %d, tasks outstanding %d)",
                     iteration, len(batch.rollouts), batch.need, self.rollouts.undelivered(), self.tasks.length())
            batch.last_note = time.monotonic()

    def _admit(self, e, batch: _Batch) -> None:
        """Decodes and checks one entry: into the batch, or dead-lettered, or acknowledged and dropped."""
        cfg = self.cfg
        try:
            r = decode_rollout(e.data or b"", vocab_size=self.vocab_size, limits=self.limits)
            plan = batch.plan
            check_rollout_metadata(r, temperature=cfg.loss.temperature, num_candidates=plan.loss.num_candidates,
                                   n_samples=cfg.rollout.n_samples, published_tasks=self.published_tasks,
                                   variant=plan.stage, needs_teacher_scores=plan.needs_teacher_scores,
                                   accepts_teacher_origin=plan.accepts_teacher_origin, needs_reward=plan.needs_reward)
        except PoisonMessage as exc:
            self.rollouts.dead_letter(e, exc.reason)  # counted in <ns>:counts (dead_letter)
            self._rejected(f"dead letter {e.entry_id}: {exc.reason}")
            return
        # A teacher-generated rollout (origin teacher) is exempt from the staleness drop: no student
        # weights made it. A policy-gradient iteration never admits one (dead-lettered above).
        d = admit(r.rollout_id, r.policy_version, current_version=batch.version,
                  max_staleness=cfg.effective_max_staleness, trained=self.ledger, in_batch=set(batch.rollouts),
                  off_policy=r.off_policy)
        if d.kind is Admit.TRAIN:
            batch.rollouts[r.rollout_id] = (e.entry_id, e.data, r)
            batch.staleness.append(d.staleness)
            self.rejects.admitted()
            return
        # Not trained: acknowledged, deleted and recorded in <ns>:dropped + <ns>:counts atomically.
        # duplicate: its training effect is committed or in this batch; stale: replaced once every
        # task is done (_when_idle); future: sampled by weights of an uncommitted future this learner
        # rolled back from.
        self.rollouts.drop(e, d.kind.value, rollout_id=r.rollout_id, policy_version=r.policy_version,
                           staleness=d.staleness)
        if d.kind is not Admit.DUPLICATE:
            self.state.feed.settled.append(r.rollout_id)  # its task is not republished by a rebuild
            self._rejected(f"{d.kind.value} {r.rollout_id}: sampled by policy version {r.policy_version}, "
                           f"learner at {batch.version} (max staleness {cfg.effective_max_staleness})")

    def _stats(self, batch: _Batch) -> dict[str, float]:
        cfg = self.cfg
        counters = self.state.feed.counters
        rollouts = [v[2] for v in batch.rollouts.values()]
        staleness = batch.staleness
        graded = [r.reward for r in rollouts if r.reward is not None]  # grpo: the task grader's 1.0 / 0.0
        reward = {"reward_mean": sum(graded) / len(graded)} if graded else {}
        by_teacher = per_teacher_stats(rollouts, cfg.loss.tau, cfg.loss.gate) if cfg.teachers else {}
        return {
            **reward,
            **by_teacher,
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
            "queue_backlog": float(self.rollouts.undelivered()),  # scored rollouts not yet read by the learner
            "stale_dropped_total": float(counters.stale_dropped),
            "duplicates_total": float(counters.duplicates),
            "dead_letters_total": float(counters.dead_letters),
            "response_length_mean": sum(r.num_response_tokens for r in rollouts) / len(rollouts),
            "truncated_frac": sum(r.truncated for r in rollouts) / len(rollouts),
            "teacher_origin_frac": sum(r.off_policy for r in rollouts) / len(rollouts),
            "sample_to_train_s": (time.time_ns() - min(r.sampled_unix_ns for r in rollouts)) / 1e9,
            "queue_wait_s": batch.queue_wait,
        }

    def _rejected(self, reason: str) -> None:
        if self.rejects.reject(reason):
            raise LearnerAbort(self.rejects.message(), EXIT_REJECTED)

    def _sync_counters(self) -> None:
        """The drop and dead-letter totals from Redis (exact across crashes) into the state."""
        c = self.queue.counts()
        counters = self.state.feed.counters
        counters.stale_dropped = c.get("stale", 0) + c.get("future", 0)
        counters.duplicates, counters.dead_letters = c.get("duplicate", 0), c.get("dead_letter", 0)

    # Lease fencing and the end -----------------------------------------------------------------
    def check_lease(self) -> LeaseLost | None:
        """None while the lease is ours, else why not (the loop broadcasts it before a commit)."""
        try:
            self.lease.check()
        except LeaseLost as exc:
            return exc
        return None

    def ack_fenced(self, entry_ids: list[str]) -> None:
        """Acknowledges (and deletes) the committed entries, only while the lease is ours."""
        try:
            self.lease.fenced(lambda pipe: self.rollouts.queue_ack(pipe, entry_ids))
        except LeaseLost as exc:
            raise LearnerAbort(f"checkpoint of iteration {self.state.iteration} committed but its entries not "
                               f"acknowledged: {exc}", EXIT_LEASE_LOST) from None

    def finish(self) -> None:
        """Training done: `<ns>:done` tells the workers and `eopd run`."""
        self.queue.mark_done()

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()
