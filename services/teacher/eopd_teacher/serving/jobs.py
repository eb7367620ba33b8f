"""Engine jobs other than scoring (generation) waiting for the batcher's engine thread.

`JobQueue` holds the jobs in arrival order and the stepped job in progress (one whose state, the
KV cache, is kept between two of its turns); `run_turn` runs one turn of a job on the engine's
worker thread: all of an unstepped job, or one step of a stepped one. The batcher
(`batcher.DynamicBatcher`) decides when a job's turn comes (in turn with scoring batches)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass


@dataclass(eq=False)
class EngineJob:
    """One engine job (`fn()` on the worker thread), `tokens` counted against the queue limit while
    it waits. A stepped job's `fn()` returns an iterator, advanced one `next()` per turn (None until
    its result)."""

    fn: Callable[[], object]
    tokens: int
    ticket: asyncio.Future
    stepped: bool = False
    steps: Iterator[object] | None = None

    def close(self) -> None:
        """Frees a stepped job's state (its generator's KV cache)."""
        if self.steps is not None:
            self.steps.close()  # type: ignore[attr-defined]


def next_step(steps: Iterator[object]) -> object:
    """The next step of a stepped job (None: more to come); its end without a result is an error
    (a StopIteration cannot cross into a future)."""
    for out in steps:
        return out
    raise RuntimeError("a stepped engine job ended without a result")


class JobQueue:
    """Jobs waiting (FIFO) and the stepped job between two of its steps (`in_progress`)."""

    def __init__(self) -> None:
        self.waiting: deque[EngineJob] = deque()
        self.in_progress: EngineJob | None = None

    def __bool__(self) -> bool:
        """Whether any job waits or is in progress."""
        return bool(self.waiting) or self.in_progress is not None

    @property
    def tokens(self) -> int:
        """The tokens of the waiting jobs (counted against the batcher's queue limit)."""
        return sum(j.tokens for j in self.waiting)

    def add(self, job: EngineJob) -> None:
        self.waiting.append(job)

    def clear(self) -> list[asyncio.Future]:
        """Every job dropped (the one in progress closed); their tickets, for their callers."""
        tickets = [j.ticket for j in self.waiting]
        if self.in_progress is not None:
            tickets.append(self.in_progress.ticket)
            self.end_in_progress()
        self.waiting.clear()
        return tickets

    def drop_cancelled(self) -> None:
        """Jobs whose callers went away are withdrawn; a stepped one in progress is closed now."""
        if any(j.ticket.done() for j in self.waiting):
            self.waiting = deque(j for j in self.waiting if not j.ticket.done())
        if self.in_progress is not None and self.in_progress.ticket.done():
            self.end_in_progress()

    def end_in_progress(self) -> None:
        job, self.in_progress = self.in_progress, None
        if job is not None:
            job.close()

    def next(self) -> EngineJob | None:
        """The job whose turn is next: the stepped job in progress, else the oldest waiting."""
        if self.in_progress is not None:
            return self.in_progress
        return self.waiting[0] if self.waiting else None

    async def run_turn(self, job: EngineJob, executor: Executor) -> None:
        """One turn of `job` (from `next`) on `executor`: all of it, or one step of a stepped job;
        its result or error goes to its caller. A stepped job with more to do stays in progress."""
        if job is not self.in_progress:
            self.waiting.popleft()
        self.in_progress = None
        loop = asyncio.get_running_loop()
        try:
            if not job.stepped:
                result = await loop.run_in_executor(executor, job.fn)
            else:
                if job.steps is None:
                    job.steps = job.fn()  # a generator: nothing runs until its first next()
                result = await loop.run_in_executor(executor, next_step, job.steps)
                if result is None:  # more steps to go: it keeps its state and its turn
                    self.in_progress = job
                    return
        except Exception as exc:  # noqa: BLE001 - the job's own failure, for its caller
            job.close()
            job.ticket.done() or job.ticket.set_exception(exc)
        else:
            job.ticket.done() or job.ticket.set_result(result)
