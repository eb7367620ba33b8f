"""The dynamic batcher's logic with a recording score function (no model)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from eopd_teacher.serving.batcher import BatcherDied, BatchObserver, Draining, DynamicBatcher, Overloaded
from eopd_teacher.types import ScoreItem, SequenceScores


def _item(sid: str, n: int) -> ScoreItem:
    return ScoreItem(sid, np.arange(n, dtype=np.int64), 1, 2, 1.0)


class Recorder:
    def __init__(self, delay: float = 0.0):
        self.batches: list[list[str]] = []
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()

    def __call__(self, items):
        self.gate.wait(10)
        if self.delay:
            import time

            time.sleep(self.delay)
        self.batches.append([it.seq_id for it in items])
        return [
            SequenceScores(it.seq_id, np.full(it.num_scored, float(it.num_tokens), np.float32), np.zeros(it.num_scored, np.float32),
                           np.zeros((it.num_scored, 2), np.int32), np.zeros((it.num_scored, 2), np.float32))
            for it in items
        ]


async def test_groups_concurrent_requests_under_token_budget():
    rec = Recorder()
    b = DynamicBatcher(rec, max_batch_tokens=100, max_wait_s=0.05, max_queue_tokens=10_000)
    b.start()
    reqs = [[_item(f"r{r}s{i}", 10) for i in range(3)] for r in range(5)]
    results = await asyncio.gather(*(b.submit(r) for r in reqs))
    for req, res in zip(reqs, results, strict=True):  # each request gets its own answers, in order
        assert [x.seq_id for x in res] == [it.seq_id for it in req]
    assert all(len(batch) * 10 <= 100 for batch in rec.batches)
    assert len(rec.batches) < 15  # batched across requests, not one by one
    await b.close()


async def test_groups_by_length_and_oldest_first():
    rec = Recorder()
    rec.gate.clear()
    b = DynamicBatcher(rec, max_batch_tokens=64, max_wait_s=0.0, max_queue_tokens=10_000)
    b.start()
    first = asyncio.ensure_future(b.submit([_item("blocker", 4)]))
    await asyncio.sleep(0.05)  # the blocker is in the engine; the rest queue up
    lens = {"a": 30, "b": 4, "c": 31, "d": 5, "e": 3}
    futs = [asyncio.ensure_future(b.submit([_item(k, v)])) for k, v in lens.items()]
    await asyncio.sleep(0.05)
    rec.gate.set()
    await asyncio.gather(first, *futs)
    # "a" is oldest; the closest length ("c") joins it; the short ones go together.
    assert rec.batches[1] == ["a", "c"]
    assert sorted(rec.batches[2]) == ["b", "d", "e"]
    await b.close()


async def test_overload_is_refused_and_nothing_is_lost():
    rec = Recorder()
    rec.gate.clear()
    b = DynamicBatcher(rec, max_batch_tokens=10, max_wait_s=0.0, max_queue_tokens=25)
    b.start()
    running = asyncio.ensure_future(b.submit([_item("x", 10)]))
    await asyncio.sleep(0.05)
    queued = asyncio.ensure_future(b.submit([_item("y", 20)]))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded, match="queue full"):
        await b.submit([_item("z", 10)])
    rec.gate.set()
    assert (await running)[0].seq_id == "x" and (await queued)[0].seq_id == "y"
    assert b.queued_tokens == 0
    await b.close()
    with pytest.raises(Draining):
        await b.submit([_item("late", 3)])


async def test_cancelled_request_is_not_scored():
    rec = Recorder()
    rec.gate.clear()
    b = DynamicBatcher(rec, max_batch_tokens=8, max_wait_s=0.0, max_queue_tokens=1000)
    b.start()
    blocker = asyncio.ensure_future(b.submit([_item("blocker", 8)]))
    await asyncio.sleep(0.05)
    doomed = asyncio.ensure_future(b.submit([_item("doomed", 8)]))
    await asyncio.sleep(0.01)
    doomed.cancel()
    await asyncio.sleep(0.01)
    rec.gate.set()
    await blocker
    await asyncio.sleep(0.05)
    assert ["doomed"] not in rec.batches and b.queued_tokens == 0
    await b.close()


async def test_engine_failure_fails_only_that_batch():
    calls = {"n": 0}
    rec = Recorder()

    def flaky(items):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return rec(items)

    b = DynamicBatcher(flaky, max_batch_tokens=5, max_wait_s=0.0, max_queue_tokens=1000)
    b.start()
    with pytest.raises(RuntimeError, match="boom"):
        await b.submit([_item("a", 5)])
    assert (await b.submit([_item("b", 5)]))[0].seq_id == "b"
    await b.close()


async def test_engine_error_on_a_shared_batch_fails_only_the_culprit():
    """An engine error on a batch of several requests: the items are scored again one at a time,
    so the requests that share the batch with the bad one succeed."""
    rec = Recorder()

    def score(items):
        if any(it.seq_id == "bad" for it in items):
            raise RuntimeError("engine exploded on 'bad'")
        return rec(items)

    b = DynamicBatcher(score, max_batch_tokens=1000, max_wait_s=0.05, max_queue_tokens=10_000)
    b.start()
    outcomes = await asyncio.gather(
        b.submit([_item("a1", 10), _item("a2", 10)]), b.submit([_item("bad", 10)]), b.submit([_item("c", 11)]), return_exceptions=True
    )
    assert [x.seq_id for x in outcomes[0]] == ["a1", "a2"] and [x.seq_id for x in outcomes[2]] == ["c"]
    assert isinstance(outcomes[1], RuntimeError) and "bad" in str(outcomes[1])
    assert ["a1"] in rec.batches and ["c"] in rec.batches  # re-scored alone
    await b.close()


async def test_failing_observer_does_not_break_scoring():
    def boom(*_):
        raise ValueError("observer bug")

    b = DynamicBatcher(Recorder(), max_batch_tokens=100, max_wait_s=0.0, max_queue_tokens=10_000,
                       observer=BatchObserver(on_batch=boom, on_queue=boom))
    b.start()
    res = await asyncio.wait_for(b.submit([_item("x", 5)]), 10)
    assert [r.seq_id for r in res] == ["x"]
    await b.close()


async def test_dead_loop_fails_pending_work_and_reports():
    """If the batcher's loop dies (a bug), pending requests fail at once with BatcherDied
    (UNAVAILABLE: retry elsewhere), new ones are refused, and on_died is called (the server then
    turns not ready)."""
    rec = Recorder()
    rec.gate.clear()  # the first batch blocks in the engine while more queue up
    b = DynamicBatcher(rec, max_batch_tokens=10, max_wait_s=0.0, max_queue_tokens=10_000)
    died = []
    b.on_died = died.append
    b.start()
    first = asyncio.ensure_future(b.submit([_item("first", 5)]))
    await asyncio.sleep(0.05)
    waiting = asyncio.ensure_future(b.submit([_item("waiting", 5)]))
    await asyncio.sleep(0.05)

    def broken():
        raise KeyError("bug in batch forming")

    b._form_batch = broken
    rec.gate.set()
    with pytest.raises(BatcherDied, match="KeyError"):
        await asyncio.wait_for(waiting, 10)
    assert [r.seq_id for r in await first] == ["first"]
    assert not b.alive and len(died) == 1 and isinstance(died[0], KeyError)
    with pytest.raises(BatcherDied):
        await b.submit([_item("late", 5)])
    await asyncio.wait_for(b.close(), 10)
