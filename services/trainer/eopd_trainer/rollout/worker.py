"""The rollout worker (`eopd-rollout`): tasks in, scored rollouts out.

Loop: take PromptTasks from `<ns>:tasks` (group "rollout": first its own pending entries after a
restart, then entries idle on dead workers via XAUTOCLAIM, then new ones); make sure it holds the
policy version the task asks for (reloading announced weights); sample `num_samples` responses
per prompt (`rollout.engine`: transformers or vLLM, `samplers.make_sampler`); compute the old
log-probs (by default with a transformers forward pass); send the sequences
to the teacher over `teacher.streams` pipelined `ScoreStream`s (re-sent after a teacher restart by
the client); publish each ScoredRollout on `<ns>:rollouts` (waiting while the stream is over
`max_backlog`); acknowledge the task once all its rollouts are published, or dead-letter it with
the reason when the teacher rejected one of its requests or answered it unusably. A task re-done after a crash yields
the same rollout ids, which the learner recognises as duplicates.

The command line is `cli.py` (`eopd-rollout`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time

import numpy as np

from ..config import RunConfig
from ..faults import Faults, corrupt_bytes
from ..queue.messages import (
    PoisonMessage,
    PromptTask,
    Rollout,
    decode_task,
    encode_rollout,
    now_ns,
)
from ..queue.streams import (
    GROUP_LEARNER,
    GROUP_ROLLOUT,
    Entry,
    Keys,
    StreamQueue,
    connect,
    wait_for_room,
)
from .metrics import WorkerMetrics
from .requests import Pending, QueueSource, answer_problems, remap_ids, request_groups, teacher_tokens
from .teacher_checks import check_teacher_limits, check_tokenizer

log = logging.getLogger("eopd.rollout")

WEIGHTS_RETRY_MAX_S = 5.0  # longest wait between attempts to load an announced file that failed


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
        self.published = 0
        self.answered = 0  # teacher answers (scores or a final rejection) to this worker's requests
        self.version = -1  # -1: the spec's weights, not loaded from an announcement
        self._sha = ""
        self._prompt_cache: dict[int, list[int]] = {}
        self._in_progress: set[str] = set()
        self._local: collections.deque[Entry] = collections.deque()
        self._request_seq = 0

    # Set-up --------------------------------------------------------------------------------
    def setup(self) -> None:
        from ..data import load_prompts
        from .samplers import make_sampler

        cfg = self.cfg
        self.redis = connect(cfg.queue.redis_url)
        self.tasks = StreamQueue(self.redis, self.keys.tasks, GROUP_ROLLOUT, self.worker_id, self.keys.dead,
                                 cfg.queue.dead_letter_maxlen)
        self.rollouts = StreamQueue(self.redis, self.keys.rollouts, GROUP_LEARNER, self.worker_id, self.keys.dead,
                                    cfg.queue.dead_letter_maxlen)
        self.tasks.ensure_group()
        self.rollouts.ensure_group()
        self.prompts = load_prompts(cfg.data.train_files, cfg.data.field)
        self.sampler = make_sampler(cfg)  # transformers or vLLM (rollout.engine)
        self.tokenizer = self.sampler.tokenizer
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.inverse_remap = {v: k for k, v in cfg.teacher.token_remap.items()}
        self._resume_pending()

    def _resume_pending(self) -> None:
        """Takes back this worker id's unacknowledged tasks from before a restart, under the same
        delivery limit as tasks reclaimed from others (so a task that kills its worker, restarted
        under the same id, is not retried forever)."""
        self._local.extend(self._within_delivery_limit(self.tasks.read_pending(100_000)))
        if self._local:
            log.info("resuming %d pending tasks of %s", len(self._local), self.worker_id)

    def prompt_ids(self, index: int) -> list[int]:
        from ..data import render_prompt

        ids = self._prompt_cache.get(index)
        if ids is None:
            d = self.cfg.data
            ids = self._prompt_cache[index] = render_prompt(
                self.tokenizer, self.prompts[index], suffix=d.suffix, chat_template=d.chat_template,
                max_length=d.max_prompt_length)
        return ids

    # Policy versions -------------------------------------------------------------------------
    def _maybe_reload(self) -> None:
        from ..queue.announce import current_announcement

        pv = current_announcement(self.redis, self.keys.policy)
        # (version, sha256): after a learner rolls back to its last checkpoint, a version number
        # may be announced again with other weights.
        if pv is not None and (pv.version, pv.sha256) != (self.version, self._sha):
            t0 = time.monotonic()
            self.sampler.load_weights(pv)  # in place, no restart (vLLM: reload_weights + prefix cache reset)
            self.version, self._sha = pv.version, pv.sha256
            self.metrics.version.set(pv.version)
            took = time.monotonic() - t0
            self.metrics.reload_seconds.observe(took)
            log.info("loaded policy version %d into %s in %.2fs", pv.version, self.sampler.engine, took)

    async def ensure_version(self, min_version: int) -> bool:
        """Waits until the sampler holds a policy version >= `min_version` (False: the run is done
        or the worker is stopping). An announced file that cannot be loaded right now (missing,
        sha256 mismatch, rewritten while read: `WeightsUnavailable`) never crashes the worker: the
        announcement is read again and the load retried with backoff (weights_poll_s doubling up to
        WEIGHTS_RETRY_MAX_S). Meanwhile, in async mode, a worker whose current weights satisfy the
        tasks keeps sampling with them; in sync mode it waits (the rollouts of the old weights
        would be dropped as stale)."""
        from ..queue.weights import WeightsUnavailable

        poll = self.cfg.rollout.weights_poll_s
        delay = poll
        while not self.stop.is_set():
            failed = False
            try:
                await asyncio.to_thread(self._maybe_reload)
            except WeightsUnavailable as exc:
                failed = True
                self.metrics.reload_failures.inc()
                keep = self.cfg.mode == "async" and max(self.version, 0) >= min_version
                log.warning("cannot load the announced weights: %s; %s", exc,
                            f"sampling with policy version {max(self.version, 0)} meanwhile" if keep
                            else f"retrying in {delay:.1f}s")
            if max(self.version, 0) >= min_version and (not failed or self.cfg.mode == "async"):
                self.version = max(self.version, 0)  # nothing announced yet: the spec's weights are version 0
                return True
            if await asyncio.to_thread(self.redis.exists, self.keys.done):
                return False
            await asyncio.sleep(delay)
            delay = min(delay * 2, max(WEIGHTS_RETRY_MAX_S, poll)) if failed else poll
        return False

    # Tasks -----------------------------------------------------------------------------------
    def _next_entries(self, count: int) -> list[Entry]:
        out: list[Entry] = []
        while self._local and len(out) < count:
            out.append(self._local.popleft())
        if not out:
            claimed = self.tasks.claim_idle(self.cfg.rollout.claim_idle_ms, count)
            out = self._within_delivery_limit([e for e in claimed if e.entry_id not in self._in_progress])
            if out:
                log.info("reclaimed %d idle tasks", len(out))
                self.metrics.reclaimed.inc(len(out))
        if not out:
            out = self.tasks.read_new(count, self.cfg.queue.block_ms)
        return out

    def _within_delivery_limit(self, entries: list[Entry]) -> list[Entry]:
        """Dead-letters the entries delivered more than rollout.max_task_deliveries times; returns
        the others that are still in the stream."""
        limit = self.cfg.rollout.max_task_deliveries
        for e in entries:
            if self.tasks.deliveries(e.entry_id) > limit:
                self.tasks.dead_letter(e, f"task delivered more than {limit} times")
        return [e for e in entries if self.redis.xrange(self.tasks.stream, e.entry_id, e.entry_id)]

    def _sample(self, work: list[tuple[str, PromptTask]]) -> list[Pending]:
        ro = self.cfg.rollout
        self.faults.hit("rollout.sample", count=self.published)
        flat = [(eid, task, j) for eid, task in work for j in range(task.num_samples)]
        out: list[Pending] = []
        for start in range(0, len(flat), ro.generation_batch_size):
            chunk = flat[start : start + ro.generation_batch_size]
            prompts = [self.prompt_ids(task.prompt_index) for _, task, _ in chunk]
            # One seed per sample (vLLM seeds each sequence; transformers seeds the batch with the first).
            seeds = [(self.cfg.seed * 1_000_003 + task.task_seq * 101 + j) % (2**31) for _, task, j in chunk]
            samples = self.sampler.sample(prompts, seeds, temperature=ro.temperature, top_p=ro.top_p,
                                          max_new_tokens=ro.max_response_length)
            old = self.sampler.old_logprobs(samples, temperature=ro.temperature)
            t = now_ns()
            for (eid, task, j), s, lp in zip(chunk, samples, old, strict=True):
                out.append(Pending(eid, task, j, s.prompt_ids, s.response_ids, s.truncated, lp, self.version, t))
        return out

    # Publishing ------------------------------------------------------------------------------
    def _to_rollout(self, p: Pending, scores, teacher_model: str) -> Rollout:
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
        )

    def _publish(self, rollout: Rollout) -> bool:
        ok = wait_for_room(self.redis, self.keys.rollouts, self.cfg.queue.max_backlog,
                           should_stop=lambda: self.stop.is_set() or bool(self.redis.exists(self.keys.done)),
                           on_wait=lambda _n: self.metrics.backpressure_waits.inc())
        if ok:
            data = encode_rollout(rollout)
            if self.faults.hit("rollout.publish", count=self.published + 1):
                data = corrupt_bytes(data)
            self.rollouts.add(data)
        return ok

    # Main loop -------------------------------------------------------------------------------
    async def run(self) -> int:
        from eopd_teacher.client import AsyncTeacherClient, RequestFailed, ScoreBatch, SequenceInput

        cfg = self.cfg
        security = cfg.teacher.client_security()  # token / TLS files: read now, fail at start if unreadable
        client = AsyncTeacherClient(cfg.teacher.target, timeout=cfg.teacher.timeout_s,
                                    retry_timeout=cfg.teacher.retry_timeout_s, security=security)
        beat: asyncio.Task | None = None
        try:
            try:
                info = await self._wait_teacher(client)
            except StopRequested:
                log.info("stopped by a signal while waiting for the teacher")
                return 0
            if cfg.teacher.check_tokenizer:
                moved = check_tokenizer(info, self.tokenizer, cfg.student.model, cfg.teacher.token_remap)
                if moved:
                    log.info("teacher tokenizer: the student's vocabulary, special tokens moved by teacher.token_remap (%s)",
                             moved)
            check_teacher_limits(info, cfg, self.tokenizer)  # after the tokenizer check: its message is the more specific
            teacher_model = f"{info.model_name}@{info.model_revision}"
            log.info("teacher %s ready (%s, top-k max %d); worker %s", info.model_name, info.engine, info.max_top_k,
                     self.worker_id)

            batches: asyncio.Queue = asyncio.Queue(maxsize=max(2, cfg.teacher.max_in_flight))
            contexts: dict[str, list[Pending]] = {}
            remaining: dict[str, int] = {}
            task_data: dict[str, bytes] = {}  # entry id -> its PromptTask bytes (for a dead letter)
            unscored: dict[str, dict[str, list[str]]] = {}  # entry id -> reason -> rollouts not scored

            async def produce() -> None:
                try:
                    while not self.stop.is_set():
                        per_round = max(1, cfg.rollout.generation_batch_size // cfg.rollout.n_samples)
                        entries = await asyncio.to_thread(self._next_entries, per_round)
                        if not entries:
                            if await asyncio.to_thread(self.redis.exists, self.keys.done):
                                log.info("the learner finished the run; stopping")
                                break
                            continue
                        work: list[tuple[str, PromptTask]] = []
                        for e in entries:
                            try:
                                task = decode_task(e.data or b"")
                                if task.prompt_index >= len(self.prompts):
                                    raise PoisonMessage(f"PromptTask {task.task_id}: prompt_index {task.prompt_index} "
                                                        f"outside the {len(self.prompts)} prompts")
                            except PoisonMessage as exc:
                                await asyncio.to_thread(self.tasks.dead_letter, e, exc.reason)
                                self.metrics.dead.inc()
                                continue
                            work.append((e.entry_id, task))
                            task_data[e.entry_id] = e.data or b""
                            self._in_progress.add(e.entry_id)
                        if not work:
                            continue
                        if not await self.ensure_version(max(t.min_policy_version for _, t in work)):
                            break
                        with self.metrics.sample_seconds.time():
                            pending = await asyncio.to_thread(self._sample, work)
                        self.faults.hit("rollout.after_sample", count=self.published)
                        for eid, task in work:
                            remaining[eid] = task.num_samples
                        lengths = [len(p.prompt_ids) + len(p.response_ids) for p in pending]
                        for rows in request_groups(lengths, cfg.teacher.sequences_per_request,
                                                   info.max_tokens_per_request or None):
                            group = pending[rows.start : rows.stop]
                            self._request_seq += 1
                            rid = f"{self.worker_id}-{self._request_seq}"
                            contexts[rid] = group
                            seqs = [SequenceInput(p.rollout_id,
                                                  teacher_tokens(p.prompt_ids, p.response_ids, cfg.teacher.token_remap),
                                                  len(p.prompt_ids)) for p in group]
                            await batches.put(ScoreBatch(rid, seqs, top_k=cfg.teacher.top_k,
                                                         temperature=cfg.teacher.temperature))
                finally:
                    await batches.put(None)


            sent: dict[str, tuple] = {}  # handed to the current stream, not yet answered
            waiting_since: list[float | None] = [None]  # when the consumer started waiting for an answer

            async def drain(source: QueueSource) -> None:
                # on_error="yield": a request the teacher rejects for good (invalid, over a per-request
                # limit) comes back as (request_id, RequestFailed) and the streams go on.
                stream = client.score_stream(source, max_in_flight=cfg.teacher.max_in_flight,
                                             streams=cfg.teacher.streams, on_error="yield")
                while True:
                    waiting_since[0] = time.monotonic()
                    try:
                        rid, answer = await stream.__anext__()
                    except StopAsyncIteration:
                        return
                    finally:
                        waiting_since[0] = None
                    sent.pop(rid, None)
                    if isinstance(answer, RequestFailed):
                        await reject(rid, answer.code, answer.details)
                    else:
                        await handle(rid, answer)

            async def consume() -> None:
                """Streams the batches to the teacher. Deadline: when requests are outstanding and
                no answer came for `teacher.timeout_s` (a stalled network path, a hung teacher),
                the stream is abandoned, the channel replaced and the unanswered requests re-sent;
                after `teacher.retry_timeout_s` without any answer the worker gives up."""
                nonlocal client
                source = QueueSource(batches, sent)
                last_answer = time.monotonic()
                while True:
                    answered_before = self.answered
                    task = asyncio.ensure_future(drain(source))
                    stalled = False
                    while not task.done():
                        await asyncio.wait({task}, timeout=min(1.0, cfg.teacher.timeout_s / 4))
                        if self.answered != answered_before:
                            last_answer, answered_before = time.monotonic(), self.answered
                        since = waiting_since[0]
                        if task.done() or since is None or not sent:
                            continue
                        oldest = min(t for _, t in sent.values())
                        if time.monotonic() - max(since, oldest) > cfg.teacher.timeout_s:
                            stalled = True
                            task.cancel()
                            with contextlib.suppress(asyncio.CancelledError):
                                await task
                    if not stalled:
                        task.result()  # re-raises what ended the stream
                        return
                    if time.monotonic() - last_answer > cfg.teacher.retry_timeout_s:
                        raise RuntimeError(f"no answer from the teacher at {cfg.teacher.target} for "
                                           f"{cfg.teacher.retry_timeout_s:.0f}s with {len(sent)} requests outstanding")
                    log.warning("no answer from the teacher for %.1fs with %d requests outstanding (teacher.timeout_s): "
                                "abandoning the stream, reconnecting and re-sending them", cfg.teacher.timeout_s, len(sent))
                    self.metrics.stream_restarts.inc()
                    old, client = client, AsyncTeacherClient(cfg.teacher.target, timeout=cfg.teacher.timeout_s,
                                                             retry_timeout=cfg.teacher.retry_timeout_s, security=security)
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(old.close(), 5)
                    now = time.monotonic()
                    resend = [b for b, _ in sent.values()]
                    sent.clear()
                    source = QueueSource(batches, sent, resend, done=source.done)
                    for b in resend:
                        sent[b.request_id] = (b, now)

            async def settle(p: Pending, reason: str | None = None) -> None:
                """One rollout of a task accounted for: published, or not scored (`reason`). Once all
                are, the task is acknowledged, or, if any was not scored, dead-lettered with the
                reasons (acknowledged and deleted: not retried; the learner replaces what is missing)."""
                eid = p.entry_id
                if reason is not None:
                    unscored.setdefault(eid, {}).setdefault(reason, []).append(p.rollout_id)
                remaining[eid] -= 1
                if remaining[eid]:
                    return
                del remaining[eid]
                data, reasons = task_data.pop(eid, b""), unscored.pop(eid, None)
                if reasons:
                    why = "; ".join(f"rollouts {', '.join(ids)} not scored: {r}" for r, ids in reasons.items())
                    await asyncio.to_thread(self.tasks.dead_letter, Entry(eid, data), why)
                    self.metrics.dead.inc()
                else:
                    await asyncio.to_thread(self.tasks.ack, [eid])
                self._in_progress.discard(eid)

            async def handle(rid: str, scores) -> None:
                group = contexts.pop(rid, None)
                if group is None:  # answered before a stream was abandoned
                    return
                self.answered += 1
                problems = answer_problems(group, scores)
                for i, p in enumerate(group):
                    if problems[i] is not None:
                        reason = f"teacher answer to request {rid} unusable: {problems[i]}"
                        log.warning("rollout %s: %s", p.rollout_id, reason)
                        self.metrics.unscored.labels("bad_answer").inc()
                        await settle(p, reason)
                        continue
                    rollout = self._to_rollout(p, scores[i], teacher_model)
                    if not await asyncio.to_thread(self._publish, rollout):
                        continue  # stopping: the task stays pending and is reclaimed later
                    self.published += 1
                    self.metrics.published.inc()
                    self.metrics.tokens.inc(rollout.num_response_tokens)
                    self.faults.hit("rollout.after_publish", count=self.published)
                    await settle(p)
                log.debug("published %d rollouts (policy v%d)", self.published, group[0].policy_version)

            async def reject(rid: str, code, details: str) -> None:
                """The teacher refused request `rid` for good (not retryable): its rollouts are not
                scored, their tasks dead-lettered with the teacher's code and message."""
                group = contexts.pop(rid, None)
                if group is None:
                    return
                self.answered += 1
                reason = f"teacher rejected request {rid} ({code.name}): {details}"
                log.warning("%s; %d rollouts not scored", reason, len(group))
                self.metrics.unscored.labels(code.name).inc(len(group))
                for p in group:
                    await settle(p, reason)

            async def heartbeat() -> None:
                """Keeps the tasks this worker holds from looking idle to other workers' XAUTOCLAIM
                while a long batch is sampled or scored (rollout.claim_idle_ms)."""
                period = cfg.rollout.claim_idle_ms / 3000
                while True:
                    await asyncio.sleep(period)
                    held = [*self._in_progress, *(e.entry_id for e in self._local)]
                    if held:
                        with contextlib.suppress(Exception):  # a Redis hiccup: the next beat retries
                            await asyncio.to_thread(self.tasks.touch, held)

            beat = asyncio.create_task(heartbeat())
            producer = asyncio.create_task(produce())
            try:
                consumer = asyncio.create_task(consume())
                stopping = asyncio.create_task(self.stop.wait())
                await asyncio.wait({consumer, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if not consumer.done():
                    # Stopped by a signal: the producer takes no new task; answers still in flight get
                    # `rollout.stop_grace_s` to arrive (a teacher that is gone would keep the client
                    # retrying for teacher.retry_timeout_s). What is left stays pending in Redis and is
                    # re-done by the next worker (same rollout ids: the learner drops duplicates).
                    await asyncio.wait({consumer}, timeout=cfg.rollout.stop_grace_s)
                    if not consumer.done():
                        log.warning("stopping with %d requests unanswered after %.0fs (rollout.stop_grace_s); their tasks stay "
                                    "pending and will be re-done", len(contexts), cfg.rollout.stop_grace_s)
                        consumer.cancel()
                        producer.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await consumer
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await producer
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
        finally:
            if beat is not None:
                beat.cancel()
            await client.close()

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
