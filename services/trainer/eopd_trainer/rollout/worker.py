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
(versions.py: the policy version), `RequestShaper` and `BatchQueue` (requests.py: requests out,
answers back to their rollouts), `Publisher` (publisher.py). The command line is `cli.py`
(`eopd-rollout`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from eopd_teacher.client import AsyncTeacherClient, RequestFailed, StallReport

from ..config import RunConfig
from ..data import load_prompts, render_prompt
from ..faults import Faults
from ..config.stages import run_needs_teacher
from ..objective import get_variant
from ..queue.messages import PromptTask, now_ns, rollout_id
from ..queue.signing import signer_for
from ..queue.streams import GROUP_LEARNER, GROUP_ROLLOUT, Keys, StreamQueue, connect
from .metrics import WorkerMetrics
from .publisher import Publisher
from .grader import TaskGrader
from .requests import BatchQueue, Pending, RequestShaper, answer_problems
from .samplers import make_sampler
from .task_book import TaskBook
from .teacher_checks import check_teacher_limits, check_tokenizer
from .teacher_gen import TeacherGenerator
from .versions import VersionTracker

log = logging.getLogger("eopd.rollout")

# Generate errors the client has retried for teacher.retry_timeout_s already: the worker gives up.
_RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class StopRequested(Exception):
    """A signal arrived before the worker started working."""


class TeacherRefused(RuntimeError):
    """The teacher rejected the worker's credentials: retrying cannot help."""


class RolloutWorker:
    def __init__(self, cfg: RunConfig, worker_id: str, prometheus_port: int = 0):
        self.cfg = cfg
        self.worker_id = worker_id
        self.metrics = WorkerMetrics(prometheus_port)
        self.faults = Faults(cfg.faults)
        self.keys = Keys(cfg.queue.namespace)
        self.stop = asyncio.Event()
        self.publisher: Publisher | None = None  # made by setup()
        self._prompt_cache: dict[int, list[int]] = {}

    @property
    def published(self) -> int:
        """Rollouts this worker published."""
        return self.publisher.published if self.publisher is not None else 0

    # Set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.cfg
        self.redis = connect(cfg.queue.redis_url)
        signer = signer_for(cfg.queue.auth_key_file)  # queue/signing.py: tasks checked, rollouts signed
        self.tasks = StreamQueue(self.redis, self.keys.tasks, GROUP_ROLLOUT, self.worker_id, self.keys.dead,
                                 cfg.queue.dead_letter_maxlen, signer=signer)
        self.rollouts = StreamQueue(self.redis, self.keys.rollouts, GROUP_LEARNER, self.worker_id, self.keys.dead,
                                    cfg.queue.dead_letter_maxlen, signer=signer)
        self.tasks.ensure_group()
        self.rollouts.ensure_group()
        self.prompts = load_prompts(cfg.data.train_files, cfg.data.field)
        self.sampler = make_sampler(cfg)  # transformers or vLLM (rollout.engine)
        self.tokenizer = self.sampler.tokenizer
        self.book = TaskBook(self.tasks, self.redis, cfg, self.metrics, self.worker_id)
        self.versions = VersionTracker(self.sampler, self.redis, self.keys, self.metrics, mode=cfg.mode,
                                       weights_poll_s=cfg.rollout.weights_poll_s, stop=self.stop, signer=signer,
                                       weights_dir=cfg.weights_dir)
        self.publisher = Publisher(self.rollouts, self.redis, self.keys, cfg, self.faults, self.metrics,
                                   self.worker_id, self.stop)
        variant = get_variant(cfg.loss.variant)
        # Student samples: scored by the teacher, or (grpo) graded by the task grader and never sent.
        self.score_students = bool(variant.needs_teacher_scores)
        self.grader = (TaskGrader.from_files(cfg.data.train_files, self.tokenizer, cfg.eval.headline)
                       if variant.advantages_from == "given" else None)
        self.book.resume_pending()

    def prompt_ids(self, index: int) -> list[int]:
        ids = self._prompt_cache.get(index)
        if ids is None:
            d = self.cfg.data
            ids = self._prompt_cache[index] = render_prompt(
                self.tokenizer, self.prompts[index], suffix=d.suffix, chat_template=d.chat_template,
                max_length=d.max_prompt_length)
        return ids

    def _sample(self, work: list[tuple[str, PromptTask]]) -> list[Pending]:
        ro = self.cfg.rollout
        self.faults.hit("rollout.sample", count=self.published)
        # The first num_teacher_samples of a task are the teacher's (Generate); the student samples the rest.
        flat = [(eid, task, j) for eid, task in work for j in range(task.num_teacher_samples, task.num_samples)]
        out: list[Pending] = []
        for start in range(0, len(flat), ro.generation_batch_size):
            chunk = flat[start : start + ro.generation_batch_size]
            prompts = [self.prompt_ids(task.prompt_index) for _, task, _ in chunk]
            # One seed per sample (vLLM seeds each sequence; transformers seeds the batch with the first).
            seeds = [(self.cfg.seed * 1_000_003 + task.task_seq * 101 + j) % (2**31) for _, task, j in chunk]
            samples = self.sampler.sample(prompts, seeds, temperature=ro.temperature, top_p=ro.top_p,
                                          max_new_tokens=ro.max_response_length)
            old, tops = self._old_logprobs(samples)
            t = now_ns()
            for (eid, task, j), s, lp, top in zip(chunk, samples, old, tops, strict=True):
                out.append(Pending(eid, task, j, s.prompt_ids, s.response_ids, s.truncated, lp,
                                   self.versions.version, t, top))
        return out

    def _old_logprobs(self, samples) -> tuple[list, list]:
        """Old log-probs, and the student's top-k ids per position when the loss variant needs
        per-position candidates (loss.num_candidates, from the same pass)."""
        temperature, k = self.cfg.rollout.temperature, self.cfg.loss.num_candidates
        if k:
            return self.sampler.old_logprobs_topk(samples, temperature=temperature, k=k)
        return self.sampler.old_logprobs(samples, temperature=temperature), [None] * len(samples)

    # Main loop -------------------------------------------------------------------------------
    async def run(self) -> int:
        cfg = self.cfg
        if not run_needs_teacher(cfg.loss, cfg.train.warmup_kd_iterations):
            return await self._run_graded()
        security = cfg.teacher.client_security()  # token / TLS files: read now, fail at start if unreadable
        client = AsyncTeacherClient(cfg.teacher.target, timeout=cfg.teacher.timeout_s,
                                    retry_timeout=cfg.teacher.retry_timeout_s, security=security)
        try:
            try:
                info = await self._wait_teacher(client)
            except StopRequested:
                log.info("stopped by a signal while waiting for the teacher")
                return 0
            teacher_model = self._check_teacher(info)
            shaper = RequestShaper(self.worker_id, cfg.teacher, info.max_tokens_per_request or None)
            queue = BatchQueue(maxsize=max(2, cfg.teacher.max_in_flight))
            # on_error="yield": a request the teacher rejects for good (invalid, over a per-request
            # limit) comes back as (request_id, RequestFailed) and the streams go on. A stall (no
            # answer for teacher.timeout_s) makes the client reconnect and re-send (`_on_stall`);
            # after teacher.retry_timeout_s without any answer it raises StreamStalled.
            answers = client.score_stream(queue, max_in_flight=cfg.teacher.max_in_flight, streams=cfg.teacher.streams,
                                          on_error="yield", stall_timeout_s=cfg.teacher.timeout_s,
                                          give_up_s=cfg.teacher.retry_timeout_s, on_stall=self._on_stall)
            generator = TeacherGenerator(client, cfg, sorted(self.sampler.stop), self.worker_id)
            beat = asyncio.create_task(self.book.heartbeat())
            try:
                producer = asyncio.create_task(self._produce(shaper, queue, generator, teacher_model))
                consumer = asyncio.create_task(self._consume(answers, shaper, teacher_model))
                return await self._finish(consumer, producer, shaper)
            finally:
                beat.cancel()
        finally:
            await client.close()

    def _check_teacher(self, info) -> str:
        """The checks of the teacher before any task (tokenizer, limits); returns its model name@revision."""
        cfg = self.cfg
        if cfg.teacher.check_tokenizer:
            moved = check_tokenizer(info, self.tokenizer, cfg.student.model, cfg.teacher.token_remap)
            if moved:
                log.info("teacher tokenizer: the student's vocabulary, special tokens moved by teacher.token_remap (%s)",
                         moved)
        check_teacher_limits(info, cfg, self.tokenizer)  # after the tokenizer check: its message is the more specific
        log.info("teacher %s ready (%s, top-k max %d); worker %s", info.model_name, info.engine, info.max_top_k,
                 self.worker_id)
        return f"{info.model_name}@{info.model_revision}"

    async def _run_graded(self) -> int:
        """A run without the teacher (grpo, no KD warm-up): tasks are sampled, graded and published
        until the run is done or a stop signal (unfinished tasks stay pending, re-done later)."""
        log.info("loss.variant=%s needs no teacher: worker %s grades its samples (no teacher call)",
                 self.cfg.loss.variant, self.worker_id)
        beat = asyncio.create_task(self.book.heartbeat())
        try:
            producer = asyncio.create_task(self._produce(None, None, None, ""))
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
        log.info("worker %s done: %d rollouts published", self.worker_id, self.published)
        return 0

    async def _produce(self, shaper: RequestShaper | None, queue: BatchQueue | None,
                       generator: TeacherGenerator | None, teacher_model: str) -> None:
        """Takes tasks, has the teacher generate their first num_teacher_samples responses
        (published at once), samples the rest with the policy version they ask for, and queues
        their requests for the teacher (or grades and publishes them: grpo), until the run is done
        or the worker stops; then closes the queue."""
        ro = self.cfg.rollout
        try:
            while not self.stop.is_set():
                per_round = max(1, ro.generation_batch_size // ro.n_samples)
                entries = await asyncio.to_thread(self.book.next_entries, per_round)
                if not entries:
                    if await asyncio.to_thread(self.redis.exists, self.keys.done):
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
                        await self._teacher_samples(eid, task, generator, teacher_model)
                if all(t.num_teacher_samples == t.num_samples for _, t in work):
                    continue
                with self.metrics.sample_seconds.time():
                    pending = await asyncio.to_thread(self._sample, work)
                self.faults.hit("rollout.after_sample", count=self.published)
                if not self.score_students:
                    await self._publish_graded(pending)
                    continue
                for batch in shaper.shape(pending):
                    await queue.put(batch)
        finally:
            if queue is not None:
                await queue.close()

    async def _teacher_samples(self, eid: str, task: PromptTask, generator: TeacherGenerator | None,
                               teacher_model: str) -> None:
        """The task's first num_teacher_samples responses, generated by the teacher and published
        (origin teacher); a request the teacher refuses for good dead-letters the task."""
        ids = [rollout_id(task.task_seq, j) for j in range(task.num_teacher_samples)]
        if generator is None:  # cannot happen: run() starts the teacher whenever a task can ask for it
            for rid in ids:
                await self.book.settle(eid, rid, "a task asks for teacher samples and this worker has no teacher")
            return
        prompt = self.prompt_ids(task.prompt_index)
        try:
            gens = await generator.generate(task, prompt)
            problem = generator.problems(task, gens)
        except RequestFailed as exc:
            problem = f"teacher rejected Generate ({exc.code.name}): {exc.details}"
        except grpc.RpcError as exc:
            if exc.code() in _RETRYABLE:
                raise  # the client retried for teacher.retry_timeout_s already: the worker gives up
            problem = f"teacher rejected Generate ({exc.code().name}): {exc.details()}"
        if problem is not None:
            log.warning("task %s: %s", task.task_id, problem)
            self.metrics.unscored.labels("generate").inc(len(ids))
            for rid in ids:
                await self.book.settle(eid, rid, problem)
            return
        for gen in gens:
            reward = self.grader.reward(task.prompt_index, gen.token_ids) if self.grader is not None else None
            rollout = generator.to_rollout(task, prompt, gen, policy_version=max(self.versions.version, 0),
                                           teacher_model=teacher_model, reward=reward)
            if not await self.publisher.publish(rollout):
                return  # stopping: the task stays pending and is reclaimed later
            await self.book.settle(eid, rollout.rollout_id)

    async def _publish_graded(self, pending: list[Pending]) -> None:
        """grpo: each student sample graded by the task grader and published without a teacher call."""
        for p in pending:
            reward = self.grader.reward(p.task.prompt_index, p.response_ids)
            if not await self.publisher.publish(self.publisher.to_graded_rollout(p, reward)):
                return  # stopping: the task stays pending and is reclaimed later
            await self.book.settle(p.entry_id, p.rollout_id)

    async def _consume(self, answers: AsyncIterator, shaper: RequestShaper, teacher_model: str) -> None:
        """Takes the teacher's answers, one per request, until the requests end."""
        async with contextlib.aclosing(answers):
            async for rid, answer in answers:
                await self._on_answer(shaper, teacher_model, rid, answer)

    async def _on_answer(self, shaper: RequestShaper, teacher_model: str, rid: str, answer) -> None:
        group = shaper.take(rid)
        if group is None:  # not a request of this run's (never happens: each is answered once)
            return
        if isinstance(answer, RequestFailed):
            await self._reject(rid, group, answer.code, answer.details)
        else:
            await self._handle(rid, group, answer, teacher_model)

    async def _handle(self, rid: str, group: list[Pending], scores, teacher_model: str) -> None:
        """The teacher scored request `rid`: its rollouts are published (an unusable answer's are
        not scored) and settled."""
        problems = answer_problems(group, scores)
        for i, p in enumerate(group):
            if problems[i] is not None:
                reason = f"teacher answer to request {rid} unusable: {problems[i]}"
                log.warning("rollout %s: %s", p.rollout_id, reason)
                self.metrics.unscored.labels("bad_answer").inc()
                await self.book.settle(p.entry_id, p.rollout_id, reason)
                continue
            rollout = self.publisher.to_rollout(p, scores[i], teacher_model)
            if not await self.publisher.publish(rollout):
                continue  # stopping: the task stays pending and is reclaimed later
            await self.book.settle(p.entry_id, p.rollout_id)
        log.debug("published %d rollouts (policy v%d)", self.published, group[0].policy_version)

    async def _reject(self, rid: str, group: list[Pending], code, details: str) -> None:
        """The teacher refused request `rid` for good (not retryable): its rollouts are not
        scored, their tasks dead-lettered with the teacher's code and message."""
        reason = f"teacher rejected request {rid} ({code.name}): {details}"
        log.warning("%s; %d rollouts not scored", reason, len(group))
        self.metrics.unscored.labels(code.name).inc(len(group))
        for p in group:
            await self.book.settle(p.entry_id, p.rollout_id, reason)

    def _on_stall(self, report: StallReport) -> None:
        """The teacher client's stall callback: it is about to abandon its streams, reconnect and
        re-send the unanswered requests."""
        log.warning("no answer from the teacher for %.1fs with %d requests outstanding (teacher.timeout_s): "
                    "abandoning the stream, reconnecting and re-sending them", report.stall_timeout_s,
                    report.outstanding)
        self.metrics.stream_restarts.inc()

    async def _finish(self, consumer: asyncio.Task, producer: asyncio.Task, shaper: RequestShaper) -> int:
        """Waits for the answers to end (the run is done), or for a stop signal."""
        try:
            stopping = asyncio.create_task(self.stop.wait())
            await asyncio.wait({consumer, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done() and not await self._stop_gracefully(consumer, producer, shaper):
                return 0
            stopping.cancel()
            await consumer
        except BaseException:
            producer.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await producer
            raise
        await producer  # re-raises what stopped the producer, if anything did
        log.info("worker %s done: %d rollouts published", self.worker_id, self.published)
        return 0

    async def _stop_gracefully(self, consumer: asyncio.Task, producer: asyncio.Task, shaper: RequestShaper) -> bool:
        """Stopped by a signal: the producer takes no new task; answers still in flight get
        `rollout.stop_grace_s` to arrive (a teacher that is gone would keep the client retrying for
        teacher.retry_timeout_s). What is left stays pending in Redis and is re-done by the next
        worker (same rollout ids: the learner drops duplicates). True: every answer arrived in time."""
        grace = self.cfg.rollout.stop_grace_s
        await asyncio.wait({consumer}, timeout=grace)
        if consumer.done():
            return True
        log.warning("stopping with %d requests unanswered after %.0fs (rollout.stop_grace_s); their tasks stay "
                    "pending and will be re-done", len(shaper), grace)
        consumer.cancel()
        producer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await consumer
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await producer
        return False

    async def _wait_teacher(self, client):
        deadline = time.monotonic() + self.cfg.teacher.ready_timeout_s
        while True:
            try:
                # One attempt per round (the client's own retry budget would outlast ready_timeout_s
                # and this loop's checks of the deadline and of a stop signal).
                return await client.info(timeout=max(1.0, min(10.0, deadline - time.monotonic())), retry_timeout=0)
            except Exception as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                if code is not None and code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
                    raise TeacherRefused(
                        f"the teacher at {self.cfg.teacher.target} refused this worker ({code.name}: {exc.details()}); "
                        "check teacher.auth_token_file / EOPD_TEACHER_AUTH_TOKEN and the teacher.tls_* settings") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"teacher at {self.cfg.teacher.target} not reachable: {exc}") from exc
                if self.stop.is_set():
                    raise StopRequested from None
                await asyncio.sleep(0.5)
