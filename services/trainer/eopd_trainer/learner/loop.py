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
   token-mean over the whole mini-batch;
4. checkpoint commit (DeepSpeed state + HF export + trainer_state.json with the ledger of trained
   rollout ids), then the new weights are published as version i, then the iteration's stream
   entries are acknowledged and deleted.

The command line is `cli.py` (`eopd-train`, `python -m eopd_trainer.learner`).
"""

from __future__ import annotations

import collections
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..batching import (
    PackedBatch,
    gradient_accumulation_steps,
    pack_rollouts,
    shard,
    shuffle_for_iteration,
    split,
)
from ..config import RunConfig, dump_config
from ..faults import Faults
from ..objective import step_generator
from ..queue.messages import PoisonMessage, PromptTask, Rollout, check_rollout_metadata, decode_rollout, encode_task
from .distributed import all_reduce_step_metrics
from .ledger import Admit, Ledger, RejectStreak, admit, replacement_tasks_needed, tasks_to_publish
from .metrics import resumed_sink
from .trainer import LOSS_TERMS, STEP_METRIC_KEYS, _quiet_libraries, fused_loss_path

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


def fresh_state() -> dict[str, Any]:
    return {"iteration": 0, "policy_version": 0, "optimizer_steps": 0, "ledger": {},
            # A snapshot at each commit; stale_dropped, duplicates and dead_letters are read from the exact
            # totals in Redis (<ns>:counts, counted in the same transaction as each ack), never lost by a crash.
            "counters": {"stale_dropped": 0, "duplicates": 0, "dead_letters": 0, "replacement_tasks": 0},
            "last_entry_ids": [],
            # What rebuilds a lost queue (rebuild.py): the task counter at the commit, and the rollout
            # ids dropped without training (stale, future); plus the commit iteration's metric records.
            "tasks_published": None, "settled": [], "metrics": []}


class Learner:
    def __init__(self, cfg: RunConfig):
        self.cfg = cfg
        self.faults = Faults(cfg.faults)
        self.stop_requested = False
        self.lease = None
        limit = cfg.queue.max_rejected_in_a_row or 4 * cfg.train.batch_size
        self.rejects = RejectStreak(limit)

    def request_stop(self, *_args) -> None:
        """SIGTERM/SIGINT: stop at the next point where nothing is half done (while waiting for
        rollouts). Whatever is not committed is redone after a restart: exactly-once holds."""
        self.stop_requested = True

    # Set-up ----------------------------------------------------------------------------------
    def setup(self) -> None:
        import deepspeed
        from eopd_common.models import load_causal_lm

        from ..data import load_prompts
        from .checkpoint import CheckpointManager
        from .distributed import barrier, build_ds_config, init_process_group, lr_scheduler_factory

        cfg = self.cfg
        _quiet_libraries()
        self.rank, self.world = init_process_group(cfg.train.dist_backend)
        if self.rank == 0:
            self._acquire_lease()  # before anything slow: a second learner is refused at once
        torch.manual_seed(cfg.seed)
        self.run_dir = Path(cfg.run_dir)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(dump_config(cfg))
        self.num_prompts = len(load_prompts(cfg.data.train_files, cfg.data.field))
        self.total_iterations = cfg.total_iterations(self.num_prompts)
        self.gas = gradient_accumulation_steps(cfg.train.mini_batch_size, cfg.train.micro_batch_size, self.world)
        on_cpu = not torch.cuda.is_available()
        self.device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
        loaded = load_causal_lm(cfg.student.model, dtype="float32", device=str(self.device))
        self.tokenizer = loaded.tokenizer
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        model = loaded.model
        model.train()
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.fused_loss, why = fused_loss_path(cfg.train, model)
        if why:
            log.warning("%s", why)
        total_steps = self.total_iterations * cfg.steps_per_iteration
        ds_config = build_ds_config(cfg, self.world, total_steps, on_cpu=on_cpu)
        self.engine, _, _, self.scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds_config,
            lr_scheduler=lr_scheduler_factory(cfg, total_steps))
        self.ckpt = CheckpointManager(self.run_dir / "checkpoints", keep=cfg.checkpoint.keep,
                                      export_hf=cfg.checkpoint.export_hf, rank=self.rank, barrier=barrier,
                                      faults=self.faults)
        self.state = {**fresh_state(), **(self.ckpt.load(self.engine) or {})}
        self.ledger = Ledger.from_json(self.state["ledger"])
        # After a restart: without the records of iterations trained again, with the committed one's.
        self.metrics = resumed_sink(self.run_dir, "train", self.state, tensorboard=cfg.logging.tensorboard,
                                    prometheus_port=cfg.logging.prometheus_port, enabled=self.rank == 0)
        if self.rank == 0:
            self._setup_queues()

    def _acquire_lease(self) -> None:
        """One learner per namespace (rank 0 holds `<ns>:lease`); raises LeaseHeld -> exit 2."""
        from ..queue.lease import Lease
        from ..queue.streams import Keys, connect

        cfg = self.cfg
        self.keys = Keys(cfg.queue.namespace)
        self.redis = connect(cfg.queue.redis_url)
        self.lease = Lease(self.redis, self.keys.lease, ttl_ms=int(cfg.queue.lease_ttl_s * 1000),
                           description=f"eopd-train run_dir={cfg.run_dir}")
        self.lease.acquire(wait_s=cfg.queue.lease_wait_s)

    def _setup_queues(self) -> None:
        from ..queue.streams import GROUP_LEARNER, GROUP_ROLLOUT, StreamQueue

        cfg = self.cfg
        consumer = "learner"
        self.rollouts = StreamQueue(self.redis, self.keys.rollouts, GROUP_LEARNER, consumer, self.keys.dead,
                                    cfg.queue.dead_letter_maxlen, dropped_stream=self.keys.dropped,
                                    counts_key=self.keys.counts)
        self.tasks = StreamQueue(self.redis, self.keys.tasks, GROUP_ROLLOUT, consumer, self.keys.dead,
                                 cfg.queue.dead_letter_maxlen)
        self.rollouts.ensure_group()
        self.tasks.ensure_group()
        self.redis.delete(self.keys.done)
        from ..data import prompt_index
        from .rebuild import rebuild_if_lost

        rebuilt = rebuild_if_lost(self.redis, self.keys, self.state, n_samples=cfg.rollout.n_samples,
                                  prompt_of=lambda seq: prompt_index(seq, self.num_prompts, seed=cfg.seed,
                                                                     shuffle=cfg.data.shuffle))
        if rebuilt:
            log.warning("%s", rebuilt)
        # Entries delivered to any learner consumer before a crash: take them over, re-read them first.
        self.rollouts.claim_idle(0, 1_000_000)
        self._pending = collections.deque(self.rollouts.read_pending(1_000_000))
        if self._pending:
            log.info("found %d unacknowledged rollouts from before a restart", len(self._pending))

    # Weight sync ------------------------------------------------------------------------------
    def publish_weights(self, version: int) -> None:
        from ..queue.announce import announce
        from ..queue.weights import prune_weights, save_weights
        from .distributed import full_parameters

        with full_parameters(self.engine, self.cfg.train.zero_stage):
            if self.rank == 0:
                t0 = time.monotonic()
                pv = save_weights(self.engine.module, self.run_dir / "weights", version, self.state["iteration"])
                announce(self.redis, self.keys.policy, pv)
                prune_weights(self.run_dir / "weights", self.cfg.checkpoint.keep_weights, protect=version)
                log.info("published policy version %d (%.1f MB, %.2fs)", version, pv.num_bytes / 1e6, time.monotonic() - t0)

    def _announced_version(self) -> int:
        from ..queue.announce import current_announcement

        pv = current_announcement(self.redis, self.keys.policy)
        return -1 if pv is None or not Path(pv.uri).is_file() else pv.version

    # Tasks and rollouts (rank 0) ------------------------------------------------------------------
    def publish_tasks(self, iteration: int, replacements: int = 0) -> int:
        """Publishes the tasks `iteration` needs (and `replacements` more), atomically with the
        task counter: a restarted learner never publishes the same task twice."""
        from ..data import prompt_index

        cfg = self.cfg
        published = int(self.redis.get(self.keys.tasks_next) or 0)
        counters = self.state["counters"]
        counters["replacement_tasks"] += replacements
        n_new = tasks_to_publish(iteration=iteration, batch_size=cfg.train.batch_size, n_samples=cfg.rollout.n_samples,
                                 max_staleness=cfg.effective_max_staleness, published_tasks=published,
                                 replacement_tasks=counters["replacement_tasks"])
        if n_new <= 0:
            return 0
        pipe = self.redis.pipeline(transaction=True)
        for seq in range(published, published + n_new):
            task = PromptTask(seq, prompt_index(seq, self.num_prompts, seed=cfg.seed, shuffle=cfg.data.shuffle),
                              cfg.rollout.n_samples, self.state["policy_version"])
            pipe.xadd(self.keys.tasks, {b"data": encode_task(task)})
        pipe.set(self.keys.tasks_next, published + n_new)
        pipe.execute()
        return n_new

    def collect(self, iteration: int) -> tuple[list[bytes], list[str], dict[str, float]] | None:
        """B admissible rollouts (raw bytes), their entry ids, and collection statistics; None
        when a stop was requested (SIGTERM/SIGINT) while waiting."""
        cfg = self.cfg
        need = cfg.train.batch_size
        version = self.state["policy_version"]
        counters = self.state["counters"]
        batch: dict[str, tuple[str, bytes, Rollout]] = {}
        staleness: list[int] = []
        self.publish_tasks(iteration)
        last_note = time.monotonic()
        queue_wait = 0.0  # seconds blocked on the rollouts stream (the learner's idle time)
        while len(batch) < need:
            if self.stop_requested:
                return None
            entries = []
            while self._pending and len(entries) < need - len(batch):
                entries.append(self._pending.popleft())
            if not entries:
                t_wait = time.monotonic()
                entries = self.rollouts.read_new(need - len(batch), cfg.queue.block_ms)
                queue_wait += time.monotonic() - t_wait
            if not entries:
                # Waiting = not yet read by the learner: XLEN also counts the entries it holds (this
                # batch, and with checkpoint.every > 1 the iterations trained since the last commit).
                extra = replacement_tasks_needed(
                    missing_rollouts=need - len(batch), n_samples=cfg.rollout.n_samples,
                    tasks_outstanding=self.tasks.length(), rollouts_waiting=self.rollouts.undelivered())
                if extra:
                    log.info("iteration %d short of %d rollouts with every task done: %d replacement tasks",
                             iteration, need - len(batch), extra)
                    self.publish_tasks(iteration, replacements=extra)
                if time.monotonic() - last_note > 30:
                    log.info("iteration %d waiting for rollouts: %d/%d (unread backlog %d, tasks outstanding %d)",
                             iteration, len(batch), need, self.rollouts.undelivered(), self.tasks.length())
                    last_note = time.monotonic()
                continue
            for e in entries:
                try:
                    r = decode_rollout(e.data or b"", vocab_size=self.vocab_size)
                    check_rollout_metadata(r, temperature=cfg.loss.temperature, top_k=cfg.teacher.top_k,
                                           max_response_length=cfg.rollout.max_response_length)
                except PoisonMessage as exc:
                    self.rollouts.dead_letter(e, exc.reason)  # counted in <ns>:counts (dead_letter)
                    self._rejected(f"dead letter {e.entry_id}: {exc.reason}")
                    continue
                d = admit(r.rollout_id, r.policy_version, current_version=version,
                          max_staleness=cfg.effective_max_staleness, trained=self.ledger, in_batch=set(batch))
                if d.kind is Admit.TRAIN:
                    batch[r.rollout_id] = (e.entry_id, e.data, r)
                    staleness.append(d.staleness)
                    self.rejects.admitted()
                    continue
                # Not trained: acknowledged, deleted and recorded in <ns>:dropped + <ns>:counts atomically.
                # duplicate: its training effect is committed or in this batch; stale: replaced once every
                # task is done (below); future: sampled by weights of an uncommitted future this learner
                # rolled back from.
                self.rollouts.drop(e, d.kind.value, rollout_id=r.rollout_id, policy_version=r.policy_version,
                                   staleness=d.staleness)
                if d.kind is not Admit.DUPLICATE:
                    self.state["settled"].append(r.rollout_id)  # its task is not republished by a rebuild
                    self._rejected(f"{d.kind.value} {r.rollout_id}: sampled by policy version {r.policy_version}, "
                                   f"learner at {version} (max staleness {cfg.effective_max_staleness})")
        self._sync_counters()
        rollouts = [v[2] for v in batch.values()]
        stats = {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": float(max(staleness)),
            "queue_backlog": float(self.rollouts.undelivered()),  # scored rollouts not yet read by the learner
            "stale_dropped_total": float(counters["stale_dropped"]),
            "duplicates_total": float(counters["duplicates"]),
            "dead_letters_total": float(counters["dead_letters"]),
            "response_length_mean": sum(r.num_response_tokens for r in rollouts) / len(rollouts),
            "truncated_frac": sum(r.truncated for r in rollouts) / len(rollouts),
            "sample_to_train_s": (time.time_ns() - min(r.sampled_unix_ns for r in rollouts)) / 1e9,
            "queue_wait_s": queue_wait,
        }
        return [v[1] for v in batch.values()], [v[0] for v in batch.values()], stats

    def _rejected(self, reason: str) -> None:
        if self.rejects.reject(reason):
            raise LearnerAbort(self.rejects.message(), EXIT_REJECTED)

    def _sync_counters(self) -> None:
        """The drop and dead-letter totals from Redis (exact across crashes) into the state."""
        from ..queue.streams import read_counts

        c = read_counts(self.redis, self.keys.counts)
        self.state["counters"].update(stale_dropped=c.get("stale", 0) + c.get("future", 0),
                                      duplicates=c.get("duplicate", 0), dead_letters=c.get("dead_letter", 0))

    # Training ----------------------------------------------------------------------------------
    def micro_loss(self, packed: PackedBatch, denominator: float,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        from ..objective import compute_loss, compute_loss_from_hidden

        dev = self.device
        ids, am = packed.input_ids.to(dev), packed.attention_mask.to(dev)
        pos = packed.positions.to(dev)
        args = dict(
            sampled_ids=packed.sampled_ids.to(dev), old_logprobs=packed.old_logprobs.to(dev),
            teacher_logprobs=packed.teacher_logprobs.to(dev), teacher_entropy=packed.teacher_entropy.to(dev),
            teacher_topk_ids=packed.topk_ids.to(dev), teacher_topk_logprobs=packed.topk_logprobs.to(dev),
            config=self.cfg.loss, seq_index=packed.seq_index.to(dev), denominator=denominator,
            generator=generator,
        )
        module = self.engine.module
        if self.fused_loss:
            hidden = module.get_decoder()(input_ids=ids, attention_mask=am).last_hidden_state
            hidden = hidden.reshape(-1, hidden.shape[-1])[pos]
            head = module.get_output_embeddings()
            return compute_loss_from_hidden(hidden, head.weight, bias=head.bias, **args)
        logits = self.engine(input_ids=ids, attention_mask=am).logits
        return compute_loss(logits.reshape(-1, logits.shape[-1])[pos], **args)

    def train_iteration(self, iteration: int, rollouts: list[Rollout]) -> list[dict[str, float]]:
        cfg = self.cfg
        seq_mean = cfg.loss.aggregation == "seq-mean-token-mean"
        ordered = shuffle_for_iteration(rollouts, cfg.seed, iteration)
        steps = []
        for step, mini in enumerate(split(ordered, cfg.train.mini_batch_size), 1):
            local = shard(mini, self.rank, self.world)
            units = len(mini) if seq_mean else sum(r.num_response_tokens for r in mini)
            # engine.backward divides by gas and the all-reduce averages over ranks: this makes the
            # sum over every micro-batch of every rank the loss over the whole mini-batch.
            denominator = units / (self.gas * self.world)
            rows = []
            loss_sum = {k: 0.0 for k in LOSS_TERMS}
            lr_used = float(self.scheduler.get_last_lr()[0])  # in the param groups until this step is taken
            opt_step = self.state["optimizer_steps"]  # 0-based index of this optimizer step in the run
            for micro_index, micro in enumerate(split(local, cfg.train.micro_batch_size)):
                packed = pack_rollouts(micro, self.pad_id)
                # random_fkl's draw: different at every step, rank and micro-batch, the same again
                # when a resumed run redoes this step.
                gen = step_generator(cfg.loss.random_seed, iteration, opt_step, self.rank, micro_index)
                loss, m = self.micro_loss(packed, denominator, gen)
                self.engine.backward(loss)
                self.engine.step()
                rows.append(({k: v for k, v in m.items() if k not in LOSS_TERMS}, packed.num_tokens))
                for k in LOSS_TERMS:
                    loss_sum[k] += m.get(k, 0.0) / self.gas  # this rank's share x world, see denominator
            self.state["optimizer_steps"] += 1
            # Over every rank's micro-batches (one all-reduce), not rank 0's share only.
            metrics = {**all_reduce_step_metrics(rows, loss_sum, STEP_METRIC_KEYS, LOSS_TERMS), "lr": lr_used}
            grad_norm = self.engine.get_global_grad_norm()
            if grad_norm is not None:
                metrics["grad_norm"] = float(grad_norm)
            steps.append(metrics)
            self.faults.hit("learner.after_step", iteration=iteration, step=step)
        return steps

    # Main loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        from .distributed import broadcast_blobs, broadcast_int

        cfg = self.cfg
        start_iteration = self.state["iteration"]
        version = self.state["policy_version"]
        need_publish = 1 if self.rank == 0 and self._announced_version() != version else 0
        if broadcast_int(need_publish):
            self.publish_weights(version)
        progress = None
        if self.rank == 0 and cfg.logging.progress:
            from tqdm import tqdm

            progress = tqdm(total=self.total_iterations, initial=start_iteration, desc="eopd train", unit="it",
                            dynamic_ncols=True, file=sys.stderr)
        unacked: list[str] = []  # entries of iterations trained since the last commit
        stopped = False
        for iteration in range(start_iteration + 1, self.total_iterations + 1):
            t0 = time.monotonic()
            collected, status, abort = None, 1, None
            if self.rank == 0:
                try:
                    collected = self.collect(iteration)
                    status = 1 if collected is not None else 0
                except LearnerAbort as exc:
                    status, abort = exc.code, exc
            status = broadcast_int(status)
            if status > 1:
                raise abort or LearnerAbort("rank 0 stopped the run", status)
            if not status:
                stopped = True
                break
            blobs, entry_ids, stats = collected if collected is not None else (None, [], {})
            t_collect = time.monotonic() - t0
            blobs = broadcast_blobs(blobs)
            rollouts = [decode_rollout(b) for b in blobs]
            steps = self.train_iteration(iteration, rollouts)
            self.ledger.record(iteration, [r.rollout_id for r in rollouts])
            self.state.update(iteration=iteration, policy_version=iteration, ledger=self.ledger.to_json(),
                              global_steps=int(self.engine.global_steps))
            unacked.extend(entry_ids)
            if iteration % cfg.checkpoint.every == 0 or iteration == self.total_iterations:
                # Commit: the ledger, the weights and the optimizer state describe the same instant.
                self.state["last_entry_ids"] = list(unacked)
                if self.rank == 0:  # for a rebuild of the queue, and the metrics if the crash comes before the log
                    self.state["tasks_published"] = int(self.redis.get(self.keys.tasks_next) or 0)
                    self.state["metrics"] = [
                        {"step": st, "values": v, **extra} for st, v, extra in
                        self._iteration_records(iteration, steps, stats, t_collect, time.monotonic() - t0)]
                self.faults.hit("learner.before_commit", iteration=iteration)
                self._check_lease()  # fencing: a learner that lost the namespace commits nothing
                self.ckpt.save(self.engine, iteration, self.state, export_fn=self._export_hf)
                self.faults.hit("learner.after_commit", iteration=iteration)
                self.publish_weights(iteration)
                if self.rank == 0:
                    # Only now (their training effect is durable), and only while the lease is ours.
                    self._ack_fenced(unacked)
                unacked = []
            else:
                self.publish_weights(iteration)
            if self.rank == 0:
                self._log_iteration(iteration, steps, stats, t_collect, time.monotonic() - t0, progress)
        if self.rank == 0:
            if progress is not None:
                progress.close()
            self.metrics.close()
            if stopped:
                log.info("stopped by a signal before iteration %d; the last committed checkpoint is iteration %s; "
                         "restart to resume (unacknowledged rollouts are trained then)", iteration,
                         self.ckpt.latest())
            else:
                self.redis.set(self.keys.done, b"1")
                log.info("training finished: %d iterations, %d rollouts trained", self.state["iteration"], len(self.ledger))
        return 0

    def _check_lease(self) -> None:
        from ..queue.lease import LeaseLost
        from .distributed import broadcast_int

        lost = None
        if self.rank == 0:
            try:
                self.lease.check()
            except LeaseLost as exc:
                lost = exc
        if broadcast_int(0 if lost is not None else 1) == 0:
            raise LearnerAbort(f"not committing iteration {self.state['iteration']}: {lost or 'rank 0 lost the lease'}",
                               EXIT_LEASE_LOST)

    def _ack_fenced(self, entry_ids: list[str]) -> None:
        from ..queue.lease import LeaseLost

        try:
            self.lease.fenced(lambda pipe: self.rollouts.queue_ack(pipe, entry_ids))
        except LeaseLost as exc:
            raise LearnerAbort(f"checkpoint of iteration {self.state['iteration']} committed but its entries not "
                               f"acknowledged: {exc}", EXIT_LEASE_LOST) from None

    def close(self) -> None:
        if self.lease is not None:
            self.lease.release()

    def _export_hf(self, path: Path) -> None:
        from .distributed import full_parameters

        with full_parameters(self.engine, self.cfg.train.zero_stage):
            if self.rank == 0:
                from ..queue.weights import export_state_dict

                self.engine.module.save_pretrained(str(path), state_dict=export_state_dict(self.engine.module),
                                                   safe_serialization=True)
                self.tokenizer.save_pretrained(str(path))

    def _iteration_records(self, iteration: int, steps: list[dict[str, float]], stats: dict[str, float],
                           t_collect: float, t_total: float) -> list[tuple[int, dict[str, float], dict]]:
        """(step, values, extra) of every metrics record of an iteration: its steps, then the summary."""
        base = self.state["optimizer_steps"] - len(steps)
        per_step = {k: stats[k] for k in ("queue_backlog", "staleness_mean", "staleness_max")}
        out = [(base + i, {**m, **per_step}, {"iteration": iteration, "kind": "step"}) for i, m in enumerate(steps, 1)]
        summary = {k: sum(s[k] for s in steps if k in s) / len(steps) for k in steps[0]}
        summary.update(stats, collect_s=t_collect, iteration_s=t_total,
                       idle_frac=stats.get("queue_wait_s", 0.0) / t_total if t_total > 0 else 0.0)
        out.append((self.state["optimizer_steps"], {f"iter/{k}": v for k, v in summary.items()},
                    {"iteration": iteration, "kind": "iteration"}))
        return out

    def _log_iteration(self, iteration: int, steps: list[dict[str, float]], stats: dict[str, float],
                       t_collect: float, t_total: float, progress) -> None:
        for step, values, extra in self._iteration_records(iteration, steps, stats, t_collect, t_total):
            self.metrics.log(step, values, **extra)
        summary = {k: sum(s[k] for s in steps if k in s) / len(steps) for k in steps[0]}
        msg = (f"iter {iteration}/{self.total_iterations} loss {summary['loss']:.4f} pg {summary['pg_loss']:.4f} "
               f"fkl {summary['fkl_loss']:.4f} gate {summary.get('gate_ratio', 0):.3f} "
               f"stale {stats['staleness_mean']:.2f} backlog {int(stats['queue_backlog'])}")
        log.info(msg)
        if progress is not None:
            progress.set_postfix(loss=f"{summary['loss']:.4f}", gate=f"{summary.get('gate_ratio', 0):.2f}",
                                 stale=f"{stats['staleness_mean']:.1f}", backlog=int(stats["queue_backlog"]))
            progress.update(1)
