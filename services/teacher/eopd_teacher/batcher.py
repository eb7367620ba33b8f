"""Dynamic batching across concurrent requests and streams.

Requests submit their sequences; one loop forms batches under a padded-token budget, waiting at
most `max_wait_s` for a batch to fill, grouping sequences of similar length (the oldest waiting
sequence is always in the next batch, so nothing starves), and runs the engine on one worker
thread while new work keeps arriving. Admission is bounded by the tokens waiting in the queue.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .types import ScoreItem, SequenceScores


class Overloaded(Exception):
    """The queue is full: the caller should answer RESOURCE_EXHAUSTED."""


class Draining(Exception):
    """The batcher no longer accepts work: the caller should answer UNAVAILABLE."""


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

    # -- public -----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="eopd-batcher")

    @property
    def queued_tokens(self) -> int:
        return self._queued_tokens

    @property
    def idle(self) -> bool:
        return not self._pending and not self._busy

    async def submit(self, items: list[ScoreItem]) -> list[SequenceScores]:
        """Scores `items` (all or nothing); raises Overloaded or Draining before queueing."""
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
        while self._pending or self._busy:
            self._wakeup.set()
            await asyncio.sleep(0.01)
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    # -- loop ---------------------------------------------------------------------------------
    def _report_queue(self) -> None:
        if self._obs.on_queue:
            self._obs.on_queue(len(self._pending), self._queued_tokens)

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
            except Exception as exc:  # the engine failed: fail this batch only
                for p in batch:
                    if not p.future.done():
                        p.future.set_exception(exc)
                continue
            finally:
                self._busy = False
            if self._obs.on_batch:
                width = max(it.num_tokens for it in items)
                self._obs.on_batch(len(items), sum(it.num_tokens for it in items), width * len(items), time.perf_counter() - started)
            for p, r in zip(batch, results, strict=True):
                if not p.future.done():
                    p.future.set_result(r)
