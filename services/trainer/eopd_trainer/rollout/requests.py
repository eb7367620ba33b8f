"""What the worker sends to the teacher and gets back: sampled responses waiting for scores
(`Pending`), their grouping into requests (`request_groups`), the token ids sent (`teacher_tokens`,
`remap_ids`), the checks of an answer (`answer_problems`), and the request source of the stream
(`QueueSource`)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from ..queue.messages import PromptTask, rollout_id


def answer_problems(group, scores) -> list[str | None]:
    """For each rollout of a request, why the teacher's answer cannot be used (None: it can): the
    answer must hold one SequenceScores per sequence sent, in order, with the rollout's id and one
    row per response token in every array."""
    out: list[str | None] = []
    for i, p in enumerate(group):
        if i >= len(scores):
            out.append(f"the answer holds {len(scores)} sequences for the {len(group)} sent")
            continue
        s, n = scores[i], len(p.response_ids)
        if s.seq_id != p.rollout_id:
            out.append(f"the answer's sequence {i} has id {s.seq_id!r}, expected {p.rollout_id!r}")
            continue
        rows = {name: int(np.shape(getattr(s, name))[0]) for name in
                ("token_logprobs", "entropies", "topk_ids", "topk_logprobs")}
        wrong = {k: v for k, v in rows.items() if v != n}
        out.append(f"the teacher returned {wrong} positions for {n} response tokens" if wrong else None)
    return out


def request_groups(lengths: list[int], max_sequences: int, max_tokens: int | None) -> list[range]:
    """Consecutive groups of sequences (by index), one ScoreStream request each: at most
    `max_sequences` sequences and, when `max_tokens` is set (the teacher's max_tokens_per_request),
    at most `max_tokens` tokens in all. A sequence longer than `max_tokens` on its own goes alone
    (the teacher rejects it, and only its task is dead-lettered)."""
    groups, start, tokens = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and (i - start >= max_sequences or (max_tokens and tokens + n > max_tokens)):
            groups.append(range(start, i))
            start, tokens = i, 0
        tokens += n
    if lengths:
        groups.append(range(start, len(lengths)))
    return groups


def remap_ids(ids: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    if not mapping:
        return ids
    out = ids.copy()
    for src, dst in mapping.items():
        out[ids == src] = dst
    return out


def teacher_tokens(prompt_ids, response_ids, token_remap: dict[int, int]) -> np.ndarray:
    """The token ids sent to the teacher: the prompt as rendered, the response with
    `teacher.token_remap` applied (the remap translates what the student generates, e.g. its
    end-of-text id to the teacher's end-of-turn id; the prompt's own special tokens are left alone)."""
    return np.concatenate([np.asarray(prompt_ids, dtype=np.int64),
                           remap_ids(np.asarray(response_ids, dtype=np.int64), token_remap)])


@dataclass
class Pending:
    """A sampled response waiting for the teacher's scores."""

    entry_id: str
    task: PromptTask
    sample_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    truncated: bool
    old_logprobs: np.ndarray
    policy_version: int
    sampled_unix_ns: int

    @property
    def rollout_id(self) -> str:
        return rollout_id(self.task.task_seq, self.sample_index)


class QueueSource:
    """The request source of `score_stream`: an async iterator over a queue (None ends it).

    Not an async generator on purpose: the client cancels its writer while it awaits the next
    request when a stream breaks; cancelling `Queue.get()` loses nothing, whereas a cancelled
    async generator is closed and would end the stream early."""

    def __init__(self, queue: asyncio.Queue, sent: dict | None = None, resend: list | None = None, done: bool = False):
        self.queue = queue
        self.done = done
        self.sent = sent if sent is not None else {}  # request_id -> (batch, monotonic time handed out)
        self.resend = list(resend or [])  # requests of an abandoned stream, handed out first

    def __aiter__(self) -> QueueSource:
        return self

    async def __anext__(self):
        if self.resend:
            item = self.resend.pop(0)
        else:
            if self.done:
                raise StopAsyncIteration
            item = await self.queue.get()
            if item is None:
                self.done = True
                raise StopAsyncIteration
        self.sent[item.request_id] = (item, time.monotonic())
        return item
