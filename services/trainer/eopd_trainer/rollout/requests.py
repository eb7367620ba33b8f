"""What the worker sends to the teacher and gets back: sampled responses waiting for scores
(`Pending`), their grouping into requests (`request_groups`), the token ids sent (`teacher_tokens`,
`TokenRemap`: teacher.token_remap both ways), the checks of an answer (`answer_problems`), the requests made of them and the way back
from an answer to its rollouts (`RequestShaper`), and the request source of the stream (`BatchQueue`)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
from eopd_teacher.client import ScoreBatch, SequenceInput

from ..config import TeacherConfig
from ..queue.messages import PromptTask, rollout_id
from ..teacher_context import TeacherPrompts


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
        sent = getattr(p, "old_topk_ids", None)
        if sent is not None:  # candidates were sent: [n, m] log-probs must come back
            clp = getattr(s, "candidate_logprobs", None)
            got = None if clp is None else tuple(np.shape(clp))
            if got != sent.shape:
                wrong["candidate_logprobs"] = got
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


@dataclass(frozen=True, eq=False)
class TokenRemap:
    """`teacher.token_remap` both ways (the config checks it is invertible): `to_teacher` maps what
    the student generates to the teacher's ids (responses and candidates sent to Score, the
    student's stop ids sent to Generate); `to_student` maps the teacher's ids back (its top-k ids,
    the tokens it generates) into a rollout."""

    to_teacher: Mapping[int, int] = field(default_factory=dict)
    to_student: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def of(cls, token_remap: Mapping[int, int]) -> TokenRemap:
        return cls(dict(token_remap), {v: k for k, v in token_remap.items()})

    def teacher_ids(self, ids: np.ndarray) -> np.ndarray:
        return remap_ids(ids, self.to_teacher)

    def student_ids(self, ids: np.ndarray) -> np.ndarray:
        return remap_ids(ids, self.to_student)

    def teacher_id(self, token_id: int) -> int:
        return int(self.to_teacher.get(token_id, token_id))


@dataclass(frozen=True)
class TeacherSource:
    """The teacher a rollout's statistics come from: the run's name for it (`teacher` or one of
    `teachers:`), its model name@revision (ModelInfo) and its token remap."""

    name: str
    model: str
    remap: TokenRemap


def teacher_tokens(prompt_ids, response_ids, remap: TokenRemap) -> np.ndarray:
    """The token ids sent to the teacher: the prompt as rendered, the response with
    `teacher.token_remap` applied (the remap translates what the student generates, e.g. its
    end-of-text id to the teacher's end-of-turn id; the prompt's own special tokens are left alone)."""
    return np.concatenate([np.asarray(prompt_ids, dtype=np.int64),
                           remap.teacher_ids(np.asarray(response_ids, dtype=np.int64))])


def teacher_candidates(topk_ids: np.ndarray | None, remap: TokenRemap) -> np.ndarray | None:
    """The per-position candidate ids sent to the teacher: the student's top-k ids with
    `teacher.token_remap` applied, like the response (None: no candidates)."""
    return None if topk_ids is None else remap.teacher_ids(np.asarray(topk_ids, dtype=np.int64))


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
    # [n, m] the policy's top-m ids at each response token (old-log-prob pass), sent to the teacher as
    # per-position candidates when the loss variant needs them (eopd_topk_rkl); None otherwise.
    old_topk_ids: np.ndarray | None = None

    @property
    def rollout_id(self) -> str:
        return rollout_id(self.task.task_seq, self.sample_index)


class RequestShaper:
    """Turns sampled responses into teacher requests (`shape`) and maps each answer back to its
    rollouts (`take`). It keeps no copy of a request for re-sending (the client re-sends). The
    teacher sees each response after `teacher_prompts`' prefix (the student's prompt, or the
    privileged one of teacher.prompt_template)."""

    def __init__(self, worker_id: str, teacher: TeacherConfig, max_tokens_per_request: int | None,
                 teacher_prompts: TeacherPrompts, max_context_length: int = 0):
        self.worker_id = worker_id
        self.teacher = teacher
        self.remap = TokenRemap.of(teacher.token_remap)
        self.max_tokens_per_request = max_tokens_per_request
        self.teacher_prompts = teacher_prompts
        self.max_context_length = max_context_length  # the teacher's (0: not known, not checked)
        # ScoreBatch.hidden_states: the teacher's final hidden states asked for too ("": none).
        self.hidden_states = "" if teacher.hidden_states == "none" else teacher.hidden_states
        self._seq = 0
        self.contexts: dict[str, list[Pending]] = {}  # request id -> the rollouts it scores

    def prefix(self, p: Pending) -> list[int]:
        return self.teacher_prompts.ids(p.task.prompt_index, p.prompt_ids)

    def too_long(self, p: Pending, prefix: list[int]) -> str | None:
        """Why the teacher cannot score `p` after `prefix` (None: it can)."""
        n = len(prefix) + len(p.response_ids)
        if not self.max_context_length or n <= self.max_context_length:
            return None
        what = "teacher.prompt_template's prompt" if self.teacher_prompts.privileged else "the prompt"
        return (f"prompt {p.task.prompt_index}: {what} ({len(prefix)} tokens) + the response ({len(p.response_ids)}) "
                f"= {n} tokens exceeds the teacher's max_context_length ({self.max_context_length})")

    def shape(self, pending: list[Pending]) -> tuple[list[ScoreBatch], list[tuple[Pending, str]]]:
        """The requests for `pending` (`request_groups`), their contexts recorded; and the
        rollouts that cannot be sent, with the reason (a prefix + response over the teacher's context)."""
        t = self.teacher
        kept, refused = [], []
        for p in pending:
            pre = self.prefix(p)
            why = self.too_long(p, pre)
            if why is None:
                kept.append((p, pre))
            else:
                refused.append((p, why))
        lengths = [len(pre) + len(p.response_ids) for p, pre in kept]
        out = []
        for rows in request_groups(lengths, t.sequences_per_request, self.max_tokens_per_request):
            group = kept[rows.start : rows.stop]
            self._seq += 1
            rid = f"{self.worker_id}-{self._seq}"
            self.contexts[rid] = [p for p, _ in group]
            seqs = [SequenceInput(p.rollout_id, teacher_tokens(pre, p.response_ids, self.remap), len(pre),
                                  teacher_candidates(p.old_topk_ids, self.remap)) for p, pre in group]
            out.append(ScoreBatch(rid, seqs, top_k=t.top_k, temperature=t.temperature, hidden_states=self.hidden_states))
        return out, refused

    def take(self, request_id: str) -> list[Pending] | None:
        """The rollouts of an answered request (None: not a request of this shaper's)."""
        return self.contexts.pop(request_id, None)

    def __len__(self) -> int:
        """Requests not answered yet."""
        return len(self.contexts)


class BatchQueue:
    """The one request source the teacher client reads: a bounded queue of ScoreBatch, iterated
    asynchronously until `close()`."""

    def __init__(self, maxsize: int):
        self._queue: asyncio.Queue[ScoreBatch | None] = asyncio.Queue(maxsize=maxsize)
        self._closed = False

    async def put(self, batch: ScoreBatch) -> None:
        await self._queue.put(batch)

    async def close(self) -> None:
        """Ends the iteration after the batches already put."""
        await self._queue.put(None)

    def __aiter__(self) -> BatchQueue:
        return self

    async def __anext__(self) -> ScoreBatch:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is None:
            self._closed = True
            raise StopAsyncIteration
        return item
