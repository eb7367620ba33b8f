"""A mixture's answers joined per rollout (`route.mixture`, issue 32): every teacher of the mixture
scores every response; each teacher's `ScoreAnswers` offers its scores of a rollout (or why it
could not), and once every teacher has answered the rollout is published with the mixture's first
teacher's statistics as its own and the others' as `Rollout.mixture` parts, or, when any teacher
could not score it, its task is settled once with that reason (dead-lettered)."""

from __future__ import annotations

from ..queue.mixture import part_of
from .publisher import Publisher
from .requests import Pending, TeacherSource
from .task_book import TaskBook


class MixtureJoin:
    def __init__(self, names: list[str], publisher: Publisher, book: TaskBook):
        self.names = names  # the mixture's teachers, its first the rollout's main teacher
        self.publisher = publisher
        self.book = book
        self._got: dict[str, dict[str, tuple | str]] = {}  # rollout id -> teacher -> (scores, source) or reason

    def __len__(self) -> int:
        """Rollouts waiting for some teacher's answer."""
        return len(self._got)

    async def offer(self, p: Pending, scores, source: TeacherSource) -> None:
        """Teacher `source.name` scored `p`."""
        await self._add(p, source.name, (scores, source))

    async def fail(self, p: Pending, name: str, reason: str) -> None:
        """Teacher `name` could not score `p` (`reason`)."""
        await self._add(p, name, reason)

    async def _add(self, p: Pending, name: str, value) -> None:
        got = self._got.setdefault(p.rollout_id, {})
        got[name] = value
        if len(got) < len(self.names):
            return
        del self._got[p.rollout_id]
        reasons = [f"{n}: {v}" for n, v in got.items() if isinstance(v, str)]
        if reasons:
            await self.book.settle(p.entry_id, p.rollout_id, "mixture: " + "; ".join(reasons))
            return
        first_scores, first_source = got[self.names[0]]
        parts = [part_of(n, got[n][0], got[n][1].remap.student_ids) for n in self.names[1:]]
        rollout = self.publisher.to_rollout(p, first_scores, first_source, mixture=tuple(parts))
        await self.publisher.publish_and_settle(rollout, self.book, p.entry_id)  # False: stopping
