"""The rollout worker (`eopd-rollout`): tasks in, scored rollouts out.

Loop: take PromptTasks from `<ns>:tasks` (group "rollout": first its own pending entries after a
restart, then entries idle on dead workers via XAUTOCLAIM, then new ones); make sure it holds the
policy version the task asks for (reloading announced weights); have the teacher generate the
task's first `num_teacher_samples` responses (`teacher_gen.py`: off-policy, origin teacher, published
at once: KD, the KD warm-up, GKD's teacher share); sample the other responses
per prompt (`rollout.engine`: transformers or vLLM, `samplers.make_sampler`); compute the old
log-probs (by default with a transformers forward pass); send the sequences to the teacher over
`teacher.streams` pipelined `ScoreStream`s (the client re-sends them after a teacher restart, and
after `teacher.timeout_s` without an answer it reconnects and re-sends them; after
`teacher.retry_timeout_s` of silence the worker exits with StreamStalled); publish each
ScoredRollout on `<ns>:rollouts` (waiting while the stream is over `max_backlog`); acknowledge the task once all its rollouts are published, or dead-letter it with
the reason when the teacher rejected one of its requests or answered it unusably. A task re-done after a crash yields
the same rollout ids, which the learner recognises as duplicates. With loss.variant grpo the student's
samples are graded by the task grader (`grader.py`) instead of scored, and a grpo run without a KD
warm-up never connects to a teacher.

The worker's parts: `TaskBook` (task_book.py: the tasks it holds, settled there), `VersionTracker`
(versions.py: the policy version), `StudentSamples` (student_samples.py: the student's samples and
the prompt cache), `TeacherSamples` (teacher_samples.py: the teacher's samples published),
`publish_graded` (graded.py: grpo's graded samples published), `RequestShaper` and `BatchQueue`
(requests.py: requests out), `ScoreAnswers` (answers.py: the teacher's answers back to their
rollouts, published), `Publisher` (publisher.py), `wait_for_teacher` (teacher_wait.py) and
`check_teacher` (teacher_checks.py), one `TeacherLink` of these per teacher a `route:` reaches
(teacher_links.py: `teacher` alone unless the run names `teachers:`). The command line is `cli.py`
(`eopd-rollout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from eopd_common.memory import release_freed
from eopd_teacher.client import StallReport

from ..config import RunConfig
from ..config.stages import run_needs_teacher
from ..data import load_prompts
from ..faults import Faults
from ..queue.signing import signer_for
from ..queue.namespace import RunQueue
from .grader import TaskGrader
from .graded import publish_graded
from .metrics import WorkerMetrics
from .mixture_join import MixtureJoin
from .publisher import Publisher
from .requests import Pending
from .samplers import make_sampler
from .student_samples import StudentSamples
from .task_book import TaskBook
from .teacher_samples import TeacherSamples
from .teacher_links import TeacherLink, connect, prompt_routes
from .teacher_wait import StopRequested, TeacherRefused
from .versions import VersionTracker, start_receiver

__all__ = ["RolloutWorker", "StopRequested", "TeacherRefused"]

log = logging.getLogger("eopd.rollout")


class RolloutWorker:
    def __init__(self, cfg: RunConfig, worker_id: str, prometheus_port: int = 0):
        self.cfg = cfg
        self.worker_id = worker_id
        self.metrics = WorkerMetrics(prometheus_port)
        self.faults = Faults(cfg.faults)
        self.stop = asyncio.Event()
        self.publisher: Publisher | None = None  # made by setup()

    @property
    def published(self) -> int:
        """Rollouts this worker published."""
        return self.publisher.published if self.publisher is not None else 0

    # Set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        signer = signer_for(cfg.queue.auth_key_file)  # queue/signing.py: tasks checked, rollouts signed
        self.queue = RunQueue.connect(cfg.queue.redis_url, cfg.queue.namespace, signer=signer,
                                      dead_maxlen=cfg.queue.dead_letter_maxlen)
        self.tasks = self.queue.tasks(self.worker_id)
        self.rollouts = self.queue.rollouts(self.worker_id)
        self.tasks.ensure_group()
        self.rollouts.ensure_group()
        self.prompts = load_prompts(cfg.data.train_files, cfg.data.field)
        self.receiver = start_receiver(cfg)  # weight_sync: broadcast; joins while the models load
        self.sampler = make_sampler(cfg)  # transformers or vLLM (rollout.engine)
        self.tokenizer = self.sampler.tokenizer
        self.routes = prompt_routes(cfg.route, cfg.data.train_files, len(self.prompts))  # the teacher of each prompt
        self.book = TaskBook(self.tasks, cfg, self.metrics, self.worker_id)
        self.versions = VersionTracker(self.sampler, self.queue, self.metrics, mode=cfg.mode,
                                       weights_poll_s=cfg.rollout.weights_poll_s, stop=self.stop,
                                       weights_dir=cfg.weights_dir, receiver=self.receiver,
                                       release_idle=cfg.rollout.release_idle_weights)
        self.publisher = Publisher(self.rollouts, self.queue, cfg, self.faults, self.metrics, self.worker_id,
                                   self.stop)
        self.students = StudentSamples(cfg, self.sampler, self.prompts, self.faults, self.versions, self.publisher)
        # Student samples: scored by the teacher, or (grpo) graded by the task grader and never sent.
        self.score_students = cfg.loss.needs_teacher_scores
        self.grader = (TaskGrader.from_files(cfg.data.train_files, self.tokenizer, cfg.eval.headline)
                       if cfg.loss.advantages_given else None)
        self.book.resume_pending()


    # Main loop -------------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.cfg
        if not run_needs_teacher(cfg.loss, cfg.train.warmup_kd_iterations):
            return await self._run_graded()
        links: dict[str, TeacherLink] = {}
        mixture = list(cfg.route.mixture)  # every response scored by each of them, joined per rollout
        join = MixtureJoin(mixture, self.publisher, self.book) if mixture else None
        try:
            try:
                for name in cfg.route.teacher_names():  # from the config: the wait needs nothing setup() loads
                    links[name] = await connect(name, cfg, self, self._on_stall, join)
            except StopRequested:
                log.info("stopped by a signal while waiting for the teacher")
                return 0
            beat = asyncio.create_task(self.book.heartbeat())
            try:
                producer = asyncio.create_task(self._produce(links))
                consumers = [asyncio.create_task(link.answers.consume(link.stream)) for link in links.values()]
                return await self._finish(consumers, producer, list(links.values()))
            finally:
                beat.cancel()
        finally:
            for link in links.values():
                await link.close()

    async def _run_graded(self) -> int:
        """A run without the teacher (grpo, no KD warm-up): tasks are sampled, graded and published
        until the run is done or a stop signal (unfinished tasks stay pending, re-done later)."""
        log.info("loss.variant=%s needs no teacher: worker %s grades its samples (no teacher call)",
                 self.cfg.loss.variant, self.worker_id)
        beat = asyncio.create_task(self.book.heartbeat())
        try:
            producer = asyncio.create_task(self._produce(None))
            stopping = asyncio.create_task(self.stop.wait())
            await asyncio.wait({producer, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not producer.done():
                producer.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await producer
                return 0
            await producer
        finally:
            beat.cancel()
        log.info("worker %s done: %d rollouts published; %s", self.worker_id, self.published,
                 self.metrics.time_summary())
        return 0

    async def _produce(self, links: dict[str, TeacherLink] | None) -> None:
        """Takes tasks, has each task's teacher (`route:`) generate their first num_teacher_samples
        responses (published at once), samples the rest with the policy version they ask for, and
        queues their requests for their teacher (or grades and publishes them: grpo, `links` None),
        until the run is done or the worker stops; then closes the teachers' queues."""
        ro = self.cfg.rollout
        graded = TeacherSamples(None, "", self.students.prompt_ids, self.grader, self.publisher, self.book,
                                self.versions, self.metrics)  # a worker without teachers dead-letters teacher samples
        try:
            while not self.stop.is_set():
                per_round = max(1, ro.generation_batch_size // ro.n_samples)
                entries = await asyncio.to_thread(self.book.next_entries, per_round)
                if not entries:
                    self.versions.release_while_waiting()  # sync: the learner is training (versions.py)
                    if await asyncio.to_thread(self.queue.is_done):
                        log.info("the learner finished the run; stopping")
                        break
                    continue
                work = await self.book.open(entries, len(self.prompts))
                if not work:
                    continue
                if not await self.versions.ensure(max(t.min_policy_version for _, t in work)):
                    break
                for eid, task in work:
                    self.book.expect(eid, task.num_samples)
                for eid, task in work:
                    if task.num_teacher_samples:
                        await (links[self.routes[task.prompt_index]].samples if links else graded).publish(eid, task)
                if all(t.num_teacher_samples == t.num_samples for _, t in work):
                    continue
                with self.metrics.sample_seconds.time():
                    pending = await asyncio.to_thread(self.students.sample, work)
                # the round's generation and log-prob pass freed hundreds of MiB in small blocks: back
                # to the system, or the worker's RSS creeps up round after round (issue 50: 0.95 ->
                # 2.24 GiB over the main job's 32 iterations)
                await asyncio.to_thread(release_freed)
                self.faults.hit("rollout.after_sample", count=self.published)
                if not self.score_students:
                    await publish_graded(pending, self.grader, self.publisher, self.book)
                    continue
                await self._send(pending, links, mixed=bool(self.cfg.route.mixture))
        finally:
            for link in (links or {}).values():
                await link.queue.close()

    async def _send(self, pending: list[Pending], links: dict[str, TeacherLink], *, mixed: bool) -> None:
        """Each sample's requests to its prompt's teacher (`mixed`: to every teacher of the
        mixture); a sample that cannot be sent (a prefix and response over the teacher's context)
        dead-letters its task with the reason."""
        for name, link in links.items():
            mine = pending if mixed else [p for p in pending if self.routes[p.task.prompt_index] == name]
            if not mine:
                continue
            batches, refused = link.shaper.shape(mine)
            for p, why in refused:
                log.warning("rollout %s not scored by %s: %s", p.rollout_id, name, why)
                self.metrics.unscored.labels("too_long").inc()
                await link.answers.not_scored(p, why)
            for batch in batches:
                await link.queue.put(batch)

    def _on_stall(self, report: StallReport) -> None:
        """The teacher client's stall callback: it is about to abandon its streams, reconnect and
        re-send the unanswered requests."""
        log.warning("no answer from the teacher for %.1fs with %d requests outstanding (teacher.timeout_s): "
                    "abandoning the stream, reconnecting and re-sending them", report.stall_timeout_s,
                    report.outstanding)
        self.metrics.stream_restarts.inc()

    async def _finish(self, consumers: list[asyncio.Task], producer: asyncio.Task, links: list[TeacherLink]) -> int:
        """Waits for every teacher's answers to end (the run is done), or for a stop signal."""
        consumer = asyncio.gather(*consumers)
        try:
            stopping = asyncio.create_task(self.stop.wait())
            await asyncio.wait({consumer, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done() and not await self._stop_gracefully(consumer, producer, links):
                return 0
            stopping.cancel()
            await consumer
        except BaseException:
            producer.cancel()
            consumer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer
            raise
        await producer  # re-raises what stopped the producer, if anything did
        log.info("worker %s done: %d rollouts published; %s", self.worker_id, self.published,
                 self.metrics.time_summary())
        return 0

    async def _stop_gracefully(self, consumer: asyncio.Future, producer: asyncio.Task, links: list[TeacherLink]) -> bool:
        """Stopped by a signal: the producer takes no new task; answers still in flight get
        `rollout.stop_grace_s` to arrive (a teacher that is gone would keep the client retrying for
        teacher.retry_timeout_s). What is left stays pending in Redis and is re-done by the next
        worker (same rollout ids: the learner drops duplicates). True: every answer arrived in time."""
        grace = self.cfg.rollout.stop_grace_s
        await asyncio.wait({consumer}, timeout=grace)
        if consumer.done():
            return True
        log.warning("stopping with %d requests unanswered after %.0fs (rollout.stop_grace_s); their tasks stay "
                    "pending and will be re-done", sum(len(link.shaper) for link in links), grace)
        consumer.cancel()
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
        return False
