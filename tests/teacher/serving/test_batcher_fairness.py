"""Fair queuing by client (scheduling.FairQueue), pure logic, and through the batcher with a
recording score function (no model): a large request is split into batches and other clients'
requests are served between them; a split request's results come back whole and in order."""

from __future__ import annotations

import asyncio

import numpy as np

from eopd_teacher.serving.batcher import DynamicBatcher
from eopd_teacher.serving.scheduling import MIN_WIDTH_CAP, FairQueue, Waiting
from eopd_teacher.types import ScoreItem

from .test_batcher import Recorder


def _item(sid: str, n: int) -> ScoreItem:
    return ScoreItem(sid, np.arange(n, dtype=np.int64), 1, 2, 1.0)


class _Seq:
    def __init__(self):
        self.n = 0

    def __call__(self, client: str, sid: str, n: int) -> Waiting:
        self.n += 1
        return Waiting(self.n, _item(sid, n), client)


def _ids(batch: list[Waiting]) -> list[str]:
    return [w.item.seq_id for w in batch]


def _drain(q: FairQueue) -> list[list[str]]:
    out = []
    while batch := q.take_batch():
        out.append(_ids(batch))
    assert len(q) == 0 and q.tokens == 0
    return out


def test_large_request_is_split_and_other_clients_go_between():
    """16 x 2048 tokens from one client, then a 16-token request from another: the big one is
    served in batches of at most the per-client share, and the small one goes right after the
    first of them (not after all 16)."""
    w, q = _Seq(), FairQueue(max_batch_tokens=16384, max_client_tokens=4096)
    q.add([w("big", f"b{i}", 2048) for i in range(16)])
    first = q.take_batch()  # the big client's first batch is in the engine when the small one arrives
    assert _ids(first) == ["b0", "b1"]
    q.add([w("small", "s", 16)])
    rest = _drain(q)
    assert rest[0] == ["s"]  # not padded to 2048 with the big one's sequences
    assert rest[1:] == [[f"b{i}", f"b{i + 1}"] for i in range(2, 16, 2)]  # the rest, in order


def test_clients_take_turns_in_proportion_to_tokens():
    w, q = _Seq(), FairQueue(max_batch_tokens=100, max_client_tokens=100)
    q.add([w("a", f"a{i}", 100) for i in range(4)])
    q.add([w("b", f"b{i}", 100) for i in range(4)])
    q.add([w("c", f"c{i}", 50) for i in range(4)])  # half as long: two per turn
    assert _drain(q) == [["a0"], ["b0"], ["c0", "c1"], ["a1"], ["b1"], ["c2", "c3"], ["a2"], ["b2"], ["a3"], ["b3"]]


def test_one_client_keeps_arrival_order_and_batches_up_to_its_share():
    w, q = _Seq(), FairQueue(max_batch_tokens=1000, max_client_tokens=300)
    q.add([w("a", f"a{i}", 100) for i in range(7)])
    assert _drain(q) == [["a0", "a1", "a2"], ["a3", "a4", "a5"], ["a6"]]


def test_other_clients_fill_the_rest_of_the_batch():
    """Each client's share is bounded, not the batch: with many clients, batches stay full."""
    w, q = _Seq(), FairQueue(max_batch_tokens=400, max_client_tokens=200)
    q.add([w("a", f"a{i}", 100) for i in range(4)])
    q.add([w("b", f"b{i}", 100) for i in range(4)])
    first = q.take_batch()
    assert sorted(_ids(first)) == ["a0", "a1", "b0", "b1"]


def test_a_sequence_longer_than_the_share_or_budget_still_goes_alone():
    w, q = _Seq(), FairQueue(max_batch_tokens=1000, max_client_tokens=300)
    q.add([w("a", "huge", 5000), w("a", "next", 10)])
    assert _drain(q) == [["huge"], ["next"]]


def test_short_anchor_is_not_padded_to_long_sequences_but_long_anchor_takes_short_ones():
    w, q = _Seq(), FairQueue(max_batch_tokens=10_000)
    q.add([w("a", "short", 16), w("b", "long", 2000), w("b", "long2", 2000)])
    assert _ids(q.take_batch()) == ["short"]  # width cap: max(2 x 16, MIN_WIDTH_CAP)
    q.add([w("a", "tiny", MIN_WIDTH_CAP // 2)])
    assert sorted(_ids(q.take_batch())) == ["long", "long2", "tiny"]


def test_a_new_client_joins_at_the_clock_without_credit_for_idle_time():
    """A client arriving after another was served alone for a long time gets the next turn, then
    they alternate: it is not owed the tokens served before it arrived."""
    w, q = _Seq(), FairQueue(max_batch_tokens=100, max_client_tokens=100)
    q.add([w("a", f"a{i}", 100) for i in range(20)])
    for _ in range(10):
        q.take_batch()
    q.add([w("b", f"b{i}", 100) for i in range(4)])
    assert _drain(q)[:6] == [["b0"], ["a10"], ["b1"], ["a11"], ["b2"], ["a12"]]


def test_dropped_and_cleared_entries_leave_no_state():
    w, q = _Seq(), FairQueue(max_batch_tokens=100)
    entries = [w("a", "a0", 10), w("b", "b0", 20), w("b", "b1", 30)]
    q.add(entries)
    assert q.oldest() is entries[0]
    assert _ids(q.drop(lambda e: e.client == "b")) == ["b0", "b1"]
    assert q.tokens == 10 and len(q) == 1 and q.clients() == {"a": 10}
    assert _ids(q.clear()) == ["a0"] and q.oldest() is None and not q.clients()


async def test_batcher_interleaves_clients_and_reassembles_a_split_request_in_order():
    rec = Recorder()
    rec.gate.clear()  # the big request's first batch blocks in the engine while the small one arrives
    b = DynamicBatcher(rec, max_batch_tokens=4096, max_wait_s=0.0, max_queue_tokens=1 << 20, max_client_tokens=1024)
    b.start()
    big_items = [_item(f"b{i}", 512 - i) for i in range(12)]  # decreasing lengths: grouping must not reorder results
    big = asyncio.ensure_future(b.submit(big_items, "big"))
    await asyncio.sleep(0.05)
    small = asyncio.ensure_future(b.submit([_item("s", 16)], "small"))
    await asyncio.sleep(0.01)
    rec.gate.set()
    small_res, big_res = await asyncio.wait_for(small, 10), await asyncio.wait_for(big, 10)
    assert [r.seq_id for r in small_res] == ["s"]
    assert [r.seq_id for r in big_res] == [it.seq_id for it in big_items]
    assert [float(r.token_logprobs[0]) for r in big_res] == [float(it.num_tokens) for it in big_items]
    assert rec.batches[1] == ["s"]  # right after the first batch of the big request
    assert len(rec.batches) == 1 + 6  # the big one: 6 batches of 2 (<= 1024 tokens each)
    assert all(len(batch) <= 2 for batch in rec.batches)
    await b.close()
