"""The checks `decode_rollout` (messages.py) runs on a ScoredRollout's per-token fields: each raises
`PoisonMessage` naming the rollout and the field, which the queue files in the dead-letter stream."""

from __future__ import annotations

import numpy as np
from eopd.v1 import rollout_pb2 as pb
from eopd_common.hidden_wire import HIDDEN_DTYPES, hidden_bytes_per_token

from .mixture import MIN_LOGPROB


class PoisonMessage(ValueError):
    """A message that cannot be used: undecodable or inconsistent. `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def decode_hidden(msg: pb.ScoredRollout, rid: str, n: int) -> bytes | None:
    """The rollout's packed teacher hidden states (None without any); PoisonMessage when their
    dtype, size or head fingerprint is missing or inconsistent with the n response tokens."""
    data = msg.teacher_hidden_states
    if not data:
        if msg.teacher_hidden_dtype or msg.teacher_hidden_size or msg.teacher_head_fingerprint:
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher hidden-state fields set without teacher_hidden_states")
        return None
    if msg.teacher_hidden_dtype not in HIDDEN_DTYPES:
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher_hidden_dtype {msg.teacher_hidden_dtype!r} is not one "
                            f"of {list(HIDDEN_DTYPES)}")
    if not msg.teacher_head_fingerprint:
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher_hidden_states without teacher_head_fingerprint")
    want = n * hidden_bytes_per_token(msg.teacher_hidden_size, msg.teacher_hidden_dtype)
    if msg.teacher_hidden_size < 1 or len(data) != want:
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher_hidden_states has {len(data)} bytes, expected {want} "
                            f"({n} response tokens x teacher_hidden_size {msg.teacher_hidden_size} {msg.teacher_hidden_dtype})")
    return data


def check_logprobs_or_inf(rid: str, name: str, values: np.ndarray) -> None:
    """PoisonMessage unless every value is a log-prob in [MIN_LOGPROB, 0] (1e-4 of slack) or -inf."""
    if np.any(values > 1e-4) or np.any(np.isfinite(values) & (values < MIN_LOGPROB)):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} outside [{MIN_LOGPROB:g}, 0] (or -inf)")


def decode_candidates(msg: pb.ScoredRollout, rid: str, n: int, vocab_size: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The rollout's `[n, m]` candidate ids and teacher log-probs (None, None without any);
    PoisonMessage when their sizes, ids (in [-1, vocab)) or log-probs (NaN exactly at -1 filler,
    else in [MIN_LOGPROB, 0] or -inf) are inconsistent."""
    m = msg.num_candidates
    if m == 0:
        if len(msg.candidate_ids) or len(msg.candidate_logprobs):
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: candidates given with num_candidates 0")
        return None, None
    for name in ("candidate_ids", "candidate_logprobs"):
        got = len(getattr(msg, name))
        if got != n * m:
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} has {got} values, expected {n * m} "
                                f"({n} response tokens, num_candidates {m})")
    ids = np.asarray(msg.candidate_ids, dtype=np.int32).reshape(n, m)
    lp = np.asarray(msg.candidate_logprobs, dtype=np.float32).reshape(n, m)
    if ids.min() < -1 or (vocab_size is not None and ids.max() >= vocab_size):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: candidate_ids outside [-1, {vocab_size}) (-1 is filler)")
    filler = ids < 0
    if not np.array_equal(np.isnan(lp), filler):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: candidate_logprobs must be NaN exactly at -1 filler ids")
    real = lp[~filler]
    check_logprobs_or_inf(rid, "candidate_logprobs", real)
    return ids, lp


def check_lengths(msg: pb.ScoredRollout, rid: str, n: int, k: int, *, teacher_generated: bool, graded: bool) -> None:
    """PoisonMessage unless every per-token array has its length: old_logprobs [n] (or empty for a
    teacher-generated response), the teacher arrays [n] / [n * k] with k >= 1, or all empty with
    top_k 0 for a graded rollout (a reward, no teacher scores: variant grpo)."""
    teacher = ("teacher_logprobs", "teacher_entropies", "teacher_topk_ids", "teacher_topk_logprobs")
    if k == 0:
        given = [name for name in teacher if len(getattr(msg, name))]
        if given or not graded:
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: top_k must be >= 1 (top_k 0, no teacher scores, "
                                f"only for a graded rollout with a reward" + (f"; {given[0]} is set)" if given else ")"))
    rows = n if k else 0  # graded only: every teacher array empty
    want = {"teacher_logprobs": rows, "teacher_entropies": rows, "teacher_topk_ids": n * k, "teacher_topk_logprobs": n * k}
    if not (teacher_generated and len(msg.old_logprobs) == 0):
        want["old_logprobs"] = n
    for name, count in want.items():
        got = len(getattr(msg, name))
        if got != count:
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} has {got} values, expected {count} "
                                f"({n} response tokens, top_k {k})")
