"""The pipelined batcher (`launch_fn`, `serving/delivery.py`) with a recording engine whose answers
become ready only when the test says so (the device's copy, simulated): the next batch is
launched while the last one's answer waits, answers come back in launch order and are exactly the
unpipelined batcher's, and a failing answer falls back to scoring one by one."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from eopd_teacher.serving.batcher import BatchObserver, DynamicBatcher
from eopd_teacher.serving.delivery import MAX_UNDELIVERED
from eopd_teacher.types import ScoreItem, SequenceScores

from .test_batcher import Recorder


def _item(sid: str, n: int) -> ScoreItem:
    return ScoreItem(sid, np.arange(n, dtype=np.int64), 1, 2, 1.0)


class _Pending:
    """An answer that is ready once `release` is set (or at once): the engine's PendingScores."""

    def __init__(self, scores, release: threading.Event, fail: bool = False):
        self._scores, self._release, self._fail = scores, release, fail
        self.copy_wait_s, self.split_s = 0.0, 0.0

    @property
    def ready(self) -> bool:
        return self._release.is_set()

    def result(self):
        assert self._release.wait(10)
        self.copy_wait_s = 0.001
        if self._fail:
            raise RuntimeError("device error on this batch")
        return self._scores


class Launcher:
    """`launch_fn`: scores with `Recorder` at launch, answers pending until `release`."""

    def __init__(self, fail_on: str | None = None):
        self.rec = Recorder()
        self.release = threading.Event()
        self.launched: list[list[str]] = []
        self.fail_on = fail_on

    def __call__(self, items: list[ScoreItem]) -> _Pending:
        self.launched.append([it.seq_id for it in items])
        fail = self.fail_on is not None and any(it.seq_id == self.fail_on for it in items)
        return _Pending(self.rec(items), self.release, fail)


async def _scores(b: DynamicBatcher, reqs) -> list[list[SequenceScores]]:
    b.start()
    try:
        out = []
        for r in reqs:  # one after another: one batch each
            out.append(asyncio.ensure_future(b.submit(r)))
            await asyncio.sleep(0.02)
        return await asyncio.gather(*out)
    finally:
        await b.close()


def _same(a: list[list[SequenceScores]], b: list[list[SequenceScores]]) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert [x.seq_id for x in ra] == [x.seq_id for x in rb]
        for x, y in zip(ra, rb, strict=True):
            for f in ("token_logprobs", "entropies", "topk_ids", "topk_logprobs"):
                np.testing.assert_array_equal(getattr(x, f), getattr(y, f))


async def test_next_batch_launches_while_the_last_answer_waits_and_answers_stay_in_order():
    reqs = [[_item(f"r{r}s{i}", 5 + r) for i in range(2)] for r in range(4)]
    delivered: list[float] = []
    launcher = Launcher()
    b = DynamicBatcher(launcher.rec, max_batch_tokens=20, max_wait_s=0.0, max_queue_tokens=10_000, launch_fn=launcher,
                       observer=BatchObserver(on_delivery=lambda copy_s, split_s: delivered.append(copy_s)))
    task = asyncio.ensure_future(_scores(b, reqs))
    for _ in range(200):  # the device is "busy": answers wait, yet the next batches are launched
        await asyncio.sleep(0.01)
        if len(launcher.launched) >= MAX_UNDELIVERED:
            break
    assert len(launcher.launched) == MAX_UNDELIVERED and not task.done()  # bounded: the next waits for a delivery
    launcher.release.set()
    pipelined = await task
    assert len(launcher.launched) == len(reqs) and len(delivered) == len(reqs)
    # The same requests through the unpipelined batcher: the same answers, in the same order.
    plain = await _scores(DynamicBatcher(Recorder(), max_batch_tokens=20, max_wait_s=0.0, max_queue_tokens=10_000), reqs)
    _same(pipelined, plain)
    for req, res in zip(reqs, pipelined, strict=True):
        assert [x.seq_id for x in res] == [it.seq_id for it in req]


async def test_ready_answers_are_delivered_at_once():
    launcher = Launcher()
    launcher.release.set()  # the CPU: nothing to wait for
    b = DynamicBatcher(launcher.rec, max_batch_tokens=100, max_wait_s=0.0, max_queue_tokens=10_000, launch_fn=launcher)
    b.start()
    res = await asyncio.gather(*(b.submit([_item(f"a{i}", 4)]) for i in range(5)))
    assert [r[0].seq_id for r in res] == [f"a{i}" for i in range(5)]
    assert b.idle
    await b.close()


async def test_failed_answer_falls_back_to_one_by_one():
    launcher = Launcher(fail_on="bad")
    launcher.release.set()
    scored_alone: list[str] = []

    def score(items):
        if any(it.seq_id == "bad" for it in items):
            raise RuntimeError("engine exploded on 'bad'")
        scored_alone.extend(it.seq_id for it in items)
        return launcher.rec(items)

    b = DynamicBatcher(score, max_batch_tokens=1000, max_wait_s=0.05, max_queue_tokens=10_000, launch_fn=launcher)
    b.start()
    outcomes = await asyncio.gather(b.submit([_item("a1", 10), _item("a2", 10)]), b.submit([_item("bad", 10)]),
                                    return_exceptions=True)
    assert [x.seq_id for x in outcomes[0]] == ["a1", "a2"]
    assert isinstance(outcomes[1], RuntimeError) and "bad" in str(outcomes[1])
    assert scored_alone == ["a1", "a2"]
    await b.close()
