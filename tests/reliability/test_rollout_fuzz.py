"""Property-based fuzzing of the learner's ScoredRollout decoder/validator (`decode_rollout`, what
the learner runs on every entry of the rollouts stream): random and truncated bytes, and
well-formed protobufs whose contents disagree (array lengths, top-k shape, NaN/inf, huge values,
ids outside the vocabulary, empty ids). Every case either decodes into a consistent `Rollout` or
raises `PoisonMessage` whose reason names the problem; nothing else escapes.

That a poison entry in a real Redis stream lands in the dead-letter stream with its reason (and
the run goes on) is proven by
tests/trainer/test_pipeline_e2e.py::test_end_to_end_run_brings_student_closer[sync] (an
undecodable and an inconsistent ScoredRollout queued in the live stream before the learner starts)
and, without a learner process, by test_poison_entry_dead_lettered_in_real_redis below."""

from __future__ import annotations

import math

import numpy as np
import pytest
from eopd.v1 import rollout_pb2 as pb
from eopd_trainer.queue.messages import PoisonMessage, Rollout, decode_rollout, encode_rollout
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.integration

VOCAB = 49152
ARRAYS_N = ("old_logprobs", "teacher_logprobs", "teacher_entropies")
ARRAYS_NK = ("teacher_topk_ids", "teacher_topk_logprobs")


def valid_message(n: int, k: int, p: int, seed: int) -> pb.ScoredRollout:
    rng = np.random.default_rng(seed)
    r = Rollout(
        rollout_id=f"t{seed}-s0", task_id=f"t{seed}", prompt_index=seed, sample_index=0,
        prompt_ids=rng.integers(0, VOCAB, p).astype(np.int32),
        response_ids=rng.integers(0, VOCAB, n).astype(np.int32),
        old_logprobs=-rng.random(n).astype(np.float32) * 5,
        teacher_logprobs=-rng.random(n).astype(np.float32) * 5,
        teacher_entropies=rng.random(n).astype(np.float32) * 3,
        teacher_topk_ids=rng.integers(0, VOCAB, (n, k)).astype(np.int32),
        teacher_topk_logprobs=-rng.random((n, k)).astype(np.float32) * 5,
        policy_version=1,
    )
    msg = pb.ScoredRollout()
    msg.ParseFromString(encode_rollout(r))
    return msg


# One mutation per case: (kind, field, value). The expected word in the reason is the field name.
FLOAT_BAD = st.sampled_from([math.nan, math.inf, -math.inf, 1e30, -1e38, -2e6, 3.0, 20.0])
INT_BAD = st.sampled_from([-1, VOCAB, 2**31 - 1, -(2**31)])
mutation = st.one_of(
    st.tuples(st.just("length"), st.sampled_from(ARRAYS_N + ARRAYS_NK + ("response_ids",)), st.integers(-3, 3)),
    st.tuples(st.just("top_k"), st.just("top_k"), st.one_of(st.integers(0, 70), st.just(2**32 - 1))),
    st.tuples(st.just("float"), st.sampled_from(ARRAYS_N + ("teacher_topk_logprobs",)), FLOAT_BAD),
    st.tuples(st.just("int"), st.sampled_from(("prompt_ids", "response_ids", "teacher_topk_ids")), INT_BAD),
    st.tuples(st.just("empty"), st.sampled_from(("rollout_id", "prompt_ids", "response_ids")), st.none()),
    st.tuples(st.just("none"), st.none(), st.none()),
)


def check_consistent(r: Rollout) -> None:
    n = r.num_response_tokens
    assert n >= 1 and r.prompt_ids.size >= 1 and r.rollout_id
    for name in ARRAYS_N:
        a = getattr(r, name)
        assert a.shape == (n,) and np.all(np.isfinite(a)), name
    assert r.teacher_topk_ids.shape == r.teacher_topk_logprobs.shape == (n, r.top_k)
    for ids in (r.prompt_ids, r.response_ids, r.teacher_topk_ids):
        assert ids.min() >= 0 and ids.max() < VOCAB
    assert not np.any(np.isnan(r.teacher_topk_logprobs)) and np.all(r.teacher_topk_logprobs <= 1e-4)
    assert np.all(r.old_logprobs <= 1e-4) and np.all(r.teacher_logprobs <= 1e-4) and np.all(r.teacher_entropies >= -1e-4)


def decode_checked(data: bytes) -> Rollout | None:
    """Decodes; returns the Rollout or None after a PoisonMessage (any other exception fails)."""
    try:
        r = decode_rollout(data, vocab_size=VOCAB)
    except PoisonMessage as exc:
        assert exc.reason and str(exc) == exc.reason
        assert "ScoredRollout" in exc.reason
        return None
    check_consistent(r)
    return r


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(n=st.integers(1, 6), k=st.integers(1, 5), p=st.integers(1, 4), seed=st.integers(0, 10_000), mut=mutation,
       pos=st.integers(0, 1000))
def test_inconsistent_rollouts_are_poison_with_reason(n, k, p, seed, mut, pos):
    msg = valid_message(n, k, p, seed)
    kind, field, value = mut
    if kind == "length":
        arr = getattr(msg, field)
        if value >= 0:
            arr.extend([0] * value)
        else:
            del arr[: min(-value, len(arr))]
    elif kind == "top_k":
        msg.top_k = value
    elif kind in ("float", "int"):
        arr = getattr(msg, field)
        arr[pos % len(arr)] = value
    elif kind == "empty":
        msg.ClearField(field)
    r = decode_checked(msg.SerializeToString())
    changed = not (kind == "none" or (kind == "length" and value == 0) or (kind == "top_k" and value == k)
                   or (kind == "float" and value == -math.inf and field == "teacher_topk_logprobs")
                   or (kind == "float" and value == 3.0 and field == "teacher_entropies"))  # valid values
    if not changed:
        assert r is not None, mut  # the unmodified / still-valid message decodes
        return
    assert r is None, f"accepted a corrupt rollout: {mut}"
    with pytest.raises(PoisonMessage) as info:
        decode_rollout(msg.SerializeToString(), vocab_size=VOCAB)
    reason = info.value.reason
    if kind == "length" and field == "response_ids":
        assert any(a in reason for a in (*ARRAYS_N, *ARRAYS_NK, "response_ids")), reason
    elif kind == "top_k":
        assert "top_k" in reason, reason
    else:
        assert field in reason, (mut, reason)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.one_of(
    st.binary(max_size=300),
    st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(0, 99), st.integers(0, 10_000), st.binary(max_size=8))
    .map(lambda t: _corrupt(valid_message(t[0], t[1], 2, t[3]).SerializeToString(), t[2], t[4])),
))
def test_random_and_corrupted_bytes_never_crash(data):
    decode_checked(data)


def _corrupt(raw: bytes, at: int, junk: bytes) -> bytes:
    """Truncates at a random point or splices junk bytes in."""
    cut = at * len(raw) // 100
    return raw[:cut] if not junk else raw[:cut] + junk + raw[cut + len(junk):]


def test_poison_entry_dead_lettered_in_real_redis():
    """The learner's path for one entry: decode -> PoisonMessage -> StreamQueue.dead_letter, in a real
    redis-server: the entry leaves the stream and the pending list, the dead letter keeps reason and bytes."""
    from eopd_trainer.queue.streams import GROUP_LEARNER, Keys, StreamQueue, connect, read_dead_letters

    from tests.trainer.redis_helpers import running_redis

    with running_redis() as server:
        keys = Keys("fuzz")
        q = StreamQueue(connect(server.url), keys.rollouts, GROUP_LEARNER, "learner-0", keys.dead)
        q.ensure_group()
        bad = valid_message(3, 2, 2, 7)
        bad.teacher_entropies[1] = math.nan
        payloads = [b"\xff\x00garbage", bad.SerializeToString(), valid_message(3, 2, 2, 8).SerializeToString()]
        for data in payloads:
            q.add(data)
        good = []
        for e in q.read_new(10, block_ms=100):
            try:
                good.append(decode_rollout(e.data, vocab_size=VOCAB))
            except PoisonMessage as exc:
                q.dead_letter(e, exc.reason)
        assert [r.rollout_id for r in good] == ["t8-s0"]
        dead = read_dead_letters(q.r, keys.dead)
        assert [d["data"] for d in dead] == payloads[:2]
        assert dead[0]["reason"].startswith("undecodable ScoredRollout")
        assert dead[1]["reason"] == "inconsistent ScoredRollout t7-s0: teacher_entropies has non-finite values"
        assert q.length() == 1 and q.pending_count() == 1  # only the good entry, still unacknowledged
