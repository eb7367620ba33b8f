"""Exactly-once bookkeeping and staleness filtering, as pure functions over plain data.

The ledger is the set of rollout ids whose training effect is committed, each with the
iteration that trained it. It is saved inside every learner checkpoint (trainer_state.json), so
model weights, optimizer state and the ledger always describe the same instant. On restart the
learner re-reads the entries still pending in the consumer group: those in the ledger are
acknowledged without training (their effect is in the weights), the others are trained.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


class Admit(str, Enum):
    TRAIN = "train"  # use it in this iteration
    DUPLICATE = "duplicate"  # its id is already trained (committed) or already in this batch
    STALE = "stale"  # sampled by a policy older than the staleness bound
    FUTURE = "future"  # sampled by weights newer than the learner's: a future it rolled back from


@dataclass(frozen=True)
class Decision:
    kind: Admit
    staleness: int


def admit(rollout_id: str, policy_version: int, *, current_version: int, max_staleness: int,
          trained: Ledger, in_batch: set[str], off_policy: bool = False) -> Decision:
    """What to do with a rollout at an iteration that starts from weights `current_version`.

    staleness = current_version - policy_version (0 in the paper's synchronous Algorithm 1).
    An `off_policy` rollout (teacher-generated: no student weights made it) has staleness 0 and is
    never stale or future; duplicates are recognised as for any other (exactly-once by id).
    """
    staleness = 0 if off_policy else current_version - policy_version
    if rollout_id in trained or rollout_id in in_batch:
        return Decision(Admit.DUPLICATE, staleness)
    if staleness < 0:
        return Decision(Admit.FUTURE, staleness)
    if staleness > max_staleness:
        return Decision(Admit.STALE, staleness)
    return Decision(Admit.TRAIN, staleness)


@dataclass
class Ledger:
    """rollout id -> the iteration whose committed optimizer steps used it."""

    trained: dict[str, int] = field(default_factory=dict)

    def __contains__(self, rollout_id: object) -> bool:
        return rollout_id in self.trained

    def __len__(self) -> int:
        return len(self.trained)

    def record(self, iteration: int, rollout_ids: Iterable[str]) -> None:
        for rid in rollout_ids:
            if rid in self.trained:
                raise ValueError(f"rollout {rid} already trained in iteration {self.trained[rid]}")
            self.trained[rid] = iteration

    def by_iteration(self) -> dict[int, list[str]]:
        out: dict[int, list[str]] = {}
        for rid, it in self.trained.items():
            out.setdefault(it, []).append(rid)
        return {it: sorted(ids) for it, ids in sorted(out.items())}

    def to_json(self) -> dict:
        return {str(it): ids for it, ids in self.by_iteration().items()}

    @classmethod
    def from_json(cls, data: dict) -> Ledger:
        led = cls()
        for it, ids in data.items():
            led.record(int(it), ids)
        return led


def tasks_to_publish(*, iteration: int, batch_size: int, n_samples: int, max_staleness: int,
                     published_tasks: int, replacement_tasks: int) -> int:
    """How many new tasks the learner publishes before collecting `iteration` (1-based).

    It keeps enough tasks published to fill iterations up to `iteration + max_staleness` (async
    prefetch; exactly the current iteration in sync mode), on top of the `replacement_tasks`
    published so far to make up for rollouts that were dropped (stale) or lost.
    """
    per_iteration = batch_size // n_samples
    want = (iteration + max_staleness) * per_iteration + replacement_tasks
    return max(0, want - published_tasks)


def learner_starts_holding(times_delivered: int) -> int:
    """How many learner starts found a rollout entry pending (read and not committed), from its
    delivery count in the consumer group: the first read delivers it once, and every start takes
    the pending entries over (XAUTOCLAIM) and re-reads them (XREADGROUP of its history), two
    deliveries each. Past `rollout.max_rollout_deliveries` the rollout is dead-lettered: a rollout
    that crashes the learner while it trains would otherwise be read first after every restart."""
    return max(0, (times_delivered - 1) // 2)


def replacement_tasks_needed(*, missing_rollouts: int, n_samples: int, tasks_outstanding: int,
                             rollouts_waiting: int) -> int:
    """Tasks to add when an iteration is short of rollouts and nothing more can arrive: every
    published task is done (`tasks_outstanding` == 0) and no rollout is waiting to be read."""
    if missing_rollouts <= 0 or tasks_outstanding > 0 or rollouts_waiting > 0:
        return 0
    return -(-missing_rollouts // n_samples)


class RejectStreak:
    """Rollouts rejected in a row (dead-lettered, or dropped as stale or future: each costs a
    replacement task) with none admitted. Past `limit` the rejection is systematic (a worker
    with the wrong settings, a corrupting hop) and replacement tasks would be issued forever:
    `reject` returns True and the learner stops. Duplicates are neither (their id is trained)."""

    def __init__(self, limit: int, keep: int = 10):
        if limit < 1:
            raise ValueError("limit must be >= 1")
        self.limit = limit
        self.count = 0
        self.recent: collections.deque[str] = collections.deque(maxlen=keep)

    def admitted(self) -> None:
        self.count = 0

    def reject(self, reason: str) -> bool:
        self.count += 1
        self.recent.append(reason)
        return self.count >= self.limit

    def message(self) -> str:
        reasons = "\n".join(f"  - {r}" for r in self.recent)
        return (f"{self.count} rollouts in a row were rejected (dead-lettered or dropped) and none admitted "
                f"(queue.max_rejected_in_a_row = {self.limit}): systematic, not transient; stopping instead of "
                f"issuing replacement tasks forever. The last {len(self.recent)} reasons:\n{reasons}")
