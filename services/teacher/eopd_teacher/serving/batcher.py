"""Dynamic batching across concurrent requests and streams.

Requests submit their sequences (with the client they come from); one loop forms batches under a
padded-token budget, waiting at most `max_wait_s` for a batch to fill, and runs the engine on one
worker thread while new work keeps arriving. Which sequences go together is `scheduling.FairQueue`'s
choice: clients take turns (fair queuing over tokens, each client's share of one batch bounded by
`max_client_tokens`, so a large request is served over several batches and other clients'
requests are served between them), sequences of similar length are grouped. Admission is bounded
by the tokens waiting in the queue.

Other engine work (generation: `submit_job`) waits in a FIFO beside the scoring queue and runs on
the same worker thread, so the engine never runs two things at once; when both wait, jobs and
scoring batches take turns, so neither starves the other. A stepped job (`steps=True`: the
transformers engine's `generate_steps`) runs one bounded step per turn, its state (the KV cache)
kept between turns, so a scoring batch of another client waits for about one step of a long
generation, not all of it; a stepped job whose caller went away is closed at once.

Chunked prefill (`steps_fn`, the transformers engine's `score_steps`): a batch of more than
`step_tokens` padded tokens is scored in steps of at most that many (the KV cache kept between
them), and the loop runs one step at a time: when the next batch of the fair queue is anchored on a
client with no batch in progress, it starts at once and runs next (at most MAX_IN_PROGRESS at once,
each holding its KV cache), then the batches in progress take turns step by step (and a waiting
generation job goes between two steps). So a small request from another client waits for about one
step of a large batch, not the whole batch (issue 17, section 4).

Pipelined scoring (`launch_fn`, the engines' `score_async`): a whole batch's engine call returns
once its work is queued on the device, with a pending answer; the answer is delivered (its copy
to the host waited for on a second thread, split per sequence) while the loop forms and launches
the next batch, so on a GPU the device runs batch N+1 while batch N's answers are copied, split
and encoded (`delivery.py`). At most delivery.MAX_UNDELIVERED batches wait for delivery; they are delivered in launch order.
On the CPU the answer is ready when the call returns and is delivered at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from ..types import ScoreItem, SequenceScores
from .delivery import Deliveries, Pending, deliver_results
from .jobs import EngineJob, JobQueue
from .scheduling import FairQueue, Waiting

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The queue is full: the caller should answer RESOURCE_EXHAUSTED."""


class Draining(Exception):
    """The batcher no longer accepts work: the caller should answer UNAVAILABLE."""


class BatcherDied(Draining):
    """The batcher's loop died (a bug): pending and new work fail with UNAVAILABLE, so clients
    retry on another replica, and the server reports itself not ready."""


# Scoring batches in progress at once (each scored in steps holds its KV cache between them).
MAX_IN_PROGRESS = 4

StepsFn = Callable[[list[ScoreItem]], Iterator["list[SequenceScores] | None"]]

LaunchFn = Callable[[list[ScoreItem]], Pending]


@dataclass(eq=False)
class _InProgress:
    """A scoring batch in progress: its sequences, its step generator (None: scored whole by one
    `score_fn` call), the engine seconds spent on it so far and its clients."""

    batch: list[Waiting]
    steps: Iterator[list[SequenceScores] | None] | None
    seconds: float = 0.0
    clients: set[str] = field(default_factory=set)


@dataclass
class BatchObserver:
    """Hooks for metrics; all optional."""

    on_batch: Callable[[int, int, int, float], None] | None = None  # (sequences, real tokens, padded tokens, seconds)
    on_queue: Callable[[int, int], None] | None = None  # (sequences, tokens) waiting
    on_wait: Callable[[float], None] | None = None  # a batch's oldest sequence's seconds in the queue
    on_delivery: Callable[[float, float], None] | None = None  # (seconds blocked on the device copy, splitting)


class DynamicBatcher:
    def __init__(
        self,
        score_fn: Callable[[list[ScoreItem]], list[SequenceScores]],
        *,
        max_batch_tokens: int,
        max_wait_s: float,
        max_queue_tokens: int,
        max_client_tokens: int | None = None,
        observer: BatchObserver | None = None,
        steps_fn: StepsFn | None = None,
        step_tokens: int = 0,
        launch_fn: LaunchFn | None = None,
    ):
        """`max_client_tokens`: one client's share of one batch (None: the whole budget).
        `steps_fn` (chunked prefill): scores a batch of more than `step_tokens` padded tokens in
        steps, other clients' batches served between them (None: every batch whole).
        `launch_fn` (pipelined scoring, the engine's `score_async`): whole batches are launched
        with it and delivered while the next one runs (None: `score_fn`, one batch at a time)."""
        self._score_fn = score_fn
        self._launch_fn = launch_fn
        self._steps_fn = steps_fn if step_tokens > 0 else None
        self.step_tokens = step_tokens
        self._in_progress: deque[_InProgress] = deque()  # scoring batches; the next to step first
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_tokens = max_queue_tokens
        self._obs = observer or BatchObserver()
        self._deliveries = Deliveries(self._fail_batch, self._obs.on_delivery)  # launched, not yet delivered
        self._queue = FairQueue(max_batch_tokens=max_batch_tokens, max_client_tokens=max_client_tokens)
        self._counter = 0
        self._jobs = JobQueue()  # generation jobs, and the stepped one between two of its steps
        self._job_turn = False  # when both wait: a job next (True) or a scoring batch (False)
        self._wakeup = asyncio.Event()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eopd-engine")
        self._task: asyncio.Task | None = None
        self._busy = False
        self._died: BaseException | None = None
        self.on_died: Callable[[BaseException], None] | None = None  # called once if the loop dies

    # -- public -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="eopd-batcher")
        self._task.add_done_callback(self._loop_ended)

    @property
    def alive(self) -> bool:
        """False once the loop has died."""
        return self._died is None

    def _loop_ended(self, task: asyncio.Task) -> None:
        """Done-callback of the loop: a loop that ends other than by close() died; every pending
        request fails with BatcherDied (nothing waits forever) and `on_died` is told."""
        if task.cancelled() and self._closed:
            return
        exc = (None if task.cancelled() else task.exception()) or RuntimeError("the batcher loop stopped")
        self._died = exc
        log.error("the batcher loop died: %s: %s", type(exc).__name__, exc, exc_info=exc)
        err = BatcherDied(f"the server's batcher stopped ({type(exc).__name__}: {exc}); retry on another replica")
        tickets = ([w.ticket for w in self._queue.clear()] + self._jobs.clear()
                   + [w.ticket for b in self._in_progress for w in b.batch])
        self._in_progress.clear()
        for ticket in tickets:
            if not ticket.done():
                ticket.set_exception(err)
        self._busy = False
        if self.on_died is not None:
            try:
                self.on_died(exc)
            except Exception:  # noqa: BLE001
                log.exception("on_died callback failed")

    @property
    def queued_tokens(self) -> int:
        return self._queue.tokens + self._jobs.tokens

    @property
    def idle(self) -> bool:
        return not self._queue and not self._jobs and not self._busy and not self._in_progress and not self._deliveries

    def _admit(self, tokens: int) -> None:
        """Raises BatcherDied, Draining or Overloaded (the queue, jobs included, is full) unless
        `tokens` more may wait."""
        if self._died is not None:
            raise BatcherDied(f"the server's batcher stopped ({type(self._died).__name__}: {self._died}); retry on another replica")
        if self._closed:
            raise Draining("the server is shutting down")
        waiting = self.queued_tokens
        if waiting + tokens > self.max_queue_tokens and (self._queue or self._jobs):
            raise Overloaded(f"queue full: {waiting} tokens waiting, request adds {tokens}, limit {self.max_queue_tokens}")

    async def submit_job(self, fn: Callable[[], object], tokens: int, *, steps: bool = False) -> object:
        """Runs `fn()` (engine work other than scoring: generation) on the engine's worker thread,
        in turn with scoring batches; `tokens` count against the queue limit while it waits.
        `steps`: `fn()` returns an iterator, advanced one `next()` per turn until it yields
        something other than None (the result); scoring batches run between its steps. Raises
        Overloaded or Draining before queueing. A caller cancelled before its job starts withdraws
        it; a stepped job is closed at its next turn; an unstepped one runs to its end, its result
        dropped."""
        self._admit(tokens)
        job = EngineJob(fn, tokens, asyncio.get_running_loop().create_future(), stepped=steps)
        self._jobs.add(job)
        self._wakeup.set()
        try:
            return await job.ticket
        except BaseException:
            job.ticket.cancel()
            raise

    async def submit(self, items: list[ScoreItem], client: str = "") -> list[SequenceScores]:
        """Scores `items` (all or nothing) for `client` (the key of fair queuing); raises
        Overloaded or Draining before queueing."""
        tokens = sum(it.num_tokens for it in items)
        self._admit(tokens)
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        entries = []
        for it in items:
            self._counter += 1
            entries.append(Waiting(self._counter, it, client, loop.create_future(), now))
        self._queue.add(entries)
        self._report_queue()
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(e.ticket for e in entries)))
        except BaseException:
            for e in entries:  # a cancelled or failed request leaves nothing behind
                e.ticket.cancel()
            raise

    async def close(self) -> None:
        """Stops accepting work, finishes what is queued, stops the loop."""
        self._closed = True
        while (self._queue or self._jobs or self._busy or self._in_progress) and self._died is None:
            self._wakeup.set()
            await asyncio.sleep(0.01)
        await self._deliveries.drain()
        if self._task and not self._task.done():  # (a dead loop's error was reported when it died)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)
        self._deliveries.shutdown()

    # -- loop ---------------------------------------------------------------------------------
    def _report_queue(self) -> None:
        if self._obs.on_queue:
            try:
                self._obs.on_queue(len(self._queue), self._queue.tokens)
            except Exception:  # noqa: BLE001 - metrics must not break scoring
                log.exception("batch observer on_queue failed")

    def _drop_cancelled(self) -> None:
        self._queue.drop(lambda w: w.ticket.done())
        self._jobs.drop_cancelled()  # a stepped job whose caller went away: its state (KV cache) is freed now

    async def _run_job(self, job: EngineJob) -> None:
        """One turn of `job` on the worker thread (all of it, or one step of a stepped job)."""
        self._busy = True
        try:
            await self._jobs.run_turn(job, self._executor)
        finally:
            self._busy = False

    def _form_batch(self) -> list[Waiting]:
        """The next batch (scheduling.FairQueue: fair by client, grouped by length)."""
        return self._queue.take_batch()

    async def _run(self) -> None:
        """One engine call at a time: a generation job when it is its turn; else start the next
        scoring batch when it may start, and run one step of the batch in progress whose turn it is."""
        while True:
            self._drop_cancelled()
            job = self._jobs.next()
            if job is not None and (self._job_turn or (not self._queue and not self._in_progress)):
                self._job_turn = False
                await self._run_job(job)
                continue
            if self._queue and self._may_start_batch():
                if not self._in_progress:  # nothing in progress: wait (briefly) for the batch to fill
                    await self._wait_to_fill()
                    self._drop_cancelled()
                    if not self._queue:
                        continue
                self._start_batch(self._form_batch())
                self._report_queue()
            if self._in_progress:
                self._job_turn = True  # a generation job, if one waits, goes after this step
                await self._step(self._in_progress[0])
            elif not self._queue and not self._jobs:
                self._wakeup.clear()
                await self._wakeup.wait()

    def _may_start_batch(self) -> bool:
        """No batch in progress, or the next batch's anchor is a client without one (and fewer than
        MAX_IN_PROGRESS are): then it goes between the steps of the others."""
        if not self._in_progress:
            return True
        busy = set().union(*(b.clients for b in self._in_progress))
        return len(self._in_progress) < MAX_IN_PROGRESS and self._queue.next_client() not in busy

    async def _wait_to_fill(self) -> None:
        """Until the oldest waiting sequence has waited max_wait_s, the budget is reached, or closing."""
        oldest = self._queue.oldest()
        if oldest is None:
            return
        deadline = oldest.enqueued + self.max_wait_s
        while self._queue.tokens < self.max_batch_tokens and not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _start_batch(self, batch: list[Waiting]) -> None:
        """The batch runs next: in steps when it is larger than step_tokens (and the engine can)."""
        items = [w.item for w in batch]
        if self._obs.on_wait:
            self._observe(self._obs.on_wait, time.monotonic() - min(w.enqueued for w in batch))
        padded = max(it.num_tokens for it in items) * len(items)
        steps = self._steps_fn(items) if self._steps_fn is not None and padded > self.step_tokens else None
        self._in_progress.appendleft(_InProgress(batch, steps, clients={w.client for w in batch}))

    async def _step(self, job: _InProgress) -> None:
        """One engine call for the batch `job`: its next step (then it goes to the back of the
        turn), or all of it; delivers its results when it is done."""
        if all(w.ticket.done() for w in job.batch):  # every request of it was cancelled
            self._finish(job)
            return
        if job.steps is None and self._launch_fn is not None:
            await self._launch(job)
            return
        loop = asyncio.get_running_loop()
        items = [w.item for w in job.batch]
        self._busy = True
        started = time.perf_counter()
        try:
            if job.steps is None:
                results = await loop.run_in_executor(self._executor, self._score_fn, items)
            else:
                results = await loop.run_in_executor(self._executor, next, job.steps)
        except Exception as exc:  # the engine failed on this batch
            self._finish(job)
            await self._fail_batch(job.batch, exc)
            return
        finally:
            self._busy = False
            job.seconds += time.perf_counter() - started
        if results is None:  # more steps to go: the other jobs' turn first
            self._in_progress.rotate(-1)
            return
        self._finish(job)
        self._observe_batch(job)
        deliver_results(job.batch, results)

    async def _launch(self, job: _InProgress) -> None:
        """Pipelined: launches the whole batch `job` (`launch_fn` on the engine's thread) and
        leaves its delivery to `delivery.Deliveries`, so the loop goes on to the next
        batch; first waits for the oldest delivery when MAX_UNDELIVERED are under way."""
        await self._deliveries.make_room()
        loop = asyncio.get_running_loop()
        items = [w.item for w in job.batch]
        self._busy = True
        started = time.perf_counter()
        try:
            pending = await loop.run_in_executor(self._executor, self._launch_fn, items)
        except Exception as exc:  # the engine failed on this batch
            self._finish(job)
            await self._fail_batch(job.batch, exc)
            return
        finally:
            self._busy = False
            job.seconds += time.perf_counter() - started
        self._finish(job)
        self._observe_batch(job)
        await self._deliveries.deliver(job.batch, pending)

    async def _fail_batch(self, batch: list[Waiting], exc: Exception) -> None:
        if len(batch) == 1:
            batch[0].ticket.done() or batch[0].ticket.set_exception(exc)
        else:  # one at a time, so that only the culprit fails
            await self._score_one_by_one(batch)

    def _observe(self, hook: Callable[..., None], *args) -> None:
        try:
            hook(*args)
        except Exception:  # noqa: BLE001 - metrics must not break scoring
            log.exception("batch observer %s failed", getattr(hook, "__name__", hook))

    def _observe_batch(self, job: _InProgress) -> None:
        if self._obs.on_batch:
            items = [w.item for w in job.batch]
            width = max(it.num_tokens for it in items)
            self._observe(self._obs.on_batch, len(items), sum(it.num_tokens for it in items), width * len(items), job.seconds)

    def _finish(self, job: _InProgress) -> None:
        self._in_progress.remove(job)
        if job.steps is not None:
            job.steps.close()  # frees its KV cache now

    async def _score_one_by_one(self, batch: list[Waiting]) -> None:
        """After an engine error on a batch of several items: each item alone (the numbers do not
        depend on the batch), so only the items that fail on their own get the error."""
        loop = asyncio.get_running_loop()
        self._busy = True
        try:
            for w in batch:
                if w.ticket.done():  # cancelled meanwhile
                    continue
                try:
                    (result,) = await loop.run_in_executor(self._executor, self._score_fn, [w.item])
                except Exception as exc:  # noqa: BLE001 - this item's own failure
                    if not w.ticket.done():
                        w.ticket.set_exception(exc)
                    continue
                if not w.ticket.done():
                    w.ticket.set_result(result)
        finally:
            self._busy = False
