"""The teacher's answers to the Score requests (`ScoreAnswers`): each answer is matched to its
request's rollouts (`requests.RequestShaper.take`), checked (`requests.answer_problems`), and its
rollouts published and settled in the task book; a request the teacher refused for good, or an
unusable answer, dead-letters its rollouts' tasks with the reason."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from eopd_teacher.client import RequestFailed

from .metrics import WorkerMetrics
from .mixture_join import MixtureJoin
from .publisher import Publisher
from .requests import Pending, RequestShaper, TeacherSource, answer_problems
from .task_book import TaskBook

log = logging.getLogger("eopd.rollout")


class ScoreAnswers:
    """Consumes the score stream's (request id, answer) pairs: scored rollouts out."""

    def __init__(self, shaper: RequestShaper, source: TeacherSource, publisher: Publisher, book: TaskBook,
                 metrics: WorkerMetrics, join: MixtureJoin | None = None):
        self.shaper = shaper
        self.source = source  # the teacher answering: recorded in each rollout
        self.join = join  # route.mixture: answers go to the join, which publishes once every teacher answered
        self.publisher = publisher
        self.book = book
        self.metrics = metrics

    async def consume(self, answers: AsyncIterator) -> None:
        """Takes the teacher's answers, one per request, until the requests end."""
        async with contextlib.aclosing(answers):
            async for rid, answer in answers:
                await self.on_answer(rid, answer)

    async def on_answer(self, rid: str, answer) -> None:
        group = self.shaper.take(rid)
        if group is None:  # not a request of this run's (never happens: each is answered once)
            return
        if isinstance(answer, RequestFailed):
            await self._reject(rid, group, answer.code, answer.details)
        else:
            await self._handle(rid, group, answer)

    async def _handle(self, rid: str, group: list[Pending], scores) -> None:
        """The teacher scored request `rid`: its rollouts are published (an unusable answer's are
        not scored) and settled."""
        problems = answer_problems(group, scores)
        for i, p in enumerate(group):
            if problems[i] is not None:
                reason = f"teacher answer to request {rid} unusable: {problems[i]}"
                log.warning("rollout %s: %s", p.rollout_id, reason)
                self.metrics.unscored.labels("bad_answer").inc()
                await self.not_scored(p, reason)
                continue
            if self.join is not None:
                await self.join.offer(p, scores[i], self.source)
                continue
            rollout = self.publisher.to_rollout(p, scores[i], self.source)
            await self.publisher.publish_and_settle(rollout, self.book, p.entry_id)  # False: stopping
        log.debug("published %d rollouts (policy v%d)", self.publisher.published, group[0].policy_version)

    async def _reject(self, rid: str, group: list[Pending], code, details: str) -> None:
        """The teacher refused request `rid` for good (not retryable): its rollouts are not
        scored, their tasks dead-lettered with the teacher's code and message."""
        reason = f"teacher rejected request {rid} ({code.name}): {details}"
        log.warning("%s; %d rollouts not scored", reason, len(group))
        self.metrics.unscored.labels(code.name).inc(len(group))
        for p in group:
            await self.not_scored(p, reason)

    async def not_scored(self, p: Pending, reason: str) -> None:
        """`p` cannot be published: its task dead-lettered with the reason (a mixture's, once every
        teacher answered)."""
        if self.join is not None:
            await self.join.fail(p, self.source.name, reason)
        else:
            await self.book.settle(p.entry_id, p.rollout_id, reason)
