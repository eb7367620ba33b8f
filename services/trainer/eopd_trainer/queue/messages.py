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

# Bytes a ScoredRollout may take per value of its arrays (a varint int32 takes at most 5, a float
# 4; 8 is generous) and on top of them (ids, names, timestamps): a larger entry is refused before
# it is parsed (`RolloutLimits.max_bytes`).
_BYTES_PER_VALUE = 8
_BYTES_OVERHEAD = 64 * 1024


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

    def __post_init__(self) -> None:
        """The one place the candidate fields are kept together: both None, or both `[n, m]`
        (`num_candidates` is m, read off `candidate_ids`)."""
        ids, lps = self.candidate_ids, self.candidate_logprobs
        if (ids is None) != (lps is None):
            raise ValueError(f"rollout {self.rollout_id}: candidate_ids and candidate_logprobs must be given together "
                             f"(candidate_ids {'None' if ids is None else 'set'}, candidate_logprobs {'None' if lps is None else 'set'})")
        if ids is not None:
            n = int(self.response_ids.shape[0])
            if ids.ndim != 2 or ids.shape[0] != n or lps.shape != ids.shape:
                raise ValueError(f"rollout {self.rollout_id}: candidate_ids {tuple(ids.shape)} and candidate_logprobs "
                                 f"{tuple(lps.shape)} must both be [n, m] with n = {n} response tokens")

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
class RolloutLimits:
    """Upper bounds on a ScoredRollout's fields, derived from the run's config (`from_config`):
    checked by `decode_rollout` on the parsed message before any array is built, so a forged entry
    cannot make the learner allocate or pad beyond what an honest rollout of this run needs."""

    max_prompt_length: int  # data.max_prompt_length
    max_response_length: int  # rollout.max_response_length
    # teacher.top_k, exactly (what the workers ask the teacher for): a smaller k is a differently
    # configured or truncating teacher and changes the forward-KL term; a larger one would make
    # the packing pad every rollout to it.
    top_k: int

    @classmethod
    def from_config(cls, cfg) -> RolloutLimits:
        return cls(cfg.data.max_prompt_length, cfg.rollout.max_response_length, cfg.teacher.top_k)

    @property
    def max_bytes(self) -> int:
        """The largest serialised entry an honest rollout within these limits can be."""
        values = self.max_prompt_length + self.max_response_length * (4 + 2 * self.top_k)
        return _BYTES_OVERHEAD + _BYTES_PER_VALUE * values

    def check(self, rid: str, *, prompt: int, response: int, top_k: int) -> None:
        """PoisonMessage naming the field that exceeds its bound."""
        if prompt > self.max_prompt_length:
            raise PoisonMessage(f"oversized ScoredRollout {rid}: prompt_ids has {prompt} tokens, more than "
                                f"data.max_prompt_length {self.max_prompt_length}")
        if response > self.max_response_length:
            raise PoisonMessage(f"oversized ScoredRollout {rid}: response_ids has {response} tokens, more than "
                                f"rollout.max_response_length {self.max_response_length}")
        if top_k != self.top_k:
            raise PoisonMessage(f"inconsistent ScoredRollout {rid}: top_k {top_k} differs from teacher.top_k {self.top_k}")


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


def decode_task(data: bytes, *, max_num_samples: int | None = None, max_policy_version: int | None = None) -> PromptTask:
    """Parses and validates a PromptTask; PoisonMessage(reason) when unusable. `max_num_samples`
    (rollout.n_samples) and `max_policy_version` (the run's last iteration: a policy version past
    it is never announced, so a worker would wait for it until the run ends) bound what a forged
    task can make a worker do."""
    msg = _parse(pb.PromptTask, data, "PromptTask")
    if msg.num_samples < 1:
        raise PoisonMessage(f"PromptTask {msg.task_id!r}: num_samples must be >= 1")
    if max_num_samples is not None and msg.num_samples > max_num_samples:
        raise PoisonMessage(f"PromptTask {msg.task_id!r}: num_samples {msg.num_samples} is more than rollout.n_samples "
                            f"{max_num_samples}")
    if max_policy_version is not None and msg.min_policy_version > max_policy_version:
        raise PoisonMessage(f"PromptTask {msg.task_id!r}: min_policy_version {msg.min_policy_version} is beyond the "
                            f"run's last policy version {max_policy_version}")
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


def _check_logprobs_or_inf(rid: str, name: str, values: np.ndarray) -> None:
    """PoisonMessage unless every value is a log-prob in [MIN_LOGPROB, 0] (1e-4 of slack) or -inf."""
    if np.any(values > 1e-4) or np.any(np.isfinite(values) & (values < MIN_LOGPROB)):
        raise PoisonMessage(f"inconsistent ScoredRollout {rid}: {name} outside [{MIN_LOGPROB:g}, 0] (or -inf)")


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
    _check_logprobs_or_inf(rid, "candidate_logprobs", real)
    return ids, lp


def decode_rollout(data: bytes, *, vocab_size: int | None = None, limits: RolloutLimits | None = None) -> Rollout:
    """Parses and validates a ScoredRollout; raises PoisonMessage(reason) when unusable. With
    `limits` (the learner's admission), an entry larger than any honest rollout is refused before
    it is parsed and the lengths and top-k are bounded before any array is built."""
    if limits is not None and len(data) > limits.max_bytes:
        raise PoisonMessage(f"oversized ScoredRollout: {len(data)} bytes, more than the {limits.max_bytes} a rollout "
                            "within data.max_prompt_length, rollout.max_response_length and teacher.top_k can take")
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
    if limits is not None:  # on the parsed lengths, before any array is built
        limits.check(rid, prompt=p, response=n, top_k=k)
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
    _check_logprobs_or_inf(rid, "teacher_topk_logprobs", tklp)
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


def check_rollout_metadata(r: Rollout, *, temperature: float, num_candidates: int = 0, n_samples: int | None = None,
                           published_tasks: int | None = None) -> None:
    """What the learner requires of a decoded rollout beyond its own consistency and the bounds
    `RolloutLimits` checks while decoding (prompt and response lengths, top-k = teacher.top_k);
    raises PoisonMessage with the reason (the rollout is dead-lettered, not trained):

    - sampled at `temperature` (loss.temperature: the old log-probs and the ratio must be taken
      at the same temperature; a float32 field, so compared to a relative 1e-6);
    - `rollout_id` equal to `t{seq}-s{sample_index}` with `task_id` `t{seq}` (the exactly-once
      accounting is by these ids), of a published task (`seq < published_tasks`, the learner's
      `<ns>:tasks:next`) and a sample the task asked for (`sample_index < n_samples`);
    - at least `num_candidates` per-position candidates (loss.candidate_k when the loss variant
      needs them, e.g. eopd_topk_rkl; 0 otherwise)."""
    rid = r.rollout_id
    if not math.isclose(r.sampling_temperature, temperature, rel_tol=1e-6, abs_tol=1e-9):
        raise PoisonMessage(f"rollout {rid}: sampling_temperature {r.sampling_temperature:g} differs from loss.temperature "
                            f"{temperature:g}")
    m = _TASK_ID.fullmatch(r.task_id)
    if m is None:
        raise PoisonMessage(f"rollout {rid}: task_id {r.task_id!r} is not of the form t<seq>")
    expected = rollout_id(int(m.group(1)), r.sample_index)
    if rid != expected:
        raise PoisonMessage(f"rollout {rid}: rollout_id does not match task_id {r.task_id!r} and sample_index "
                            f"{r.sample_index} (expected {expected!r})")
    if published_tasks is not None and int(m.group(1)) >= published_tasks:
        raise PoisonMessage(f"rollout {rid}: task {r.task_id} was never published (the learner published "
                            f"{published_tasks} tasks)")
    if n_samples is not None and r.sample_index >= n_samples:
        raise PoisonMessage(f"rollout {rid}: sample_index {r.sample_index} is not below rollout.n_samples {n_samples}")
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
