"""Dynamic batching across concurrent requests and streams.

Requests submit their sequences; one loop forms batches under a padded-token budget, waiting at
most `max_wait_s` for a batch to fill, grouping sequences of similar length (the oldest waiting
sequence is always in the next batch, so nothing starves), and runs the engine on one worker
thread while new work keeps arriving. Admission is bounded by the tokens waiting in the queue.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .types import ScoreItem, SequenceScores

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The queue is full: the caller should answer RESOURCE_EXHAUSTED."""


class Draining(Exception):
    """The batcher no longer accepts work: the caller should answer UNAVAILABLE."""


class BatcherDied(Draining):
    """The batcher's loop died (a bug): pending and new work fail with UNAVAILABLE, so clients
    retry on another replica, and the server reports itself not ready."""


@dataclass(order=True)
class _Pending:
    seq: int
    item: ScoreItem = field(compare=False)
    future: asyncio.Future = field(compare=False)
    enqueued: float = field(compare=False, default=0.0)


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
        observer: BatchObserver | None = None,
    ):
        self._score_fn = score_fn
        self.max_batch_tokens = max_batch_tokens
        self.max_wait_s = max_wait_s
        self.max_queue_tokens = max_queue_tokens
        self._obs = observer or BatchObserver()
        self._pending: list[_Pending] = []  # in arrival order
        self._queued_tokens = 0
        self._counter = 0
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
        for p in self._pending:
            if not p.future.done():
                p.future.set_exception(err)
        self._pending = []
        self._queued_tokens = 0
        self._busy = False
        if self.on_died is not None:
            try:
                self.on_died(exc)
            except Exception:  # noqa: BLE001
                log.exception("on_died callback failed")

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def idle(self) -> bool:
        return not self._pending and not self._busy

    async def submit(self, items: list[ScoreItem]) -> list[SequenceScores]:
        """Scores `items` (all or nothing); raises Overloaded or Draining before queueing."""
        if self._died is not None:
            raise BatcherDied(f"the server's batcher stopped ({type(self._died).__name__}: {self._died}); retry on another replica")
        if self._closed:
            raise Draining("the server is shutting down")
        tokens = sum(it.num_tokens for it in items)
        if self._queued_tokens + tokens > self.max_queue_tokens and self._pending:
            raise Overloaded(
                f"queue full: {self._queued_tokens} tokens waiting, request adds {tokens}, limit {self.max_queue_tokens}"
            )
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        entries = []
        for it in items:
            self._counter += 1
            entries.append(_Pending(self._counter, it, loop.create_future(), now))
        self._pending.extend(entries)
        self._queued_tokens += tokens
        self._report_queue()
        self._wakeup.set()
        try:
            return list(await asyncio.gather(*(e.future for e in entries)))
        except BaseException:
            for e in entries:  # a cancelled or failed request leaves nothing behind
                e.future.cancel()
            raise

    async def close(self) -> None:
        """Stops accepting work, finishes what is queued, stops the loop."""
        self._closed = True
        while (self._pending or self._busy) and self._died is None:
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
                self._obs.on_queue(len(self._pending), self._queued_tokens)
            except Exception:  # noqa: BLE001 - metrics must not break scoring
                log.exception("batch observer on_queue failed")

    def _drop_cancelled(self) -> None:
        keep = []
        for p in self._pending:
            if p.future.done():
                self._queued_tokens -= p.item.num_tokens
            else:
                keep.append(p)
        self._pending = keep

    def _form_batch(self) -> list[_Pending]:
        """The oldest pending sequence plus the sequences closest to it in length that fit."""
        oldest = self._pending[0]
        by_len = sorted(self._pending[1:], key=lambda p: p.item.num_tokens)
        lengths = [p.item.num_tokens for p in by_len]
        chosen = [oldest]
        width = oldest.item.num_tokens
        lo = hi = bisect.bisect_left(lengths, width)
        # Grow outwards from the oldest's length while the padded size fits the budget.
        while lo > 0 or hi < len(by_len):
            cand_lo = by_len[lo - 1] if lo > 0 else None
            cand_hi = by_len[hi] if hi < len(by_len) else None
            if cand_hi is not None and (cand_lo is None or cand_hi.item.num_tokens - width <= width - cand_lo.item.num_tokens):
                new_width, pick, hi = max(width, cand_hi.item.num_tokens), cand_hi, hi + 1
            else:
                assert cand_lo is not None
                new_width, pick, lo = width, cand_lo, lo - 1
            if new_width * (len(chosen) + 1) > self.max_batch_tokens:
                break
            chosen.append(pick)
            width = new_width
        chosen_ids = {id(p) for p in chosen}
        self._pending = [p for p in self._pending if id(p) not in chosen_ids]
        self._queued_tokens -= sum(p.item.num_tokens for p in chosen)
        return chosen

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._drop_cancelled()
            if not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            # Wait (briefly) for the batch to fill unless the budget is already reached.
            deadline = self._pending[0].enqueued + self.max_wait_s
            while self._queued_tokens < self.max_batch_tokens and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            self._drop_cancelled()
            if not self._pending:
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
                    batch[0].future.done() or batch[0].future.set_exception(exc)
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
            for p, r in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(r)

    async def _score_one_by_one(self, batch: list[_Pending]) -> None:
        """After an engine error on a batch of several items: each item alone (the numbers do not
        depend on the batch), so only the items that fail on their own get the error."""
        loop = asyncio.get_running_loop()
        self._busy = True
        try:
            for p in batch:
                if p.future.done():  # cancelled meanwhile
                    continue
                try:
                    (result,) = await loop.run_in_executor(self._executor, self._score_fn, [p.item])
                except Exception as exc:  # noqa: BLE001 - this item's own failure
                    if not p.future.done():
                        p.future.set_exception(exc)
                    continue
                if not p.future.done():
                    p.future.set_result(result)
        finally:
            self._busy = False
