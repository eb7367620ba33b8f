"""Rebuilding a lost queue namespace from the learner's committed checkpoint.

A queue can lose what it held while the learner's checkpoint survives: the embedded queue of an
`eopd run` that was killed (it lives in that process), a Redis restarted without persistence, a
flushed database, or an append-only file that lost its last writes. The learner's checkpoint says
how many tasks had been published at the commit (`tasks_published`, the task counter `<ns>:tasks:next`
then), which rollout ids are trained (the ledger) and which it dropped without training
(`settled`: stale or future). That is enough to put back what the learner needs:

- the task counter, so new tasks continue the numbering and never reuse an id;
- every task numbered below it whose rollouts are neither all trained nor settled (in sync mode at
  a commit there is usually none: the next iteration's tasks are published after the commit; in
  async mode the tasks published ahead), published again with the *same* ids and prompts, asking
  for the committed policy version;
- the exact counts of `<ns>:counts` as the checkpoint's snapshot (what was counted after the
  commit went with the queue).

Rollouts of the lost queue that were scored but not trained are sampled again by the republished
tasks; ids already trained are dropped as duplicates as always, so every rollout id still
contributes to exactly one committed iteration. A rollout dead-lettered before the crash is not in
`settled` (the learner may not know its id): its task is sampled again. Everything is written in one
MULTI/EXEC, by the learner that holds the namespace's lease, before it publishes or reads anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from ..queue.messages import PromptTask
from ..queue.namespace import RunQueue
from .state import LearnerState


def task_seq(rollout_id: str) -> int:
    """`t{seq}-s{j}` -> seq."""
    return int(rollout_id[1:].split("-", 1)[0])


def published_at_commit(state: LearnerState) -> int:
    """Tasks published when the checkpoint was committed (checkpoints from before the field was
    saved: one past the highest trained task)."""
    if state.feed.tasks_published is not None:
        return state.feed.tasks_published
    return max((task_seq(rid) + 1 for rid in state.ledger.trained), default=0)


def tasks_to_republish(*, trained: Iterable[str], settled: Iterable[str], start: int, published: int,
                       n_samples: int) -> list[int]:
    """Task numbers in [start, published) with a rollout neither trained nor settled."""
    done = set(trained) | set(settled)
    return [seq for seq in range(start, published) if any(f"t{seq}-s{j}" not in done for j in range(n_samples))]


def rebuild_if_lost(queue: RunQueue, state: LearnerState, *, n_samples: int, prompt_of,
                    teacher_of=None) -> str | None:
    """Puts back what the queue lost (see the module); None when it lost nothing. `prompt_of(seq)`
    is the prompt index of task `seq` (`data.prompt_index`); `teacher_of(seq)` its
    num_teacher_samples (default 0; config/stages.py, a deterministic draw: the same as before).
    The tasks are signed with the queue's key (`RunQueue.publish_tasks`)."""
    published = published_at_commit(state)
    in_queue = queue.task_counter()
    if published == 0 or (in_queue is not None and in_queue >= published):
        return None
    start = in_queue or 0
    seqs = tasks_to_republish(trained=state.ledger.trained, settled=state.feed.settled, start=start,
                              published=published, n_samples=n_samples)
    version = state.policy_version
    tasks = [PromptTask(seq, prompt_of(seq), n_samples, version,
                        num_teacher_samples=teacher_of(seq) if teacher_of is not None else 0) for seq in seqs]
    counts, restored = None, ""
    if in_queue is None and not queue.has_counts():
        c = state.feed.counters
        counts = {"stale": c.stale_dropped, "duplicate": c.duplicates, "dead_letter": c.dead_letters}
        restored = f"; counts restored from the checkpoint ({counts})"
    queue.publish_tasks(tasks, counter=published, counts=counts)
    shown = ", ".join(f"t{s}" for s in seqs[:8]) + (f", ... ({len(seqs)} in all)" if len(seqs) > 8 else "")
    lost = "had no task counter" if in_queue is None else f"had task counter {in_queue}"
    return (f"queue namespace {queue.ns} {lost} but the checkpoint of iteration {state.iteration} had published "
            f"{published} tasks: rebuilt from the checkpoint: republished {len(seqs)} tasks not yet trained with their "
            f"ids{' (' + shown + ')' if seqs else ''}, task counter set to {published}{restored}")
