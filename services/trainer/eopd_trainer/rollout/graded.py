"""Graded student samples published (variant grpo): each sample's reward from the task grader
(`grader.TaskGrader`), published without a teacher call and settled in the task book."""

from __future__ import annotations

from .grader import TaskGrader
from .publisher import Publisher
from .requests import Pending
from .task_book import TaskBook


async def publish_graded(pending: list[Pending], grader: TaskGrader, publisher: Publisher, book: TaskBook) -> None:
    """grpo: each student sample graded by the task grader and published without a teacher call;
    stops at the first one refused (the worker is stopping: its task stays pending)."""
    for p in pending:
        reward = grader.reward(p.task.prompt_index, p.response_ids)
        if not await publisher.publish_and_settle(publisher.to_graded_rollout(p, reward), book, p.entry_id):
            return  # stopping
