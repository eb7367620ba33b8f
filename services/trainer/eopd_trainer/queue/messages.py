"""Plain data types of the pipeline and their protobuf codec (protobuf only at this edge).

`Rollout` is a scored rollout as numpy arrays; `encode_rollout` / `decode_rollout` convert to and
from the bytes of `eopd.v1.ScoredRollout`. `decode_rollout` validates shapes and values and raises
`PoisonMessage` with the reason, which the queue files in the dead-letter stream.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import numpy as np
from eopd.v1 import rollout_pb2 as pb
from google.protobuf.message import DecodeError

# Smallest log-prob a scored rollout may carry (finite values below are corrupt: they would turn
# the importance ratio and the loss into inf/NaN).
MIN_LOGPROB = -1e6


class PoisonMessage(ValueError):
    """A message that cannot be used: undecodable or inconsistent. `reason` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _parse(message_cls, data: bytes, what: str):
    """`message_cls` parsed from `data`, or PoisonMessage("undecodable <what>: <reason>")."""
    msg = message_cls()
    try:
        msg.ParseFromString(data)
    except (DecodeError, TypeError, RuntimeError) as exc:
        raise PoisonMessage(f"undecodable {what}: {exc}") from None
    return msg


def now_ns() -> int:
    return time.time_ns()


_TASK_ID = re.compile(r"t(0|[1-9][0-9]*)")


def rollout_id(task_seq: int, sample_index: int) -> str:
    return f"t{task_seq}-s{sample_index}"


def task_id(task_seq: int) -> str:
    return f"t{task_seq}"


@dataclass(frozen=True)
class PromptTask:
    task_seq: int
    prompt_index: int
    num_samples: int
    min_policy_version: int
    created_unix_ns: int = 0

    @property
    def task_id(self) -> str:
        return task_id(self.task_seq)


@dataclass(frozen=True)
class Rollout:
    """One scored rollout. n = len(response_ids), k = top_k."""

    rollout_id: str
    task_id: str
    prompt_index: int
    sample_index: int
    prompt_ids: np.ndarray  # [P] int32
    response_ids: np.ndarray  # [n] int32
    old_logprobs: np.ndarray  # [n] float32
    teacher_logprobs: np.ndarray  # [n] float32
    teacher_entropies: np.ndarray  # [n] float32
    teacher_topk_ids: np.ndarray  # [n, k] int32
    teacher_topk_logprobs: np.ndarray  # [n, k] float32
    policy_version: int
    truncated: bool = False
    sampling_temperature: float = 1.0
    top_p: float = 1.0
    worker_id: str = ""
    sampled_unix_ns: int = 0
    scored_unix_ns: int = 0
    published_unix_ns: int = 0
    teacher_model: str = ""
    extra: dict = field(default_factory=dict, compare=False)
    # Per-position candidates (eopd_topk_rkl): [n, m] int32 student ids (-1 filler) and [n, m]
    # float32 teacher log-probs there (NaN at filler); None when the rollout carries none.
    candidate_ids: np.ndarray | None = field(default=None, compare=False)
    candidate_logprobs: np.ndarray | None = field(default=None, compare=False)

    @property
    def num_candidates(self) -> int:
        return 0 if self.candidate_ids is None else int(self.candidate_ids.shape[1])

    @property
    def num_response_tokens(self) -> int:
        return int(self.response_ids.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.teacher_topk_ids.shape[1])


@dataclass(frozen=True)
class PolicyVersion:
    version: int
    uri: str
    sha256: str
    num_bytes: int
    iteration: int
    created_unix_ns: int = 0
    format: str = "safetensors"


# Tasks -------------------------------------------------------------------------------------

def encode_task(task: PromptTask) -> bytes:
    return pb.PromptTask(
        task_id=task.task_id,
        task_seq=task.task_seq,
        prompt_index=task.prompt_index,
        num_samples=task.num_samples,
        min_policy_version=task.min_policy_version,
        created_unix_ns=task.created_unix_ns or now_ns(),
    ).SerializeToString()


def decode_task(data: bytes) -> PromptTask:
    msg = _parse(pb.PromptTask, data, "PromptTask")
    if msg.num_samples < 1:
        raise PoisonMessage(f"PromptTask {msg.task_id!r}: num_samples must be >= 1")
    if msg.task_id != task_id(msg.task_seq):
        raise PoisonMessage(f"PromptTask {msg.task_id!r}: task_id does not match task_seq {msg.task_seq}")
    return PromptTask(msg.task_seq, msg.prompt_index, msg.num_samples, msg.min_policy_version, msg.created_unix_ns)


# Rollouts ----------------------------------------------------------------------------------

def encode_rollout(r: Rollout) -> bytes:
    msg = pb.ScoredRollout(
        rollout_id=r.rollout_id,
        task_id=r.task_id,
        prompt_index=r.prompt_index,
        sample_index=r.sample_index,
        top_k=r.top_k,
        policy_version=r.policy_version,
        truncated=r.truncated,
        sampling_temperature=r.sampling_temperature,
        top_p=r.top_p,
        worker_id=r.worker_id,
        sampled_unix_ns=r.sampled_unix_ns,
        scored_unix_ns=r.scored_unix_ns,
        published_unix_ns=r.published_unix_ns or now_ns(),
        teacher_model=r.teacher_model,
    )
    # extend() with numpy arrays converts element-wise; tolist() is the fast path.
    msg.prompt_ids.extend(np.asarray(r.prompt_ids, dtype=np.int32).tolist())
    msg.response_ids.extend(np.asarray(r.response_ids, dtype=np.int32).tolist())
    msg.old_logprobs.extend(np.asarray(r.old_logprobs, dtype=np.float32).tolist())
    msg.teacher_logprobs.extend(np.asarray(r.teacher_logprobs, dtype=np.float32).tolist())
    msg.teacher_entropies.extend(np.asarray(r.teacher_entropies, dtype=np.float32).tolist())
    msg.teacher_topk_ids.extend(np.asarray(r.teacher_topk_ids, dtype=np.int32).reshape(-1).tolist())
    msg.teacher_topk_logprobs.extend(np.asarray(r.teacher_topk_logprobs, dtype=np.float32).reshape(-1).tolist())
    _encode_candidates(msg, r)
    return msg.SerializeToString()


def _encode_candidates(msg: pb.ScoredRollout, r: Rollout) -> None:
    if r.candidate_ids is None:
        return
    msg.num_candidates = r.num_candidates
    msg.candidate_ids.extend(np.asarray(r.candidate_ids, dtype=np.int32).reshape(-1).tolist())
    msg.candidate_logprobs.extend(np.asarray(r.candidate_logprobs, dtype=np.float32).reshape(-1).tolist())


def _decode_candidates(msg: pb.ScoredRollout, rid: str, n: int, vocab_size: int | None) -> tuple[np.ndarray | None, np.ndarray | None]:
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
    if np.any(real > 1e-4) or np.any(np.isfinite(real) & (real < MIN_LOGPROB)):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: candidate_logprobs outside [{MIN_LOGPROB:g}, 0] (or -inf)")
    return ids, lp


def decode_rollout(data: bytes, *, vocab_size: int | None = None) -> Rollout:
    """Parses and validates a ScoredRollout; raises PoisonMessage(reason) when unusable."""
    msg = _parse(pb.ScoredRollout, data, f"ScoredRollout ({len(data)} bytes)")
    rid = msg.rollout_id or "?"
    if not msg.rollout_id:
        raise PoisonMessage("inconsistent ScoredRollout: empty rollout_id")
    n, k, p = len(msg.response_ids), msg.top_k, len(msg.prompt_ids)
    if p < 1:
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: empty prompt_ids")
    if n < 1:
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: empty response_ids")
    if k < 1:
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: top_k must be >= 1")
    for name, want in (("old_logprobs", n), ("teacher_logprobs", n), ("teacher_entropies", n),
                       ("teacher_topk_ids", n * k), ("teacher_topk_logprobs", n * k)):
        got = len(getattr(msg, name))
        if got != want:
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} has {got} values, expected {want} "
                                f"({n} response tokens, top_k {k})")
    prompt = np.asarray(msg.prompt_ids, dtype=np.int32)
    response = np.asarray(msg.response_ids, dtype=np.int32)
    topk_ids = np.asarray(msg.teacher_topk_ids, dtype=np.int32).reshape(n, k)
    old = np.asarray(msg.old_logprobs, dtype=np.float32)
    tlp = np.asarray(msg.teacher_logprobs, dtype=np.float32)
    ent = np.asarray(msg.teacher_entropies, dtype=np.float32)
    tklp = np.asarray(msg.teacher_topk_logprobs, dtype=np.float32).reshape(n, k)
    for name, ids in (("prompt_ids", prompt), ("response_ids", response), ("teacher_topk_ids", topk_ids)):
        if ids.size and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} outside the vocabulary [0, {vocab_size})")
    for name, arr in (("old_logprobs", old), ("teacher_logprobs", tlp), ("teacher_entropies", ent)):
        if not np.all(np.isfinite(arr)):
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} has non-finite values")
    for name, arr in (("old_logprobs", old), ("teacher_logprobs", tlp)):
        if np.any(arr > 1e-4) or np.any(arr < MIN_LOGPROB):
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} outside [{MIN_LOGPROB:g}, 0] (log-probs)")
    max_entropy = np.log(vocab_size) + 1e-3 if vocab_size else np.inf
    if np.any(ent < -1e-4) or np.any(ent > max_entropy):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher_entropies outside [0, ln(vocab_size)]")
    if np.any(np.isnan(tklp)):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher_topk_logprobs has NaN")
    # -inf marks an unused (dead) entry; +inf, a positive or an absurdly small finite value is corrupt.
    if np.any(tklp > 1e-4) or np.any(np.isfinite(tklp) & (tklp < MIN_LOGPROB)):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: teacher_topk_logprobs outside [{MIN_LOGPROB:g}, 0] (or -inf)")
    cand_ids, cand_lp = _decode_candidates(msg, rid, n, vocab_size)
    return Rollout(
        rollout_id=msg.rollout_id,
        task_id=msg.task_id,
        prompt_index=msg.prompt_index,
        sample_index=msg.sample_index,
        prompt_ids=prompt,
        response_ids=response,
        old_logprobs=old,
        teacher_logprobs=tlp,
        teacher_entropies=ent,
        teacher_topk_ids=topk_ids,
        teacher_topk_logprobs=tklp,
        policy_version=msg.policy_version,
        truncated=msg.truncated,
        sampling_temperature=msg.sampling_temperature,
        top_p=msg.top_p,
        worker_id=msg.worker_id,
        sampled_unix_ns=msg.sampled_unix_ns,
        scored_unix_ns=msg.scored_unix_ns,
        published_unix_ns=msg.published_unix_ns,
        teacher_model=msg.teacher_model,
        candidate_ids=cand_ids,
        candidate_logprobs=cand_lp,
    )


def check_rollout_metadata(r: Rollout, *, temperature: float, top_k: int, max_response_length: int,
                           num_candidates: int = 0) -> None:
    """What the learner requires of a decoded rollout beyond its own consistency; raises
    PoisonMessage with the reason (the rollout is dead-lettered, not trained):

    - sampled at `temperature` (loss.temperature: the old log-probs and the ratio must be taken
      at the same temperature; a float32 field, so compared to a relative 1e-6);
    - teacher top-k of at least `top_k` (teacher.top_k: a smaller k is a differently configured
      or truncating teacher, and changes the forward-KL term);
    - `rollout_id` equal to `t{seq}-s{sample_index}` with `task_id` `t{seq}` (the exactly-once
      accounting is by these ids);
    - at most `max_response_length` response tokens (rollout.max_response_length);
    - at least `num_candidates` per-position candidates (loss.candidate_k when the loss variant
      needs them, e.g. eopd_topk_rkl; 0 otherwise)."""
    rid = r.rollout_id
    if not math.isclose(r.sampling_temperature, temperature, rel_tol=1e-6, abs_tol=1e-9):
        raise PoisonMessage(f"rollout {rid}: sampling_temperature {r.sampling_temperature:g} differs from loss.temperature "
                            f"{temperature:g}")
    if r.top_k < top_k:
        raise PoisonMessage(f"rollout {rid}: teacher top_k {r.top_k} is smaller than teacher.top_k {top_k}")
    m = _TASK_ID.fullmatch(r.task_id)
    if m is None:
        raise PoisonMessage(f"rollout {rid}: task_id {r.task_id!r} is not of the form t<seq>")
    expected = rollout_id(int(m.group(1)), r.sample_index)
    if rid != expected:
        raise PoisonMessage(f"rollout {rid}: rollout_id does not match task_id {r.task_id!r} and sample_index "
                            f"{r.sample_index} (expected {expected!r})")
    if r.num_response_tokens > max_response_length:
        raise PoisonMessage(f"rollout {rid}: {r.num_response_tokens} response tokens, more than "
                            f"rollout.max_response_length {max_response_length}")
    if r.num_candidates < num_candidates:
        raise PoisonMessage(f"rollout {rid}: {r.num_candidates} per-position candidates, the loss variant needs "
                            f"loss.candidate_k {num_candidates}")


# Policy versions ---------------------------------------------------------------------------

def encode_policy(v: PolicyVersion) -> bytes:
    return pb.PolicyVersion(
        version=v.version, uri=v.uri, sha256=v.sha256, num_bytes=v.num_bytes, format=v.format,
        iteration=v.iteration, created_unix_ns=v.created_unix_ns or now_ns(),
    ).SerializeToString()


def decode_policy(data: bytes) -> PolicyVersion:
    msg = _parse(pb.PolicyVersion, data, "PolicyVersion")
    return PolicyVersion(msg.version, msg.uri, msg.sha256, msg.num_bytes, msg.iteration, msg.created_unix_ns, msg.format or "safetensors")
