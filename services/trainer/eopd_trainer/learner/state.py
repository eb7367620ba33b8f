"""The learner's durable state (`LearnerState`): what a checkpoint commits beside the weights and the
optimizer, written as `trainer_state.json` (the resume contract: `learner/checkpoint.py` writes and
reads it, `eopd run --resume` reads it, `learner/rebuild.py` rebuilds a lost queue from it).

Two writers, each with its own part: the loop (`learner/loop.py`) writes the iteration, the policy
version, the step counts, the ledger, the iteration's stream entry ids and metric records; the
feed (`learner/feed.py`, rank 0) writes `feed` (`FeedState`) and only that.

The JSON is flat, one key per field (as before the type existed), plus `schema_version`. A file
without `schema_version` (written before it) has the same keys and is read as version 1; keys it
lacks take their defaults (a checkpoint from before `tasks_published` was saved: None, see
`rebuild.published_at_commit`). A file of a newer schema is refused.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .ledger import Ledger

SCHEMA_VERSION = 1


class StateSchemaError(ValueError):
    """trainer_state.json was written by a newer learner (schema_version above SCHEMA_VERSION)."""


@dataclass
class FeedCounters:
    """A snapshot at each commit. stale_dropped, duplicates and dead_letters are read from the exact
    totals in the queue (`<ns>:counts`, counted in the same transaction as each ack), never lost by a
    crash; replacement_tasks is the feed's own count of the tasks it published to replace dropped or
    lost rollouts."""

    stale_dropped: int = 0
    duplicates: int = 0
    dead_letters: int = 0
    replacement_tasks: int = 0


@dataclass
class FeedState:
    """The part only the RolloutFeed writes; with the ledger it is what rebuilds a lost queue
    (`rebuild.py`): the task counter at the commit and the rollout ids dropped without training."""

    counters: FeedCounters = field(default_factory=FeedCounters)
    settled: list[str] = field(default_factory=list)  # dropped without training (stale, future)
    tasks_published: int | None = None  # the task counter at the commit (None: not saved by this checkpoint)


@dataclass
class LearnerState:
    iteration: int = 0  # the last trained iteration (committed, once loaded from a checkpoint)
    policy_version: int = 0
    optimizer_steps: int = 0
    global_steps: int | None = None  # DeepSpeed's own step count (None before the first iteration)
    ledger: Ledger = field(default_factory=Ledger)  # rollout ids trained, by iteration
    last_entry_ids: list[str] = field(default_factory=list)  # stream entries trained since the previous commit
    metrics: list[dict[str, Any]] = field(default_factory=list)  # the commit iteration's metric records
    feed: FeedState = field(default_factory=FeedState)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            "iteration": self.iteration, "policy_version": self.policy_version,
            "optimizer_steps": self.optimizer_steps, "ledger": self.ledger.to_json(),
            "last_entry_ids": list(self.last_entry_ids), "metrics": list(self.metrics),
            "counters": asdict(self.feed.counters), "settled": list(self.feed.settled),
            "tasks_published": self.feed.tasks_published,
        }
        if self.global_steps is not None:
            out["global_steps"] = self.global_steps
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LearnerState:
        version = int(data.get("schema_version", 1))
        if version > SCHEMA_VERSION:
            raise StateSchemaError(f"trainer_state.json has schema_version {version}; this learner reads up to "
                                   f"{SCHEMA_VERSION} (written by a newer eopd)")
        known = {f.name for f in fields(FeedCounters)}
        counters = FeedCounters(**{k: int(v) for k, v in (data.get("counters") or {}).items() if k in known})
        published = data.get("tasks_published")
        steps = data.get("global_steps")
        return cls(
            iteration=int(data.get("iteration", 0)), policy_version=int(data.get("policy_version", 0)),
            optimizer_steps=int(data.get("optimizer_steps", 0)),
            global_steps=int(steps) if steps is not None else None,
            ledger=Ledger.from_json(data.get("ledger") or {}),
            last_entry_ids=list(data.get("last_entry_ids") or []), metrics=list(data.get("metrics") or []),
            feed=FeedState(counters=counters, settled=list(data.get("settled") or []),
                           tasks_published=int(published) if published is not None else None),
        )
