"""Redis Streams with consumer groups: the tasks and rollouts queues, dead letters, backpressure.

Keys of a run (namespace `ns`, from the config's `queue.namespace`; their protocol is `RunQueue`'s,
`namespace.py`):

    <ns>:tasks        stream of PromptTask (group "rollout": the rollout workers)
    <ns>:rollouts     stream of ScoredRollout (group "learner")
    <ns>:dead         dead-letter stream: fields source, entry_id, consumer, reason, data
    <ns>:dropped      rollouts the learner acknowledged without training: fields source, entry_id,
                      rollout_id, reason (duplicate | stale | future), policy_version, staleness,
                      consumer, unix_ns
    <ns>:counts       hash of exact totals: duplicate, stale, future, dead_letter (learner side)
    <ns>:lease        the learner's lease (SET NX PX, renewed by a heartbeat): one learner per ns
    <ns>:policy       the latest PolicyVersion announcement (a string key)
    <ns>:tasks:next   how many tasks the learner has published (a counter, set atomically with them)
    <ns>:done         set by the learner when training is finished (workers exit)

Every entry has a field `data` with the serialized protobuf and, when the run has a message key
(`queue.auth_key_file`), a field `mac` authenticating it (`signing.py`): a queue with a signer hands
its consumers only authentic entries and dead-letters the others (reason `unauthenticated`, counted
apart in `<ns>:counts`) before anything decodes them. An entry is XACKed *and* XDELed
when its effect is durable (a task: its rollouts are in the rollouts stream; a rollout: the
learner checkpoint that trained on it is committed), so XLEN is the backlog and the producers'
wait on `max_backlog` bounds the stream. Dead letters are added and the original acked in one
MULTI/EXEC transaction; so are drops (`StreamQueue.drop`: the record in `<ns>:dropped`, the
count in `<ns>:counts`, XACK, XDEL), so an entry that leaves the stream untrained is always
accounted for, whatever crashes afterwards. The detail streams are trimmed (approximately) to
`queue.dead_letter_maxlen`; the counts are exact.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import ResponseError
from redis.retry import Retry

from .signing import MAC_FIELD, UNAUTHENTICATED, Signer

log = logging.getLogger(__name__)

GROUP_ROLLOUT = "rollout"
GROUP_LEARNER = "learner"


@dataclass(frozen=True)
class Keys:
    ns: str

    @property
    def tasks(self) -> str:
        return f"{self.ns}:tasks"

    @property
    def rollouts(self) -> str:
        return f"{self.ns}:rollouts"

    @property
    def dead(self) -> str:
        return f"{self.ns}:dead"

    @property
    def policy(self) -> str:
        return f"{self.ns}:policy"

    @property
    def tasks_next(self) -> str:
        return f"{self.ns}:tasks:next"

    @property
    def done(self) -> str:
        return f"{self.ns}:done"

    @property
    def dropped(self) -> str:
        return f"{self.ns}:dropped"

    @property
    def counts(self) -> str:
        return f"{self.ns}:counts"

    @property
    def lease(self) -> str:
        return f"{self.ns}:lease"


class _RetryUnlessRefused(Retry):
    """redis-py's Retry, except that a refused password (NOAUTH, WRONGPASS: AuthenticationError, a
    subclass of ConnectionError) is raised at once: no backoff makes a wrong password right, and
    retrying it would hang the process for minutes instead of failing with the reason."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            if isinstance(error, redis.exceptions.AuthenticationError):
                return False
            return is_retryable is None or is_retryable(error)

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def connect(url: str) -> redis.Redis:
    """A Redis client that retries connection errors with backoff (survives a Redis restart), but
    not a refused password (`_RetryUnlessRefused`).

    The password may come from the URL or from REDIS_PASSWORD; `rediss://` selects TLS."""
    kwargs = {}
    if os.environ.get("REDIS_PASSWORD"):
        kwargs["password"] = os.environ["REDIS_PASSWORD"]
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        retry=_RetryUnlessRefused(ExponentialBackoff(cap=2.0, base=0.05), retries=20),
        retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        health_check_interval=30,
        socket_connect_timeout=5,
        **kwargs,
    )


@dataclass(frozen=True)
class Entry:
    entry_id: str
    data: bytes | None  # None: the entry had no `data` field
    mac: bytes | None = None  # the `mac` field (signing.py), None when absent


def _entries(raw: Iterable) -> list[Entry]:
    out = []
    for entry_id, fields in raw:
        if fields is None:  # deleted while pending
            continue
        eid = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
        out.append(Entry(eid, fields.get(b"data"), fields.get(MAC_FIELD)))
    return out


class StreamQueue:
    """One stream read through one consumer group by one named consumer."""

    def __init__(self, client: redis.Redis, stream: str, group: str, consumer: str, dead_stream: str,
                 dead_maxlen: int = 10_000, *, dropped_stream: str | None = None, counts_key: str | None = None,
                 signer: Signer | None = None):
        self.r = client
        self.stream = stream
        self.group = group
        self.consumer = consumer
        self.dead_stream = dead_stream
        self.dead_maxlen = dead_maxlen
        self.dropped_stream = dropped_stream  # `drop` records here (the learner's rollouts queue)
        self.counts_key = counts_key  # when set, dead letters and drops are counted in this hash
        self.signer = signer or Signer(None)  # signs what `add` writes, checks what the reads return

    def ensure_group(self) -> None:
        """Creates the stream and the group (reading from the beginning) if they do not exist."""
        try:
            self.r.xgroup_create(self.stream, self.group, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def fields(self, data: bytes) -> dict[bytes, bytes]:
        """The fields of an entry of this stream carrying `data` (signed when the queue has a key)."""
        return self.signer.fields(self.stream, data)

    def add(self, data: bytes) -> str:
        return self.r.xadd(self.stream, self.fields(data)).decode()

    def authentic(self, entries: list[Entry]) -> list[Entry]:
        """The entries whose MAC is valid; the others are dead-lettered (reason `unauthenticated`,
        counted as such, never as `dead_letter`) before anything decodes them."""
        out = []
        for e in entries:
            if self.signer.valid(self.stream, e.data, e.mac):
                out.append(e)
            else:
                self.dead_letter(e, UNAUTHENTICATED, count_as=UNAUTHENTICATED)
        return out

    def read_pending(self, count: int) -> list[Entry]:
        """Entries delivered to this consumer and not yet acknowledged (after a restart)."""
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: "0"}, count=count)
        return self.authentic(_entries(resp[0][1])) if resp else []

    def read_new(self, count: int, block_ms: int | None) -> list[Entry]:
        resp = self.r.xreadgroup(self.group, self.consumer, {self.stream: ">"}, count=count, block=block_ms)
        return self.authentic(_entries(resp[0][1])) if resp else []

    def claim_idle(self, min_idle_ms: int, count: int = 100) -> list[Entry]:
        """XAUTOCLAIM: takes over entries pending on any consumer for at least `min_idle_ms`."""
        out: list[Entry] = []
        start = "0-0"
        while len(out) < count:
            resp = self.r.xautoclaim(self.stream, self.group, self.consumer, min_idle_ms, start_id=start,
                                     count=count - len(out))
            nxt, claimed = resp[0], resp[1]
            out.extend(self.authentic(_entries(claimed)))
            nxt = nxt.decode() if isinstance(nxt, bytes) else str(nxt)
            if nxt == "0-0":
                break
            start = nxt
        return out

    def touch(self, entry_ids: Iterable[str]) -> int:
        """Heartbeat: resets the idle time of the given entries that are still pending on this
        consumer (XCLAIM to itself with JUSTID, which does not count as a delivery), so another
        consumer's `claim_idle` does not take work this one is still doing. Entries another consumer
        has already taken are left alone. Returns how many were touched."""
        wanted = set(entry_ids)
        if not wanted:
            return 0
        rows = self.r.xpending_range(self.stream, self.group, min="-", max="+", count=max(1000, 4 * len(wanted)),
                                     consumername=self.consumer)
        mine = [i for i in (r["message_id"] for r in rows) if (i.decode() if isinstance(i, bytes) else str(i)) in wanted]
        if mine:
            self.r.xclaim(self.stream, self.group, self.consumer, min_idle_time=0, message_ids=mine, justid=True)
        return len(mine)

    def deliveries(self, entry_id: str) -> int:
        """How many times an entry has been delivered (0 if it is not pending)."""
        rows = self.r.xpending_range(self.stream, self.group, min=entry_id, max=entry_id, count=1)
        return int(rows[0]["times_delivered"]) if rows else 0

    def delivery_counts(self, count: int) -> dict[str, int]:
        """entry id -> times delivered, for up to `count` entries pending in the group (any consumer)."""
        rows = self.r.xpending_range(self.stream, self.group, min="-", max="+", count=count)
        return {(r["message_id"].decode() if isinstance(r["message_id"], bytes) else str(r["message_id"])):
                int(r["times_delivered"]) for r in rows}

    def contains(self, entry_id: str) -> bool:
        """Whether the entry is still in the stream (not acknowledged and deleted meanwhile)."""
        return bool(self.r.xrange(self.stream, entry_id, entry_id))

    def ack(self, entry_ids: Iterable[str]) -> None:
        """Acknowledges and deletes entries (one transaction)."""
        ids = list(entry_ids)
        if not ids:
            return
        pipe = self.r.pipeline(transaction=True)
        self.queue_ack(pipe, ids)
        pipe.execute()

    def queue_ack(self, pipe, entry_ids: Iterable[str]) -> None:
        """Queues the XACK + XDEL of `entry_ids` on a transaction pipeline (e.g. `Lease.fenced`)."""
        ids = list(entry_ids)
        for i in range(0, len(ids), 1000):
            chunk = ids[i : i + 1000]
            pipe.xack(self.stream, self.group, *chunk)
            pipe.xdel(self.stream, *chunk)

    def dead_letter(self, entry: Entry, reason: str, *, count_as: str = "dead_letter") -> None:
        """Moves an entry to the dead-letter stream with the reason (add + ack + delete atomically);
        counted under `count_as` in `counts_key` when the queue has one."""
        log.warning("dead letter %s %s: %s", self.stream, entry.entry_id, reason)
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(
            self.dead_stream,
            {
                b"source": self.stream.encode(),
                b"entry_id": entry.entry_id.encode(),
                b"consumer": self.consumer.encode(),
                b"reason": reason.encode(),
                b"data": entry.data if entry.data is not None else b"",
                b"unix_ns": str(time.time_ns()).encode(),
            },
            maxlen=self.dead_maxlen,
            approximate=True,
        )
        if self.counts_key is not None:
            pipe.hincrby(self.counts_key, count_as, 1)
        pipe.xack(self.stream, self.group, entry.entry_id)
        pipe.xdel(self.stream, entry.entry_id)
        pipe.execute()

    def drop(self, entry: Entry, reason: str, *, rollout_id: str, policy_version: int, staleness: int) -> None:
        """Acknowledges and deletes an entry that is not trained (a duplicate, a stale or a future
        rollout) and records it, in one MULTI/EXEC: a row in the dropped stream and +1 on the
        reason's count. A crash right after leaves the entry gone *and* counted."""
        if self.dropped_stream is None or self.counts_key is None:
            raise RuntimeError("StreamQueue.drop needs dropped_stream and counts_key")
        pipe = self.r.pipeline(transaction=True)
        pipe.xadd(
            self.dropped_stream,
            {
                b"source": self.stream.encode(),
                b"entry_id": entry.entry_id.encode(),
                b"rollout_id": rollout_id.encode(),
                b"reason": reason.encode(),
                b"policy_version": str(policy_version).encode(),
                b"staleness": str(staleness).encode(),
                b"consumer": self.consumer.encode(),
                b"unix_ns": str(time.time_ns()).encode(),
            },
            maxlen=self.dead_maxlen,
            approximate=True,
        )
        pipe.hincrby(self.counts_key, reason, 1)
        pipe.xack(self.stream, self.group, entry.entry_id)
        pipe.xdel(self.stream, entry.entry_id)
        pipe.execute()

    def length(self) -> int:
        return int(self.r.xlen(self.stream))

    def pending_count(self) -> int:
        info = self.r.xpending(self.stream, self.group)
        return int(info["pending"]) if info else 0

    def undelivered(self) -> int:
        """Entries no consumer of the group has read yet: XLEN minus the group's pending entries
        (one MULTI/EXEC, a consistent snapshot). Exact because every acknowledgement here also
        deletes the entry (`ack`, `dead_letter`): the stream holds exactly the unread entries and
        the pending ones. Not XLEN alone: a learner with `checkpoint.every > 1` holds the entries of
        iterations trained since its last commit (pending, acknowledged only at the next commit).
        Not the group's `lag` (XINFO GROUPS): Redis 7+ only, and nil when entries past the group's
        last-delivered id have been deleted."""
        pipe = self.r.pipeline(transaction=True)
        pipe.xlen(self.stream)
        pipe.xpending(self.stream, self.group)
        length, info = pipe.execute()
        pending = int(info["pending"]) if info else 0
        return max(0, int(length) - pending)


def wait_for_room(client: redis.Redis, stream: str, max_backlog: int, *, poll_s: float = 0.05,
                  should_stop: Callable[[], bool] = lambda: False, on_wait: Callable[[int], None] | None = None) -> bool:
    """Backpressure: blocks while the stream holds >= max_backlog entries. False if told to stop."""
    delay = poll_s
    while True:
        n = int(client.xlen(stream))
        if n < max_backlog:
            return True
        if on_wait is not None:
            on_wait(n)
        if should_stop():
            return False
        time.sleep(delay)
        delay = min(delay * 2, 1.0)


def read_counts(client: redis.Redis, counts_key: str) -> dict[str, int]:
    """The exact totals of `<ns>:counts` (reason -> count; absent reasons are 0)."""
    return {k.decode(): int(v) for k, v in client.hgetall(counts_key).items()}


def read_dropped(client: redis.Redis, dropped_stream: str) -> list[dict[str, str]]:
    """Every recorded drop still in the (trimmed) dropped stream, oldest first."""
    return [{"id": eid.decode(), **{k.decode(): v.decode(errors="replace") for k, v in fields.items()}}
            for eid, fields in client.xrange(dropped_stream)]


def read_dead_letters(client: redis.Redis, dead_stream: str) -> list[dict[str, str | bytes]]:
    """Every dead letter, oldest first (for tests and operators)."""
    out = []
    for eid, fields in client.xrange(dead_stream):
        row: dict[str, str | bytes] = {"id": eid.decode()}
        for k, v in fields.items():
            key = k.decode()
            row[key] = v if key == "data" else v.decode(errors="replace")
        out.append(row)
    return out

