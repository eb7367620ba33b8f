"""Delivery of pipelined scoring batches (the batcher's `launch_fn`): a launched batch's pending
answer (`engines.base.PendingScores`) is waited for on a delivery thread of its own (its copy from
the device, then the split per sequence) and handed to the batch's requests, while the batcher's
loop launches the next batch on the engine's thread. Batches are delivered in launch order (one
thread); at most MAX_UNDELIVERED wait (`make_room`). An answer that is ready at once (the CPU:
no copy to wait for) is delivered at once, without a thread hop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ..types import SequenceScores
from .scheduling import Waiting

log = logging.getLogger(__name__)

# Launched batches whose answers are not yet delivered, at most (the next launch waits for the oldest).
MAX_UNDELIVERED = 2


class Pending(Protocol):
    """A launched batch's answer (`engines.base.PendingScores`)."""

    ready: bool
    copy_wait_s: float
    split_s: float

    def result(self) -> list[SequenceScores]: ...


def deliver_results(batch: list[Waiting], results: list[SequenceScores]) -> None:
    """Each sequence's scores to its request (those cancelled meanwhile are skipped)."""
    for w, r in zip(batch, results, strict=True):
        if not w.ticket.done():
            w.ticket.set_result(r)


class Deliveries:
    """The batches launched and not yet delivered. `fail(batch, exc)`: what a batch whose answer
    failed gets (the batcher's one-by-one retry); `on_delivery(copy_wait_s, split_s)`: metrics."""

    def __init__(self, fail: Callable[[list[Waiting], Exception], Awaitable[None]],
                 on_delivery: Callable[[float, float], None] | None = None):
        self._fail = fail
        self._on_delivery = on_delivery
        self._tasks: deque[asyncio.Task] = deque()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eopd-deliver")

    def __len__(self) -> int:
        return len(self._tasks)

    async def make_room(self) -> None:
        """Waits until fewer than MAX_UNDELIVERED batches wait for delivery."""
        while len(self._tasks) >= MAX_UNDELIVERED:
            await asyncio.wait({self._tasks[0]})

    async def drain(self) -> None:
        """Waits until every launched batch is delivered."""
        while self._tasks:
            await asyncio.wait({self._tasks[0]})

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True)

    async def deliver(self, batch: list[Waiting], pending: Pending) -> None:
        """Delivers `batch`'s answer: now when it is ready and nothing was launched before it is
        undelivered, else in a task of its own (returns at once)."""
        if not self._tasks and pending.ready:
            await self._answer(batch, pending.result, inline=True)
            return
        task = asyncio.get_running_loop().create_task(self._answer(batch, pending.result, inline=False), name="eopd-deliver")
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _answer(self, batch: list[Waiting], result: Callable[[], list[SequenceScores]], *, inline: bool) -> None:
        try:
            results = result() if inline else await asyncio.get_running_loop().run_in_executor(self._executor, result)
        except Exception as exc:  # noqa: BLE001 - the device failed on this batch: the batch's failure
            await self._fail(batch, exc)
            return
        if self._on_delivery is not None:
            pending = getattr(result, "__self__", None)
            try:
                self._on_delivery(getattr(pending, "copy_wait_s", 0.0), getattr(pending, "split_s", 0.0))
            except Exception:  # noqa: BLE001 - metrics must not break scoring
                log.exception("batch observer on_delivery failed")
        deliver_results(batch, results)
