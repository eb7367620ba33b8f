"""The learner (`eopd-train`): scored rollouts in, DeepSpeed optimizer steps, checkpoints and
published weights out.

One iteration i (Algorithm 1), starting from policy version v = i - 1:

1. rank 0 publishes the PromptTasks the iteration needs (sync: exactly B rollouts' worth asking
   for version v; async: up to `max_staleness` iterations ahead) with the task counter in one
   MULTI/EXEC, so a restart never publishes them twice;
2. rank 0 collects B admissible rollouts from the consumer group (its own pending entries first,
   after a restart): undecodable or inconsistent ones go to the dead-letter stream, duplicates
   (already trained or already in the batch) are acknowledged, staler than allowed are dropped,
   counted and replaced by new tasks;
3. the rollouts' bytes are broadcast to every rank; the B rollouts are shuffled deterministically
   and split into B / B_mini mini-batches; each is one optimizer step made of micro-batches
   (gradient accumulation, data parallel over ranks), the loss from `compute_loss` with the
   token-mean over the whole mini-batch; the loss variant is the iteration's (`config/stages.py`:
   "kd" during the first train.warmup_kd_iterations, then loss.variant);
4. checkpoint commit (DeepSpeed state + HF export + trainer_state.json with the ledger of trained
   rollout ids), then the new weights are published as version i, then the iteration's stream
   entries are acknowledged and deleted.

Rank 0's Redis side is `feed.py` (RolloutFeed), every rank's DeepSpeed side `trainer.py`
(PolicyTrainer), the records `records.py` (IterationLog); the command line is `cli.py`
(`eopd-train`, `python -m eopd_trainer.learner`).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from eopd_common.memory import release_freed

from ..config import RunConfig, dump_config
from ..config.stages import IterationPlan, plan_iteration
from ..data import load_prompts
from ..faults import Faults
from ..queue.messages import decode_rollout
from .distributed import broadcast_blobs, broadcast_int, destroy_process_group
from .feed import EXIT_LEASE_LOST, Collected, LearnerAbort, RolloutFeed
from .alarms import stop_reason
from .metrics import resumed_sink
from .records import IterationLog
from .state import LearnerState
from .trainer import PolicyTrainer

log = logging.getLogger("eopd.learner")

EXIT_ALARM = 7  # train.stop_on: an alarm listed there fired (alarms.py); the reason is in the log and the metrics


class LearnerLoop:
    """The iteration loop over a PolicyTrainer (every rank) and a RolloutFeed (used on rank 0 only)."""

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.faults = Faults(cfg.faults)
        self.trainer = PolicyTrainer(cfg, self.faults)
        self.feed = RolloutFeed(cfg)

    @property
    def stop_requested(self) -> bool:
        return self.feed.stop_requested

    def request_stop(self, *_args) -> None:
        """SIGTERM/SIGINT: stop at the next point where nothing is half done (while waiting for
        rollouts). Whatever is not committed is redone after a restart: exactly-once holds."""
        self.feed.stop_requested = True

    # Set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.rank, self.world = self.trainer.init_process_group()
        if self.rank == 0:
            self.feed.acquire_lease()  # before anything slow: a second learner is refused at once
        self.run_dir = Path(cfg.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.num_prompts = len(load_prompts(cfg.data.train_files, cfg.data.field))
        self.total_iterations = cfg.total_iterations(self.num_prompts)
        self.trainer.setup(self.run_dir, self.total_iterations)
        self.state: LearnerState = self.trainer.restore_checkpoint() or LearnerState()
        self.ledger = self.state.ledger
        # After a restart: without the records of iterations trained again, with the committed one's.
        self.metrics = resumed_sink(self.run_dir, "train", self.state, tensorboard=cfg.logging.tensorboard,
                                    prometheus_port=cfg.logging.prometheus_port, enabled=self.rank == 0)
        if self.rank == 0:
            self.feed.setup_queues(self.state, self.num_prompts, self.trainer.vocab_size)
            if self.trainer.full_vocab_teacher is not None:  # rollouts carry the teacher's hidden states
                self.feed.admit_teacher_hidden(self.trainer.full_vocab_teacher.head.info.hidden_size)

    # Main loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        cfg = self.cfg
        start_iteration = iteration = self.state.iteration
        version = self.state.policy_version
        need_publish = 1 if self.rank == 0 and self.feed.announced_version() != version else 0
        if broadcast_int(need_publish):
            self.publish_weights(version)
        records = None
        if self.rank == 0:
            records = IterationLog(self.metrics, self.total_iterations, start_iteration, progress=cfg.logging.progress)
        unacked: list[str] = []  # entries of iterations trained since the last commit
        stopped = False
        for iteration in range(start_iteration + 1, self.total_iterations + 1):
            t0 = time.monotonic()
            plan = plan_iteration(cfg.loss, cfg.train.warmup_kd_iterations, iteration)  # kd during the warm-up
            collected = self._collect_everywhere(iteration, plan)
            if collected is None:
                stopped = True
                break
            t_collect = time.monotonic() - t0
            steps = self.trainer.train_iteration(iteration, collected.rollouts, self.state.optimizer_steps, plan.loss)
            # the iteration's forward, backward and optimizer steps (the rest of iteration_s: the collect,
            # the weights' publish and a checkpoint's write)
            stats = {**collected.stats, "steps_s": time.monotonic() - t0 - t_collect}
            self.state.optimizer_steps += len(steps)
            self.ledger.record(iteration, [r.rollout_id for r in collected.rollouts])
            self.state.iteration = self.state.policy_version = iteration
            self.state.global_steps = self.trainer.global_steps
            unacked.extend(collected.entry_ids)
            checkpoint_s = 0.0
            if iteration % cfg.checkpoint.every == 0 or iteration == self.total_iterations:
                checkpoint_s = self._commit(iteration, unacked, steps, stats, t_collect, t0, plan.stage)
                unacked = []
            else:
                self.publish_weights(iteration)
                # the step's activations, freed in small blocks glibc keeps (~0.5 GiB on the main job):
                # back to the system before the learner waits for rollouts, when the worker loads
                # this version and the job's memory would peak (issue 50 ask 5)
                release_freed()
            reason = None
            if records is not None:
                alarms = records.log(iteration, steps, {**stats, "checkpoint_s": checkpoint_s}, t_collect,
                                     time.monotonic() - t0,
                                     self.state.optimizer_steps, stage=plan.stage)
                reason = stop_reason(alarms, cfg.train.stop_on, iteration)
                if reason is not None:
                    records.stopped(iteration, self.state.optimizer_steps, reason)
            if broadcast_int(1 if reason is not None else 0):  # every rank stops at the same iteration
                if records is not None:
                    records.close()
                raise LearnerAbort(reason or "rank 0 stopped the run (train.stop_on)", EXIT_ALARM)
        if records is not None:
            self._finish(stopped, iteration, records)
        return 0

    def _collect_everywhere(self, iteration: int, plan: IterationPlan) -> Collected | None:
        """Rank 0 collects the batch; every rank learns whether to go on (a stop: None; an abort:
        LearnerAbort everywhere) and gets the rollouts (the other ranks decode the broadcast bytes)."""
        collected, status, abort = None, 1, None
        if self.rank == 0:
            try:
                collected = self.feed.collect(iteration, plan)
                status = 1 if collected is not None else 0
            except LearnerAbort as exc:
                status, abort = exc.code, exc
        status = broadcast_int(status)
        if status > 1:
            raise abort or LearnerAbort("rank 0 stopped the run", status)
        if not status:
            return None
        blobs = broadcast_blobs(collected.blobs if collected is not None else None)
        if collected is not None:
            return collected  # rank 0: decoded once, in the feed
        return Collected(rollouts=[decode_rollout(b) for b in blobs], blobs=blobs, entry_ids=[], stats={})

    def _commit(self, iteration: int, unacked: list[str], steps: list[dict[str, float]], stats: dict[str, float],
                t_collect: float, t0: float, stage: str) -> float:
        """The ledger, the weights and the optimizer state describe the same instant; then the weights
        are published and, only then and only while the lease is ours, the entries acknowledged.
        Returns the seconds the checkpoint took to write (the metrics' `iter/checkpoint_s`)."""
        self.state.last_entry_ids = list(unacked)
        if self.rank == 0:  # for a rebuild of the queue, and the metrics if the crash comes before the log
            self.feed.record_tasks_published()
            self.state.metrics = [
                {"step": st, "values": v, **extra} for st, v, extra in
                IterationLog.records(iteration, steps, stats, t_collect, time.monotonic() - t0,
                                     self.state.optimizer_steps,
                                     stage=stage)]
        self.faults.hit("learner.before_commit", iteration=iteration)
        self._check_lease()  # fencing: a learner that lost the namespace commits nothing
        t_save = time.monotonic()
        self.trainer.save_checkpoint(iteration, self.state)
        release_freed()  # the checkpoint's and the export's copies (eopd_common.memory)
        checkpoint_s = time.monotonic() - t_save
        self.faults.hit("learner.after_commit", iteration=iteration)
        self.publish_weights(iteration)
        if self.rank == 0:
            # Only now (their training effect is durable), and only while the lease is ours.
            self.feed.ack_fenced(unacked)
        return checkpoint_s

    def _finish(self, stopped: bool, iteration: int, records: IterationLog) -> None:
        records.close()
        if stopped:
            log.info("stopped by a signal before iteration %d; the last committed checkpoint is iteration %s; "
                     "restart to resume (unacknowledged rollouts are trained then)", iteration,
                     self.trainer.ckpt.latest())
        else:
            self.trainer.weights_out.finish()
            self.feed.finish()
            log.info("training finished: %d iterations, %d rollouts trained", self.state.iteration, len(self.ledger))

    # Weight sync and fencing -------------------------------------------------------------------
    def publish_weights(self, version: int) -> None:
        t0 = time.monotonic()
        pv = self.trainer.save_weights(version, self.state.iteration)
        if pv is not None:  # rank 0
            self.feed.announce(pv)
            self.trainer.prune_weights(protect=version)
            log.info("published policy version %d (%s, %.1f MB, %.2fs)", version, pv.format, pv.num_bytes / 1e6,
                     time.monotonic() - t0)

    def _check_lease(self) -> None:
        lost = self.feed.check_lease() if self.rank == 0 else None
        if broadcast_int(0 if lost is not None else 1) == 0:
            raise LearnerAbort(f"not committing iteration {self.state.iteration}: {lost or 'rank 0 lost the lease'}",
                               EXIT_LEASE_LOST)

    def close(self) -> None:
        self.feed.close()
        self.trainer.weights_out.close()
        destroy_process_group()
