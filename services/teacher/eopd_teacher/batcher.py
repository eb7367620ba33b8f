"""Dynamic batching across concurrent requests and streams.

Requests submit their sequences (with the client they come from); one loop forms batches under a
padded-token budget, waiting at most `max_wait_s` for a batch to fill, and runs the engine on one
worker thread while new work keeps arriving. Which sequences go together is `scheduling.FairQueue`'s
choice: clients take turns (fair queuing over tokens, each client's share of one batch bounded by
`max_client_tokens`, so a large request is served over several batches and other clients'
requests are served between them), sequences of similar length are grouped. Admission is bounded
by the tokens waiting in the queue.

Other engine work (generation: `submit_job`) waits in a FIFO beside the scoring queue and runs on
the same worker thread as one job, so the engine never runs two things at once; when both wait,
jobs and scoring batches take turns, so neither starves the other.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .scheduling import FairQueue, Waiting
from .types import ScoreItem, SequenceScores

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The queue is full: the caller should answer RESOURCE_EXHAUSTED."""


class Draining(Exception):
    """The batcher no longer accepts work: the caller should answer UNAVAILABLE."""


class BatcherDied(Draining):
    """The batcher's loop died (a bug): pending and new work fail with UNAVAILABLE, so clients
    retry on another replica, and the server reports itself not ready."""


@dataclass(eq=False)
class _Job:
    """One engine job (`fn()` on the worker thread), `tokens` counted against the queue limit."""

    fn: Callable[[], object]
    tokens: int
    ticket: asyncio.Future


@dataclass
class BatchObserver:
    """Hooks for metrics; all optional."""

    on_batch: Callable[[int, int, int, float], None] | None = None  # (sequences, real tokens, padded tokens, seconds)
    on_queue: Callable[[int, int], None] | None = None  # (sequences, tokens) waiting


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
    ):
        """`max_client_tokens`: one client's share of one batch (None: the whole budget)."""
        self._score_fn = score_fn
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_tokens = max_queue_tokens
        self._obs = observer or BatchObserver()
        self._queue = FairQueue(max_batch_tokens=max_batch_tokens, max_client_tokens=max_client_tokens)
        self._counter = 0
        self._jobs: deque[_Job] = deque()
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
        tickets = [w.ticket for w in self._queue.clear()] + [j.ticket for j in self._jobs]
        self._jobs.clear()
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
        return self._queue.tokens + sum(j.tokens for j in self._jobs)

    @property
    def idle(self) -> bool:
        return not self._queue and not self._jobs and not self._busy

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

    async def submit_job(self, fn: Callable[[], object], tokens: int) -> object:
        """Runs `fn()` (engine work other than scoring: generation) on the engine's worker thread
        as one job, in turn with scoring batches; `tokens` count against the queue limit while it
        waits. Raises Overloaded or Draining before queueing. A caller cancelled before its job
        starts withdraws it; one cancelled while it runs leaves it to finish, its result dropped."""
        self._admit(tokens)
        job = _Job(fn, tokens, asyncio.get_running_loop().create_future())
        self._jobs.append(job)
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
        while (self._queue or self._jobs or self._busy) and self._died is None:
            self._wakeup.set()
            await asyncio.sleep(0.01)
        if self._task and not self._task.done():  # (a dead loop's error was reported when it died)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # -- loop ---------------------------------------------------------------------------------
    def _report_queue(self) -> None:
        if self._obs.on_queue:
            try:
                self._obs.on_queue(len(self._queue), self._queue.tokens)
            except Exception:  # noqa: BLE001 - metrics must not break scoring
                log.exception("batch observer on_queue failed")

    def _drop_cancelled(self) -> None:
        self._queue.drop(lambda w: w.ticket.done())
        if any(j.ticket.done() for j in self._jobs):
            self._jobs = deque(j for j in self._jobs if not j.ticket.done())

    async def _run_job(self, job: _Job) -> None:
        """One job on the worker thread; its result or error goes to its caller."""
        self._busy = True
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._executor, job.fn)
        except Exception as exc:  # noqa: BLE001 - the job's own failure, for its caller
            job.ticket.done() or job.ticket.set_exception(exc)
        else:
            job.ticket.done() or job.ticket.set_result(result)
        finally:
            self._busy = False

    def _form_batch(self) -> list[Waiting]:
        """The next batch (scheduling.FairQueue: fair by client, grouped by length)."""
        return self._queue.take_batch()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if self._jobs and (self._job_turn or not self._queue):
                self._job_turn = False
                await self._run_job(self._jobs.popleft())
                continue
            oldest = self._queue.oldest()
            if oldest is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            self._job_turn = True  # a job, if one waits, goes after this batch
            # Wait (briefly) for the batch to fill unless the budget is already reached.
            deadline = oldest.enqueued + self.max_wait_s
            while self._queue.tokens < self.max_batch_tokens and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            self._drop_cancelled()
            if not self._queue:
                continue
            batch = self._form_batch()
            self._report_queue()
            items = [p.item for p in batch]
            self._busy = True
            started = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self._score_fn, items)
            except Exception as exc:  # the engine failed on this batch
                if len(batch) == 1:
                    batch[0].ticket.done() or batch[0].ticket.set_exception(exc)
                else:  # one at a time, so that only the culprit fails
                    await self._score_one_by_one(batch)
                continue
            finally:
                self._busy = False
            if self._obs.on_batch:
                width = max(it.num_tokens for it in items)
                try:
                    self._obs.on_batch(len(items), sum(it.num_tokens for it in items), width * len(items), time.perf_counter() - started)
                except Exception:  # noqa: BLE001 - metrics must not break scoring
                    log.exception("batch observer on_batch failed")
            for w, r in zip(batch, results, strict=True):
                if not w.ticket.done():
                    w.ticket.set_result(r)

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
