"""One run's queue namespace (`RunQueue`): the one owner of the small protocol on the keys of `<ns>`
(listed in `streams.py`). The learner, the rollout workers and `eopd run --resume` get a RunQueue,
never a Redis client:

- the two streams, each read by one consumer of its group (`tasks`, `rollouts`: `StreamQueue`),
  and the backpressure wait on the rollouts stream;
- the task counter `<ns>:tasks:next`, only ever moved together with the tasks it counts
  (`publish_tasks`: XADDs + SET in one MULTI/EXEC; a rebuild of a lost queue also restores the
  exact counts there, `learner/rebuild.py`);
- the exact totals `<ns>:counts`, the done flag `<ns>:done`, the learner's lease `<ns>:lease`
  and the policy announcement `<ns>:policy` (`announce.py`).

Entries and the announcement are signed with the run's message key when it has one (`signing.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import redis

from .announce import announce, current_announcement
from .lease import Lease
from .messages import PolicyVersion, PromptTask, encode_task
from .signing import Signer
from .streams import GROUP_LEARNER, GROUP_ROLLOUT, Keys, StreamQueue, connect, read_counts, wait_for_room

DEFAULT_DEAD_MAXLEN = 10_000


class RunQueue:
    """The queue namespace `ns` of one run on a Redis `client`."""

    def __init__(self, client: redis.Redis, ns: str, *, signer: Signer | None = None,
                 dead_maxlen: int = DEFAULT_DEAD_MAXLEN):
        self.client = client  # the queue's own; tests and operators may read the keys directly
        self.keys = Keys(ns)
        self.signer = signer or Signer(None)
        self.dead_maxlen = dead_maxlen

    @classmethod
    def connect(cls, url: str, ns: str, *, signer: Signer | None = None,
                dead_maxlen: int = DEFAULT_DEAD_MAXLEN) -> RunQueue:
        """The namespace on the Redis at `url` (`streams.connect`: retried, password from the URL or
        REDIS_PASSWORD)."""
        return cls(connect(url), ns, signer=signer, dead_maxlen=dead_maxlen)

    @property
    def ns(self) -> str:
        return self.keys.ns

    # Streams ---------------------------------------------------------------------------------
    def tasks(self, consumer: str) -> StreamQueue:
        """`<ns>:tasks` read by `consumer` of the group "rollout"."""
        k = self.keys
        return StreamQueue(self.client, k.tasks, GROUP_ROLLOUT, consumer, k.dead, self.dead_maxlen, signer=self.signer)

    def rollouts(self, consumer: str, *, record_drops: bool = False) -> StreamQueue:
        """`<ns>:rollouts` read by `consumer` of the group "learner"; `record_drops` (the learner):
        drops recorded in `<ns>:dropped` and dead letters and drops counted in `<ns>:counts`."""
        k = self.keys
        extra = {"dropped_stream": k.dropped, "counts_key": k.counts} if record_drops else {}
        return StreamQueue(self.client, k.rollouts, GROUP_LEARNER, consumer, k.dead, self.dead_maxlen,
                           signer=self.signer, **extra)

    def wait_for_room(self, max_backlog: int, *, should_stop: Callable[[], bool] = lambda: False,
                      on_wait: Callable[[int], None] | None = None) -> bool:
        """Backpressure: blocks while the rollouts stream holds >= max_backlog entries; False if
        told to stop."""
        return wait_for_room(self.client, self.keys.rollouts, max_backlog, should_stop=should_stop, on_wait=on_wait)

    def stream_lengths(self) -> tuple[int, int]:
        """(entries in the tasks stream, entries in the rollouts stream)."""
        return int(self.client.xlen(self.keys.tasks)), int(self.client.xlen(self.keys.rollouts))

    def learner_pending(self) -> int:
        """Rollouts read by the learner and not yet acknowledged (0 when it has no group yet)."""
        try:
            return int(self.client.xpending(self.keys.rollouts, GROUP_LEARNER)["pending"])
        except Exception:  # noqa: BLE001 - no group yet
            return 0

    # The task counter ------------------------------------------------------------------------
    def task_counter(self) -> int | None:
        """`<ns>:tasks:next`, how many tasks have been published; None when the key is absent (a
        new namespace, or a queue that lost it)."""
        raw = self.client.get(self.keys.tasks_next)
        return int(raw) if raw is not None else None

    def publish_tasks(self, tasks: Sequence[PromptTask], *, counter: int,
                      counts: dict[str, int] | None = None) -> None:
        """Adds `tasks` to the tasks stream and sets the task counter to `counter`, in one
        MULTI/EXEC (a restarted learner never publishes a task twice); `counts` (a rebuild) also
        sets those totals of `<ns>:counts` in the same transaction."""
        pipe = self.client.pipeline(transaction=True)
        for task in tasks:
            pipe.xadd(self.keys.tasks, self.signer.fields(self.keys.tasks, encode_task(task)))
        pipe.set(self.keys.tasks_next, counter)
        if counts is not None:
            pipe.hset(self.keys.counts, mapping=counts)
        pipe.execute()

    # Exact totals ----------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """The exact totals of `<ns>:counts` (reason -> count; absent reasons are 0)."""
        return read_counts(self.client, self.keys.counts)

    def has_counts(self) -> bool:
        return bool(self.client.exists(self.keys.counts))

    # The done flag and the lease -------------------------------------------------------------
    def mark_done(self) -> None:
        """Training is finished: the workers and `eopd run` exit."""
        self.client.set(self.keys.done, b"1")

    def clear_done(self) -> None:
        self.client.delete(self.keys.done)

    def is_done(self) -> bool:
        return bool(self.client.exists(self.keys.done))

    def lease(self, *, ttl_ms: int, description: str = "") -> Lease:
        """The learner's lease on this namespace (not yet acquired)."""
        return Lease(self.client, self.keys.lease, ttl_ms=ttl_ms, description=description)

    def forget_learner(self) -> None:
        """Clears the done flag and the lease together (`eopd run --resume`, whose run-directory
        lock proves that the learner that held them has exited)."""
        self.client.delete(self.keys.done, self.keys.lease)

    # The policy announcement -----------------------------------------------------------------
    def announce(self, pv: PolicyVersion) -> None:
        announce(self.client, self.keys.policy, pv, self.signer)

    def announcement(self) -> PolicyVersion | None:
        """The announced PolicyVersion; None when none is, or it is not authentic (`announce.py`)."""
        return current_announcement(self.client, self.keys.policy, self.signer)
