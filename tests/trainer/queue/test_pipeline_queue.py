"""The Redis Streams queue against a real redis-server on a private port and against the embedded
queue of `eopd run` (fakeredis' TCP server in a thread of the test process): the same tests, real
redis-py clients over TCP in both cases."""

from __future__ import annotations

import threading
import time

import pytest
from eopd_trainer.queue.lease import Lease, LeaseHeld, LeaseLost
from eopd_trainer.queue.streams import (
    Keys,
    StreamQueue,
    connect,
    read_counts,
    read_dead_letters,
    read_dropped,
    wait_for_room,
)

from tests.trainer.redis_helpers import running_embedded_queue, running_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", params=["redis-server", "embedded"])
def redis_server(request):
    with (running_redis() if request.param == "redis-server" else running_embedded_queue()) as server:
        yield server


def queue(url: str, ns: str, consumer: str) -> StreamQueue:
    keys = Keys(ns)
    q = StreamQueue(connect(url), keys.rollouts, "learner", consumer, keys.dead)
    q.ensure_group()
    q.ensure_group()  # idempotent
    return q


def test_ack_deletes_and_pending_survives_restart(redis_server):
    q = queue(redis_server.url, "q1", "c1")
    ids = [q.add(f"m{i}".encode()) for i in range(5)]
    got = q.read_new(3, block_ms=100)
    assert [e.data for e in got] == [b"m0", b"m1", b"m2"]
    q.ack([got[0].entry_id])
    assert q.length() == 4 and q.pending_count() == 2
    # The same consumer after a restart reads its unacknowledged entries again, first.
    again = queue(redis_server.url, "q1", "c1").read_pending(10)
    assert [e.entry_id for e in again] == ids[1:3]



def test_undelivered_excludes_entries_held_unacknowledged(redis_server):
    """What the learner counts as rollouts still to come: not the entries it holds pending (with
    checkpoint.every > 1, whole trained iterations wait for their commit before the ack), and
    still exact after acks, dead letters and a restart's claim."""
    q = queue(redis_server.url, "q1u", "learner")
    for i in range(10):
        q.add(f"m{i}".encode())
    assert q.undelivered() == 10
    held = q.read_new(4, block_ms=100)  # e.g. an iteration trained, not yet committed
    assert q.length() == 10 and q.undelivered() == 6
    batch = q.read_new(3, block_ms=100)
    q.dead_letter(batch[0], "poison")
    q.ack([batch[1].entry_id])  # a stale rollout, dropped
    assert q.length() == 8 and q.undelivered() == 3
    assert len(q.read_new(10, block_ms=100)) == 3
    assert q.undelivered() == 0 and q.length() == 8  # XLEN - len(last batch) would say 7 are waiting
    other = queue(redis_server.url, "q1u", "restarted")
    assert len(other.claim_idle(0, 100)) == 8 and other.undelivered() == 0
    q.ack(e.entry_id for e in held)
    q.add(b"late")
    assert q.undelivered() == 1 and q.length() == 5


def test_xautoclaim_takes_over_a_dead_consumers_entries(redis_server):
    dead = queue(redis_server.url, "q2", "dead")
    for i in range(4):
        dead.add(f"m{i}".encode())
    assert len(dead.read_new(4, block_ms=100)) == 4
    alive = queue(redis_server.url, "q2", "alive")
    assert alive.claim_idle(min_idle_ms=10_000) == []  # not idle long enough
    time.sleep(0.15)
    claimed = alive.claim_idle(min_idle_ms=100)
    assert [e.data for e in claimed] == [b"m0", b"m1", b"m2", b"m3"]
    assert alive.deliveries(claimed[0].entry_id) == 2
    alive.ack(e.entry_id for e in claimed)
    assert alive.length() == 0 and alive.pending_count() == 0


def test_touch_keeps_a_live_consumers_entries_from_being_claimed(redis_server):
    """The worker's heartbeat: entries it still works on are not idle to others' XAUTOCLAIM; it does
    not count as a delivery, and entries another consumer already took are not taken back."""
    busy = queue(redis_server.url, "q2t", "busy")
    for i in range(3):
        busy.add(f"m{i}".encode())
    held = busy.read_new(3, block_ms=100)
    other = queue(redis_server.url, "q2t", "other")
    time.sleep(0.3)
    assert busy.touch([held[0].entry_id, held[1].entry_id]) == 2
    claimed = other.claim_idle(min_idle_ms=250)  # only the entry that was not touched is idle
    assert [e.data for e in claimed] == [b"m2"]
    assert busy.deliveries(held[0].entry_id) == 1 and other.deliveries(held[2].entry_id) == 2
    assert busy.touch([held[2].entry_id]) == 0  # taken by `other`: left alone
    assert other.claim_idle(min_idle_ms=10_000) == []
    assert busy.touch([]) == 0


def test_xautoclaim_drops_entries_deleted_while_pending(redis_server):
    dead = queue(redis_server.url, "q2b", "dead")
    a, b = dead.add(b"a"), dead.add(b"b")
    assert len(dead.read_new(2, block_ms=100)) == 2
    dead.r.xdel(dead.stream, a)  # deleted, never acknowledged
    alive = queue(redis_server.url, "q2b", "alive")
    assert [e.entry_id for e in alive.claim_idle(min_idle_ms=0)] == [b]
    assert alive.pending_count() == 1  # the deleted entry left the pending list


def test_dead_letter_keeps_reason_and_payload(redis_server):
    q = queue(redis_server.url, "q3", "c")
    q.add(b"\xffpoison")
    [entry] = q.read_new(1, block_ms=100)
    q.dead_letter(entry, "undecodable ScoredRollout: truncated")
    [row] = read_dead_letters(q.r, Keys("q3").dead)
    assert row["reason"] == "undecodable ScoredRollout: truncated" and row["data"] == b"\xffpoison"
    assert row["entry_id"] == entry.entry_id and row["source"] == Keys("q3").rollouts
    assert q.length() == 0 and q.pending_count() == 0


def test_drop_records_acks_and_counts_in_one_transaction(redis_server):
    """A rollout acknowledged without training leaves the stream and is recorded (dropped stream +
    exact count) by the same MULTI/EXEC: nothing in between for a crash to lose."""
    keys = Keys("q3d")
    q = StreamQueue(connect(redis_server.url), keys.rollouts, "learner", "c", keys.dead,
                    dropped_stream=keys.dropped, counts_key=keys.counts)
    q.ensure_group()
    for i in range(4):
        q.add(f"r{i}".encode())
    e = q.read_new(4, block_ms=100)
    q.drop(e[0], "stale", rollout_id="t0-s0", policy_version=0, staleness=2)
    q.drop(e[1], "future", rollout_id="t0-s1", policy_version=5, staleness=-3)
    q.drop(e[2], "stale", rollout_id="t1-s0", policy_version=1, staleness=2)
    q.dead_letter(e[3], "undecodable")
    assert q.length() == 0 and q.pending_count() == 0
    assert read_counts(q.r, keys.counts) == {"stale": 2, "future": 1, "dead_letter": 1}
    rows = read_dropped(q.r, keys.dropped)
    assert [(r["rollout_id"], r["reason"], r["staleness"], r["entry_id"]) for r in rows] == [
        ("t0-s0", "stale", "2", e[0].entry_id), ("t0-s1", "future", "-3", e[1].entry_id),
        ("t1-s0", "stale", "2", e[2].entry_id)]
    assert all(r["source"] == keys.rollouts and r["consumer"] == "c" for r in rows)
    plain = StreamQueue(q.r, keys.rollouts, "learner", "c", keys.dead)  # a worker's queue: no drop records
    with pytest.raises(RuntimeError, match="dropped_stream"):
        plain.drop(e[0], "stale", rollout_id="x", policy_version=0, staleness=0)


def _dead_pid() -> int:
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_lease_one_holder_heartbeat_fencing_and_takeover(redis_server):
    import json

    r = connect(redis_server.url)
    key = Keys("q-lease").lease
    first = Lease(r, key, ttl_ms=600, description="first")
    first.acquire()
    time.sleep(1.0)  # longer than the TTL: only the heartbeat (every 200 ms) keeps it
    assert r.get(key) == first.value and 0 < r.pttl(key) <= 600
    second = Lease(connect(redis_server.url), key, ttl_ms=600, description="second")
    t0 = time.monotonic()
    with pytest.raises(LeaseHeld, match=r"held by host .* pid \d+ \(first\).*another learner is running"):
        second.acquire(wait_s=0.5, poll_s=0.05)
    assert time.monotonic() - t0 >= 0.45  # it waited for a possible expiry first
    first.check()
    first.fenced(lambda pipe: pipe.set("q-lease:fenced", b"1"))
    assert r.get("q-lease:fenced") == b"1"
    # Another holder took the key (e.g. our heartbeat stalled past the TTL): fenced writes refuse.
    r.set(key, b'{"host": "elsewhere", "pid": 1}', px=5000)
    with pytest.raises(LeaseLost, match="elsewhere"):
        first.fenced(lambda pipe: pipe.set("q-lease:fenced", b"2"))
    assert r.get("q-lease:fenced") == b"1"  # nothing executed
    with pytest.raises(LeaseLost):
        first.check()
    first.release()  # not ours any more: left alone
    assert r.get(key) == b'{"host": "elsewhere", "pid": 1}'
    # A lease left by a process of this host that no longer exists (SIGKILLed) is taken over at once.
    stale = dict(second.info, pid=_dead_pid(), token="dead")
    r.set(key, json.dumps(stale).encode(), px=60_000)
    second.acquire(wait_s=0)
    assert r.get(key) == second.value
    second.release()
    assert r.get(key) is None


def test_backpressure_waits_until_the_consumer_drains(redis_server):
    q = queue(redis_server.url, "q4", "c")
    for i in range(3):
        q.add(b"x")
    released = threading.Event()

    def producer():
        wait_for_room(q.r, q.stream, max_backlog=3, poll_s=0.01)
        released.set()

    t = threading.Thread(target=producer)
    t.start()
    time.sleep(0.3)
    assert not released.is_set()  # full: the producer waits
    entries = q.read_new(1, block_ms=100)
    q.ack([entries[0].entry_id])
    t.join(5)
    assert released.is_set()
    assert not wait_for_room(q.r, q.stream, max_backlog=1, should_stop=lambda: True)


def test_blocking_read_waits_for_new_entries_and_wakes_on_xadd(redis_server):
    """XREADGROUP COUNT n BLOCK ms: waits when nothing is new (no busy loop), returns as soon as
    another connection adds an entry; a read of the consumer's history never blocks."""
    q = queue(redis_server.url, "q5", "c")
    t0 = time.monotonic()
    assert q.read_new(4, block_ms=300) == []
    assert time.monotonic() - t0 >= 0.25
    got: dict = {}

    def reader():
        t = time.monotonic()
        got["entries"], got["s"] = q.read_new(4, block_ms=5000), time.monotonic() - t

    th = threading.Thread(target=reader)
    th.start()
    time.sleep(0.3)
    connect(redis_server.url).xadd(q.stream, {b"data": b"late"})
    th.join(10)
    assert [e.data for e in got["entries"]] == [b"late"]
    assert 0.25 <= got["s"] < 2.0
    t0 = time.monotonic()
    assert [e.data for e in q.read_pending(10)] == [b"late"]
    assert time.monotonic() - t0 < 1.0  # no BLOCK on a history read (a blocking read would wait its 5 s)


def test_two_consumers_share_a_stream_without_duplicates(redis_server):
    """Concurrent consumers on separate connections: every entry delivered to exactly one."""
    producer = queue(redis_server.url, "q6", "p")
    seen: dict[str, list[bytes]] = {"a": [], "b": []}
    stop = threading.Event()

    def consume(name):
        q = queue(redis_server.url, "q6", name)
        while not stop.is_set():
            entries = q.read_new(7, block_ms=50)
            seen[name].extend(e.data for e in entries)
            q.ack(e.entry_id for e in entries)

    threads = [threading.Thread(target=consume, args=(n,)) for n in seen]
    for t in threads:
        t.start()
    sent = [f"m{i}".encode() for i in range(300)]
    for m in sent:
        producer.add(m)
    deadline = time.monotonic() + 20
    while len(seen["a"]) + len(seen["b"]) < len(sent) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(5)
    assert sorted(seen["a"] + seen["b"]) == sorted(sent)  # each exactly once
    assert producer.length() == 0 and producer.pending_count() == 0


def test_transaction_publishes_tasks_and_counter_together(redis_server):
    """The learner's MULTI/EXEC: XADDs and the tasks counter are applied together."""
    r = connect(redis_server.url)
    keys = Keys("q7")
    pipe = r.pipeline(transaction=True)
    for i in range(3):
        pipe.xadd(keys.tasks, {b"data": f"t{i}".encode()})
    pipe.set(keys.tasks_next, 3)
    pipe.execute()
    assert r.xlen(keys.tasks) == 3 and int(r.get(keys.tasks_next)) == 3
    r.set(keys.done, b"1")
    assert r.exists(keys.done) == 1 and r.delete(keys.done) == 1 and r.exists(keys.done) == 0


def test_connection_errors_are_retried(redis_server):
    client = connect(redis_server.url)
    assert client.ping()
    client.connection_pool.disconnect()  # dropped connections are re-established transparently
    assert client.ping()
