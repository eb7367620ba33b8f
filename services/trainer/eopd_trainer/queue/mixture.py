"""A mixture rollout's other teachers (`route.mixture`, issue 32): `TeacherPart`, one more
teacher's statistics of the rollout's response tokens, and its protobuf form (`ScoredRollout.mixture`).
Decoding checks each part like the main teacher's fields (messages.py wraps the ValueError in
PoisonMessage, naming the rollout)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_LOGPROB = -1e6  # as messages.MIN_LOGPROB


@dataclass(frozen=True, eq=False)
class TeacherPart:
    """Teacher `teacher`'s statistics of n response tokens, k = its top-k."""

    teacher: str
    logprobs: np.ndarray  # [n] float32
    entropies: np.ndarray  # [n] float32
    topk_ids: np.ndarray  # [n, k] int32 (student ids: remapped back)
    topk_logprobs: np.ndarray  # [n, k] float32

    @property
    def top_k(self) -> int:
        return int(self.topk_ids.shape[1]) if self.topk_ids.ndim == 2 else 0


def part_of(teacher: str, scores, student_ids) -> TeacherPart:
    """A SequenceScores as a part; `student_ids` maps the teacher's top-k ids back (its remap)."""
    return TeacherPart(teacher, np.asarray(scores.token_logprobs, dtype=np.float32),
                       np.asarray(scores.entropies, dtype=np.float32),
                       student_ids(np.asarray(scores.topk_ids, dtype=np.int32)),
                       np.asarray(scores.topk_logprobs, dtype=np.float32))


def encode_parts(msg, parts) -> None:
    """Appends `parts` to a ScoredRollout message's `mixture`."""
    for part in parts:
        m = msg.mixture.add()
        m.teacher, m.top_k = part.teacher, part.top_k
        m.logprobs.extend(np.asarray(part.logprobs, dtype=np.float32).tolist())
        m.entropies.extend(np.asarray(part.entropies, dtype=np.float32).tolist())
        m.topk_ids.extend(np.asarray(part.topk_ids, dtype=np.int32).reshape(-1).tolist())
        m.topk_logprobs.extend(np.asarray(part.topk_logprobs, dtype=np.float32).reshape(-1).tolist())


def decode_parts(msg, n: int, vocab_size: int | None, allowed_top_k) -> tuple[TeacherPart, ...]:
    """The parts of a ScoredRollout message; ValueError naming the part and field when a part's
    sizes, ids, log-probs or entropies are inconsistent, a top-k is not one of `allowed_top_k`
    (None: any), or two parts name the same teacher."""
    out, seen = [], {msg.teacher}
    for i, m in enumerate(msg.mixture):
        where = f"mixture[{i}] ({m.teacher!r})"
        if not m.teacher or m.teacher in seen:
            raise ValueError(f"{where}: a teacher's name, not empty and not given twice")
        seen.add(m.teacher)
        k = m.top_k
        if k < 1 or (allowed_top_k is not None and k not in allowed_top_k):
            raise ValueError(f"{where}: top_k {k} is not one of the teachers' {sorted(allowed_top_k or [])}")
        for name, want in (("logprobs", n), ("entropies", n), ("topk_ids", n * k), ("topk_logprobs", n * k)):
            if len(getattr(m, name)) != want:
                raise ValueError(f"{where}: {name} has {len(getattr(m, name))} values, expected {want}")
        lp, ent = np.asarray(m.logprobs, np.float32), np.asarray(m.entropies, np.float32)
        ids = np.asarray(m.topk_ids, np.int32).reshape(n, k)
        tklp = np.asarray(m.topk_logprobs, np.float32).reshape(n, k)
        if not (np.all(np.isfinite(lp)) and np.all(np.isfinite(ent))):
            raise ValueError(f"{where}: logprobs or entropies have non-finite values")
        if np.any(lp > 1e-4) or np.any(lp < MIN_LOGPROB):
            raise ValueError(f"{where}: logprobs outside [{MIN_LOGPROB:g}, 0]")
        max_entropy = np.log(vocab_size) + 1e-3 if vocab_size else np.inf
        if np.any(ent < -1e-4) or np.any(ent > max_entropy):
            raise ValueError(f"{where}: entropies outside [0, ln(vocab_size)]")
        if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
            raise ValueError(f"{where}: topk_ids outside the vocabulary [0, {vocab_size})")
        if np.any(np.isnan(tklp)) or np.any(tklp > 1e-4) or np.any(np.isfinite(tklp) & (tklp < MIN_LOGPROB)):
            raise ValueError(f"{where}: topk_logprobs outside [{MIN_LOGPROB:g}, 0] (or -inf)")
        out.append(TeacherPart(m.teacher, lp, ent, ids, tklp))
    return tuple(out)
