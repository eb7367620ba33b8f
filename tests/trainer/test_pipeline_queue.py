"""The Redis Streams queue against a real redis-server on a private port."""

from __future__ import annotations

import threading
import time

import pytest
from eopd_trainer.queue import (
    Keys,
    StreamQueue,
    connect,
    read_dead_letters,
    wait_for_room,
)

from tests.trainer.redis_helpers import running_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_server():
    with running_redis() as proc:
        yield proc


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


def test_dead_letter_keeps_reason_and_payload(redis_server):
    q = queue(redis_server.url, "q3", "c")
    q.add(b"\xffpoison")
    [entry] = q.read_new(1, block_ms=100)
    q.dead_letter(entry, "undecodable ScoredRollout: truncated")
    [row] = read_dead_letters(q.r, Keys("q3").dead)
    assert row["reason"] == "undecodable ScoredRollout: truncated" and row["data"] == b"\xffpoison"
    assert row["entry_id"] == entry.entry_id and row["source"] == Keys("q3").rollouts
    assert q.length() == 0 and q.pending_count() == 0


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


def test_connection_errors_are_retried(redis_server):
    client = connect(redis_server.url)
    assert client.ping()
    client.connection_pool.disconnect()  # dropped connections are re-established transparently
    assert client.ping()
