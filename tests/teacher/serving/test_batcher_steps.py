"""The batcher with chunked prefill (`steps_fn`), pure logic with a recording step function (no
model): a batch over `step_tokens` runs in steps, another client's request is served between two
steps of it (not after the whole batch), a client's own next batch does not jump ahead of its job,
results come back whole and in order, and a failing step fails only its culprit."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from eopd_teacher.serving.batcher import DynamicBatcher
from eopd_teacher.types import ScoreItem

from .test_batcher import Recorder


def _item(sid: str, n: int) -> ScoreItem:
    return ScoreItem(sid, np.arange(n, dtype=np.int64), 1, 2, 1.0)


class Steps:
    """steps_fn: ceil(width / (step_tokens // rows)) steps per batch; `log` records every engine call
    in order: ("step", first id, j) for a step, ("whole", first id, 0) for a batch scored whole
    (`whole`, the score_fn)."""

    def __init__(self, step_tokens: int, fail_on: str | None = None):
        self.step_tokens = step_tokens
        self.log: list[tuple] = []
        self.record = Recorder()
        self.gate = threading.Event()
        self.gate.set()
        self.fail_on = fail_on

    def __call__(self, items):
        width = max(it.num_tokens for it in items)
        per_step = max(1, self.step_tokens // len(items))
        n = -(-width // per_step)
        for j in range(n):
            self.gate.wait(10)
            if self.fail_on and any(it.seq_id == self.fail_on for it in items) and j == 1:
                raise RuntimeError("engine failure")
            self.log.append(("step", items[0].seq_id, j))
            yield None if j < n - 1 else self.record(items)

    def whole(self, items):
        self.log.append(("whole", items[0].seq_id, 0))
        return self.record(items)


async def test_other_clients_request_runs_between_the_steps_of_a_large_batch():
    steps = Steps(step_tokens=64)
    b = DynamicBatcher(steps.whole, max_batch_tokens=4096, max_wait_s=0.0, max_queue_tokens=1 << 20,
                       max_client_tokens=1024, steps_fn=steps, step_tokens=64)
    b.start()
    steps.gate.clear()  # the big request's first step blocks while the small one arrives
    big_items = [_item(f"b{i}", 512) for i in range(4)]  # 2 batches of 2 x 512, each in 16 steps of 32 columns
    big = asyncio.ensure_future(b.submit(big_items, "big"))
    await asyncio.sleep(0.05)
    small = asyncio.ensure_future(b.submit([_item("s", 16)], "small"))
    await asyncio.sleep(0.01)
    steps.gate.set()
    small_res = await asyncio.wait_for(small, 10)
    big_res = await asyncio.wait_for(big, 10)
    steps_before_small = steps.log.index(("whole", "s", 0))
    assert [r.seq_id for r in small_res] == ["s"]
    assert steps_before_small == 1  # the big batch's step in progress when it arrived, no more
    assert steps.record.batches[0] == ["s"]  # small (16 tokens <= step_tokens): scored whole
    assert [r.seq_id for r in big_res] == [it.seq_id for it in big_items]
    big_steps = [e for e in steps.log if e[1].startswith("b")]
    assert len(big_steps) == 2 * 16
    # The big client's second batch started only after its first finished (one job per client).
    assert [e[1] for e in big_steps] == ["b0"] * 16 + ["b2"] * 16
    assert b.idle
    await b.close()


async def test_a_failing_step_fails_only_its_culprit():
    steps = Steps(step_tokens=8, fail_on="bad")
    def whole(items):  # the retry one by one after the failed step: the culprit fails again
        if any(it.seq_id == "bad" for it in items):
            raise RuntimeError("engine failure")
        return steps.record(items)

    b = DynamicBatcher(whole, max_batch_tokens=4096, max_wait_s=0.05, max_queue_tokens=1 << 20,
                       steps_fn=steps, step_tokens=8)
    b.start()
    bad = asyncio.ensure_future(b.submit([_item("bad", 40)], "a"))
    good = asyncio.ensure_future(b.submit([_item("good", 40)], "a"))
    res = await asyncio.wait_for(good, 10)
    assert [r.seq_id for r in res] == ["good"]
    assert ("step", "bad", 0) in steps.log or ("step", "good", 0) in steps.log  # they ran in steps first
    try:
        await asyncio.wait_for(bad, 10)
        raise AssertionError("the failing sequence was answered")
    except RuntimeError as exc:
        assert "engine failure" in str(exc)
    assert b.idle
    await b.close()
